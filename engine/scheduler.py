"""Continuous-batching scheduler: admission, one step per session, decode-first plans.

Pure (no Trio, no llama.cpp): the engine feeds it requests and the clock, runs the
plans it returns, and reports back. The policy (DESIGN.md):

- Decode first: every session with a ready single-token step gets a row, FCFS by
  step arrival. Prefill chunks fill the rest of the batch, at most
  `max_prefill_tokens` per iteration, round-robin across prefilling sessions; a
  step larger than that is split across iterations and answered once complete.
- One outstanding step per session; another is `busy`.
- `open` reserves KV cells for `max_tokens` up front (never over-committed), so no
  preemption is ever needed. When a slot or cells are short, the request waits up
  to `wait_ms` (at most `max_wait_ms`) in a bounded queue, then is rejected with a
  retry estimate. An open that fits is admitted even while larger ones wait, but no
  waiting open is overtaken more than `max_overtakes` times: from then on it holds
  admission until it fits or expires, so small opens cannot starve a large one.
- Per-owner quotas (an owner is a connection): open sessions, and waiting opens. An open
  whose owner holds its quota of sessions is refused at once, never queued; a waiting
  open whose owner has reached it by its turn is refused then, never admitted. One over
  its owner's waiting quota is refused as if the waiting places were all taken. Unset,
  they are the node's own limits: one owner (a chain's head forwarding all its sessions)
  may use the whole node.
- Queued payload bytes are bounded; over the budget a step is `busy` at once.
- Micro-batches (`micro_batches` > 1, a chain's head): every session belongs to one of
  that many groups for its whole life (admitted to the smallest), and an iteration runs
  one call per group with work, so a group's replies go out (to the next stage) while
  the next group computes. Every ready decode is still planned in every iteration.
- Halves: an iteration of only decodes may run each call as two of half the rows, when
  the engine measured two such calls cheaper than one (engine/call_split.py).
- Row blocks (`row_blocks`, llama.cpp's repacked weights): a call whose prefill the budget
  cuts short leaves the rows past a multiple of `row_multiple` to the next iteration, and
  any call gets the few filler rows that save passes over the weights
  (engine/row_blocks.py): 15 rows run as 16.
- Batch-invariant mode: decode rows are padded to a multiple of `pad_rows` and each
  prefill chunk runs in a call of its own with boundaries fixed by position, padded the
  same way, so a session's batch shapes do not depend on what else is being served, and
  every row is computed by the same kernels whether it came as a decode step or in a
  prefill: a session replayed as one prefill (recovery) rebuilds its KV bit for bit. A closed session's
  cells (and a rewound session's tail) stay held until the engine compacts the cache; an
  open that fits once they are freed waits for that (also with no `wait_ms`), and held
  cells past `compact_held_cells` or past what the reservations leave ask for a
  compaction on their own.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from engine.call_split import split_at
from engine.pacing import Demand
from engine.row_blocks import filler_rows
from protocol.errors import ErrorCode, Fault

SessionKey = Any  # any hashable; the engine uses (connection, session id)
Owner = Hashable  # who an open counts against for the per-owner quotas; the engine: the connection
StepPayload = TypeVar("StepPayload")  # what the engine keeps with a step (its input, where its reply goes)
OpenPayload = TypeVar("OpenPayload")  # what the engine keeps with a waiting open


# llama.cpp's CPU flash attention tiles calls of 64 or more query rows over the KV cells in
# blocks (GGML_FA_TILE_Q), so their sums depend on where a session's cells sit among other
# sessions' cells. Below that it walks the cells one by one, skipping masked ones. Batch-
# invariant mode keeps every call under this many rows.
INVARIANT_MAX_ROWS = 63


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_sessions: int
    kv_cells: int  # cells sessions may reserve in total
    n_batch: int  # rows one llama_decode call may carry
    max_prefill_tokens: int  # prefill rows per iteration (and the invariant chunk size)
    max_step_tokens: int
    queue_budget_bytes: int
    max_waiting_opens: int = 64
    batch_invariant: bool = False
    pad_rows: int = 8
    max_wait_ms: int = 60_000  # an open's wait_ms is capped to this
    max_overtakes: int = 4  # opens admitted ahead of a waiting one before it blocks admission
    micro_batches: int = 1  # session groups, each run in calls of its own (1: one call for all)
    max_sessions_per_owner: int | None = None  # open sessions; None: max_sessions
    max_waiting_per_owner: int | None = None  # waiting opens; None: max_waiting_opens
    compact_held_cells: int | None = None  # held cells that ask for a compaction with no open waiting
    # A call whose prefill the budget cuts short ends at a multiple of this many rows: llama.cpp's
    # repacked weight matrices take rows in blocks and run each leftover row alone.
    row_multiple: int = 1
    # The kernel's row blocks, largest first: outside batch-invariant mode a call gets filler
    # rows where they save passes over the weights (engine/row_blocks.py). (): none.
    row_blocks: tuple[int, ...] = ()

    @property
    def sessions_per_owner(self) -> int:
        return self.max_sessions if self.max_sessions_per_owner is None else self.max_sessions_per_owner

    @property
    def waiting_per_owner(self) -> int:
        return self.max_waiting_opens if self.max_waiting_per_owner is None else self.max_waiting_per_owner

    @property
    def may_halve(self) -> bool:
        """Whether decode calls may run as halves: not in invariant mode (shapes fixed by position)
        nor with micro-batches (each group's call is already a part of the whole)."""
        return self.micro_batches == 1 and not self.batch_invariant

    def __post_init__(self) -> None:
        if self.sessions_per_owner < 1 or self.waiting_per_owner < 0:
            raise ValueError("need max_sessions_per_owner >= 1 and max_waiting_per_owner >= 0")
        if self.micro_batches < 1:
            raise ValueError(f"need micro_batches >= 1, not {self.micro_batches}")
        if not 1 <= self.max_sessions <= self.n_batch:
            # Decode rows never exceed n_batch - 1 while anyone prefills: prefill always progresses.
            raise ValueError(f"need 1 <= max_sessions ({self.max_sessions}) <= n_batch ({self.n_batch})")
        if not 1 <= self.max_prefill_tokens <= self.n_batch:
            raise ValueError(f"need 1 <= max_prefill_tokens ({self.max_prefill_tokens}) <= n_batch ({self.n_batch})")
        if self.batch_invariant and self.n_batch < _round_up(self.max_sessions, self.pad_rows):
            raise ValueError(f"batch-invariant mode pads decode rows to {self.pad_rows}: n_batch too small")
        padded = max(_round_up(self.max_sessions, self.pad_rows), _round_up(self.max_prefill_tokens, self.pad_rows))
        if self.batch_invariant and padded > INVARIANT_MAX_ROWS:
            raise ValueError(
                f"batch-invariant mode keeps calls to {INVARIANT_MAX_ROWS} rows: max_sessions and max_prefill_tokens "
                f"(each padded to {self.pad_rows}) must not exceed it"
            )
        if self.max_step_tokens < 1 or self.kv_cells < 1 or self.queue_budget_bytes < 0:
            raise ValueError("max_step_tokens and kv_cells must be >= 1, queue_budget_bytes >= 0")
        if self.max_wait_ms < 0 or self.max_overtakes < 0:
            raise ValueError("max_wait_ms and max_overtakes must be >= 0")
        if self.row_multiple < 1:
            raise ValueError(f"need row_multiple >= 1, not {self.row_multiple}")
        if any(b < 1 for b in self.row_blocks) or list(self.row_blocks) != sorted(self.row_blocks, reverse=True):
            raise ValueError(f"row_blocks must be positive, largest first, not {self.row_blocks}")
        if self.compact_held_cells is not None and self.compact_held_cells < 1:
            raise ValueError(f"need compact_held_cells >= 1 (or None), not {self.compact_held_cells}")


@dataclass(slots=True)
class Step(Generic[StepPayload]):
    """An accepted step; `done` rows of it have run."""

    key: SessionKey
    pos: int
    n: int
    nbytes: int
    arrival: int
    payload: StepPayload  # the engine's input and reply handle; opaque here
    done: int = 0
    submitted_iteration: int = 0  # the last iteration planned before it arrived

    @property
    def is_decode(self) -> bool:
        return self.n == 1


@dataclass(slots=True)
class Session(Generic[StepPayload]):
    key: SessionKey
    max_tokens: int
    opened_ms: float
    seq: int = -1  # the backend's sequence id, bound by the engine
    length: int = 0
    step: Step[StepPayload] | None = None
    last_active_ms: float = 0.0
    group: int = 0  # its micro-batch, fixed at admission
    owner: Owner = None
    opening: int = 0  # which admission of the node this is: a session opened again under its name has another


@dataclass(slots=True)
class Waiter(Generic[OpenPayload]):
    key: SessionKey
    max_tokens: int
    deadline_ms: float
    payload: OpenPayload
    overtaken: int = 0  # opens admitted while this one waited ahead of them
    owner: Owner = None


@dataclass(frozen=True, slots=True)
class Chunk:
    """Rows offset..offset+count-1 of a step, at positions pos+offset.."""

    key: SessionKey
    seq: int
    pos: int  # position of the chunk's first row
    offset: int
    count: int
    completes: bool  # the step's last chunk: it produces the reply


@dataclass(frozen=True, slots=True)
class Call:
    """One llama_decode call: chunks, plus padding rows (batch-invariant decode's, or fillers
    that make the call cheaper on a kernel that takes rows in blocks)."""

    chunks: tuple[Chunk, ...]
    pad_rows: int = 0

    @property
    def rows(self) -> int:
        return sum(c.count for c in self.chunks) + self.pad_rows


@dataclass(frozen=True, slots=True)
class Plan:
    iteration: int
    calls: tuple[Call, ...]
    halved: bool = False  # one call's decodes run as two calls (engine/call_split.py): one gap for them

    @property
    def chunks(self) -> Iterable[Chunk]:
        return (c for call in self.calls for c in call.chunks)


@dataclass(slots=True)
class _Estimates:
    """Recent step and session durations, for `retry_after_ms`."""

    step_ms: float = 50.0
    session_ms: float = 5000.0

    def observe_step(self, ms: float) -> None:
        self.step_ms += 0.2 * (ms - self.step_ms)

    def observe_session(self, ms: float) -> None:
        self.session_ms += 0.2 * (ms - self.session_ms)

    def busy_retry_ms(self) -> int:
        """When a `busy` step or open may be tried again: about one step."""
        return max(1, int(self.step_ms))


Admitted = tuple[Waiter[OpenPayload], Session[StepPayload]]  # a waiting open, now a session
Refused = tuple[Waiter[OpenPayload], Fault]  # a waiting open refused (expired, over quota, draining)


def _by_group(sessions: dict[SessionKey, Session[Any]], chunks: list[Chunk]) -> list[tuple[Chunk, ...]]:
    """Chunks split by their sessions' micro-batch; the group whose work came first runs first."""
    groups: dict[int, list[Chunk]] = {}
    for chunk in chunks:  # decodes (in arrival order) first: a group's first chunk is its oldest decode
        groups.setdefault(sessions[chunk.key].group, []).append(chunk)
    return [tuple(g) for g in groups.values()]


def _rows_aligned(sessions: dict[SessionKey, Session[Any]], chunks: list[Chunk], multiple: int) -> list[Chunk]:
    """Chunks whose last prefill chunk, when it stops short of its step's end anyway (the budget
    ended it, not the prompt), gives its call's leftover rows past a multiple of `multiple` to the
    next iteration: the call runs as many row blocks, without rows that cost a block each."""
    last = chunks[-1] if chunks else None
    if multiple <= 1 or last is None or last.completes:
        return chunks
    group = sessions[last.key].group
    cut = sum(c.count for c in chunks if sessions[c.key].group == group) % multiple
    if cut == 0 or last.count <= cut:
        return chunks
    return [*chunks[:-1], replace(last, count=last.count - cut)]


def _prefill_chunks(
    sessions: dict[SessionKey, Session[Any]],
    rr: deque[SessionKey],
    budget: int,
    aligned_to: int | None,
    limit_sessions: int | None = None,
) -> list[Chunk]:
    """Round-robin: serve the prefilling sessions of `rr` in turn; whoever was served goes to the back.
    With `aligned_to`, chunk boundaries fall at its multiples: independent of load."""
    chunks: list[Chunk] = []
    served: list[SessionKey] = []
    for key in list(rr):
        if budget <= 0 or (limit_sessions is not None and len(served) >= limit_sessions):
            break
        session = sessions[key]
        step = session.step
        assert step is not None
        start = step.pos + step.done
        count = min(step.n - step.done, budget)
        if aligned_to is not None:
            count = min(count, (start // aligned_to + 1) * aligned_to - start)
        chunks.append(Chunk(key, session.seq, start, step.done, count, step.done + count == step.n))
        budget -= count
        served.append(key)
    for key in served:
        rr.remove(key)
        rr.append(key)
    return chunks


def _invariant_calls(
    sessions: dict[SessionKey, Session[Any]], rr: deque[SessionKey], decode_chunks: list[Chunk], cfg: SchedulerConfig
) -> list[Call]:
    """Batch-invariant mode: each group's decodes padded to a multiple of `pad_rows`, then one
    prefill chunk of fixed boundaries, padded the same way, in a call of its own."""
    calls = [Call(g, _round_up(len(g), cfg.pad_rows) - len(g)) for g in _by_group(sessions, decode_chunks)]
    prefill = _prefill_chunks(sessions, rr, cfg.max_prefill_tokens, cfg.max_prefill_tokens, limit_sessions=1)
    return calls + [Call((c,), _round_up(c.count, cfg.pad_rows) - c.count) for c in prefill]


def _halved(groups: list[tuple[Chunk, ...]], halves: Callable[[int], bool]) -> list[Call]:
    """Each group's decodes in one call, or in two where `halves` says two cost less."""
    calls = []
    for group in groups:
        if len(group) > 1 and halves(len(group)):
            at = split_at(len(group))
            calls += [Call(group[:at]), Call(group[at:])]
        else:
            calls.append(Call(group))
    return calls


def _with_fillers(
    calls: list[Call], decoding: set[SessionKey], cfg: SchedulerConfig, fillers_pay: Callable[[int], bool] | None
) -> list[Call]:
    """Each call with the filler rows its row blocks offer, unless `fillers_pay` (asked for a call
    of only decodes, whose sessions are all in `decoding`) says they do not pay."""

    def filled(call: Call) -> Call:
        n = filler_rows(call.rows, cfg.row_blocks, cfg.n_batch)
        if n == 0:
            return call
        if fillers_pay is not None and all(c.key in decoding for c in call.chunks) and not fillers_pay(call.rows):
            return call
        return replace(call, pad_rows=n)

    return [filled(call) for call in calls]


def _step_refusal(
    cfg: SchedulerConfig,
    session: Session[Any],
    pos: int,
    n: int,
    can_rewind: Callable[[int, int], bool] | None,
    queued: tuple[int, int],
    retry_ms: int,
) -> Fault | None:
    """Why a step cannot be taken by the session as it stands, or with `queued` (bytes queued
    already, the step's) over the queue budget; None: it can."""
    if session.step is not None:
        return Fault(ErrorCode.BUSY, "the session already has a step in flight", retry_ms)
    if n < 1:
        return Fault(ErrorCode.BAD_REQUEST, "a step needs n >= 1")
    if n > cfg.max_step_tokens:
        return Fault(ErrorCode.TOO_LARGE, f"n={n} exceeds max_step_tokens {cfg.max_step_tokens}")
    if pos < 0 or pos > session.length or pos + n > session.max_tokens:
        return Fault(
            ErrorCode.POSITION,
            f"step at pos={pos} n={n}: session holds {session.length} of max_tokens {session.max_tokens}",
        )
    if pos < session.length and can_rewind is not None and not can_rewind(session.seq, pos):
        return Fault(ErrorCode.POSITION, f"cannot rewind to {pos}: outside the sliding window")
    held, nbytes = queued
    if held + nbytes > cfg.queue_budget_bytes:
        return Fault(ErrorCode.BUSY, f"queue budget full ({held} of {cfg.queue_budget_bytes} bytes)", retry_ms)
    return None


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


@dataclass(slots=True)
class Scheduler(Generic[StepPayload, OpenPayload]):
    """The policy above; the payloads are what the engine keeps with a step and a waiting open."""

    config: SchedulerConfig
    sessions: dict[SessionKey, Session[StepPayload]] = field(default_factory=dict)
    waiting: deque[Waiter[OpenPayload]] = field(default_factory=deque)
    kv_reserved: int = 0
    kv_held: int = 0  # cells of closed sessions and rewound tails not yet released (batch-invariant mode)
    compaction_failed_at: int | None = None  # kv_held when a compaction last failed: not retried at it
    queued_bytes: int = 0
    shutting_down: bool = False
    iteration: int = 0
    estimates: _Estimates = field(default_factory=_Estimates)
    quota_refused: Counter[str] = field(default_factory=Counter)  # opens a per-owner quota refused, by quota
    _arrivals: int = 0
    _openings: int = 0
    _rr: deque[SessionKey] = field(default_factory=deque)  # prefilling sessions, next first

    # -- admission ---------------------------------------------------------------

    def _fits(self, max_tokens: int, held: int | None = None) -> bool:
        free = self.config.kv_cells - self.kv_reserved - (self.kv_held if held is None else held)
        return len(self.sessions) < self.config.max_sessions and max_tokens <= free

    def _at_quota(self, owner: Owner) -> bool:
        """Whether the owner holds its quota of sessions. A quota as large as the node's own limit
        is none: the node's limit answers then (an open may wait for room, as on any full node)."""
        quota = self.config.sessions_per_owner
        return quota < self.config.max_sessions and self.held_by(owner)[0] >= quota

    def _over_quota(self) -> Fault:
        n = self.config.sessions_per_owner
        self.quota_refused["sessions"] += 1
        return Fault(ErrorCode.SESSION_LIMIT, f"this connection holds its quota of {n} sessions", self._retry_ms())

    def _retry_ms(self) -> int:
        """When room for an open may free up: about a session's life shared by the sessions open."""
        return int(min(60_000, max(self.estimates.step_ms, self.estimates.session_ms / max(1, len(self.sessions)))))

    def _fits_once_compacted(self, max_tokens: int) -> bool:
        """Whether an open that does not fit now would, once the held cells are freed."""
        return self._may_compact() and not self._fits(max_tokens) and self._fits(max_tokens, held=0)

    def _may_compact(self) -> bool:
        return self.kv_held > 0 and self.kv_held != self.compaction_failed_at and not self.shutting_down

    def _shortage(self, max_tokens: int) -> Fault:
        cfg = self.config
        retry = self._retry_ms()
        if len(self.sessions) >= cfg.max_sessions:
            return Fault(ErrorCode.SESSION_LIMIT, f"the node holds its maximum of {cfg.max_sessions} sessions", retry)
        free = cfg.kv_cells - self.kv_reserved - self.kv_held
        return Fault(ErrorCode.KV_BUDGET, f"{max_tokens} KV cells requested, {free} of {cfg.kv_cells} free", retry)

    def request_open(
        self,
        key: SessionKey,
        max_tokens: int,
        wait_ms: int,
        now_ms: float,
        payload: OpenPayload,
        owner: Owner = None,
    ) -> Session[StepPayload] | Waiter[OpenPayload] | Fault:
        """Admit now, queue for up to `wait_ms`, or refuse with a reason. An open that could not
        fit even on an empty node is `too_large` (never retryable); one that may fit later, the
        shortage (`kv_budget`, `session_limit`) with a retry estimate."""
        cfg = self.config
        if self.shutting_down:
            return Fault(ErrorCode.SHUTTING_DOWN, "the node is draining")
        if max_tokens < 1:
            return Fault(ErrorCode.BAD_REQUEST, "max_tokens must be >= 1")
        if key in self.sessions or any(w.key == key for w in self.waiting):
            return Fault(ErrorCode.SESSION_EXISTS, "a session with this id is open")
        if max_tokens > cfg.kv_cells:
            # Cells are one unified cache: the context one sequence may have is the whole cache.
            return Fault(
                ErrorCode.TOO_LARGE,
                f"max_tokens {max_tokens} exceeds the node's {cfg.kv_cells} KV cells (the most one session may hold)",
            )
        if self._at_quota(owner):
            return self._over_quota()
        if self._fits(max_tokens) and self._may_overtake():
            for w in self.waiting:
                w.overtaken += 1
            return self._admit(key, max_tokens, now_ms, owner)
        wait_ms = min(wait_ms, cfg.max_wait_ms)
        compacting = self._fits_once_compacted(max_tokens) and self._may_overtake()
        if (wait_ms > 0 or compacting) and len(self.waiting) < cfg.max_waiting_opens:
            if self.held_by(owner)[1] < cfg.waiting_per_owner:
                waiter = Waiter(key, max_tokens, now_ms + wait_ms, payload, owner=owner)
                self.waiting.append(waiter)
                return waiter
            short = self._shortage(max_tokens)
            quota = f"; this connection already has its quota of {cfg.waiting_per_owner} waiting opens"
            self.quota_refused["waiting"] += 1
            return Fault(short.code, short.message + quota, short.retry_after_ms)
        return self._shortage(max_tokens)

    def held_by(self, owner: Owner) -> tuple[int, int]:
        """The owner's open sessions and waiting opens (counted, not tracked: nothing to drift)."""
        return (
            sum(1 for s in self.sessions.values() if s.owner == owner),
            sum(1 for w in self.waiting if w.owner == owner),
        )

    def _admit(self, key: SessionKey, max_tokens: int, now_ms: float, owner: Owner) -> Session[StepPayload]:
        sizes = [0] * self.config.micro_batches
        for other in self.sessions.values():
            sizes[other.group] += 1
        group = sizes.index(min(sizes))
        self._openings += 1
        session: Session[StepPayload] = Session(
            key, max_tokens, opened_ms=now_ms, last_active_ms=now_ms, group=group, owner=owner, opening=self._openings
        )
        self.sessions[key] = session
        self.kv_reserved += max_tokens
        return session

    def _may_overtake(self) -> bool:
        """Whether an open may be admitted ahead of those waiting. Every admission counts
        against all opens waiting ahead of it, so the oldest has been overtaken most."""
        return not self.waiting or self.waiting[0].overtaken < self.config.max_overtakes

    def poll_waiting(
        self, now_ms: float
    ) -> tuple[list[Admitted[OpenPayload, StepPayload]], list[Refused[OpenPayload]]]:
        """Admit, oldest first, the waiters that fit (bounded overtaking); expire those past their
        deadline (and admit again behind an expired one that held admission). A waiter whose turn
        comes while its owner holds its quota of sessions is refused with the expired ones."""
        expired: list[Refused[OpenPayload]] = []
        admitted = self._admit_waiting(now_ms, expired)
        for w in list(self.waiting):
            if self.shutting_down or w.deadline_ms <= now_ms:
                self.waiting.remove(w)
                why = Fault(ErrorCode.SHUTTING_DOWN, "the node is draining") if self.shutting_down else None
                expired.append((w, why or self._shortage(w.max_tokens)))
        if expired:
            admitted += self._admit_waiting(now_ms, expired)
        return admitted, expired

    def _admit_waiting(
        self, now_ms: float, refused: list[Refused[OpenPayload]]
    ) -> list[Admitted[OpenPayload, StepPayload]]:
        admitted: list[Admitted[OpenPayload, StepPayload]] = []
        i = 0
        while i < len(self.waiting) and not self.shutting_down:
            w = self.waiting[i]
            turn = self._fits(w.max_tokens) and (i == 0 or self._may_overtake())
            if turn and self._at_quota(w.owner):
                del self.waiting[i]  # not an admission: nobody was overtaken
                refused.append((w, self._over_quota()))
            elif turn:
                del self.waiting[i]
                for ahead in list(self.waiting)[:i]:
                    ahead.overtaken += 1
                admitted.append((w, self._admit(w.key, w.max_tokens, now_ms, w.owner)))
            elif self._may_overtake():
                i += 1
            else:
                break
        return admitted

    def drop_waiting(self, owner: Owner) -> list[Waiter[OpenPayload]]:
        """Forget the owner's waiting opens (its connection is gone); they are returned to be answered."""
        dropped = [w for w in self.waiting if w.owner == owner]
        for w in dropped:
            self.waiting.remove(w)
        return dropped

    def next_deadline_ms(self) -> float | None:
        return min((w.deadline_ms for w in self.waiting), default=None)

    def close(self, key: SessionKey, now_ms: float) -> Session[StepPayload] | None:
        """Forget a session (and its pending step, returned on the session); None if unknown."""
        session = self.sessions.pop(key, None)
        if session is None:
            return None
        self.kv_reserved -= session.max_tokens
        if session.step is not None:
            self.queued_bytes -= session.step.nbytes
        if key in self._rr:
            self._rr.remove(key)
        self.estimates.observe_session(now_ms - session.opened_ms)
        return session

    # -- steps -------------------------------------------------------------------

    def submit(
        self,
        key: SessionKey,
        pos: int,
        n: int,
        nbytes: int,
        now_ms: float,
        payload: StepPayload,
        can_rewind: Callable[[int, int], bool] | None = None,
    ) -> Step[StepPayload] | Fault:
        """Accept a step or refuse it; an accepted rewind (pos < length) shortens the session.

        The one place a step's session state is checked. `can_rewind(seq, pos)` says whether
        the backend can still go back to `pos` (a sliding window forgets); None: always.
        """
        if self.shutting_down:
            return Fault(ErrorCode.SHUTTING_DOWN, "the node is draining")
        session = self.sessions.get(key)
        if session is None:
            return Fault(ErrorCode.UNKNOWN_SESSION, "no such open session on this connection")
        retry_ms = self.estimates.busy_retry_ms()
        refused = _step_refusal(self.config, session, pos, n, can_rewind, (self.queued_bytes, nbytes), retry_ms)
        if refused is not None:
            return refused
        self._arrivals += 1
        step = Step(key, pos, n, nbytes, self._arrivals, payload, submitted_iteration=self.iteration)
        session.step = step
        session.length = pos
        session.last_active_ms = now_ms
        self.queued_bytes += nbytes
        if not step.is_decode:
            self._rr.append(key)
        return step

    @property
    def pending_steps(self) -> int:
        return sum(1 for s in self.sessions.values() if s.step is not None)

    # -- planning ----------------------------------------------------------------

    def demand(self) -> Demand:
        """Who the next iteration would serve: ready decode steps (as many as one call carries), the
        most of them in one call (with micro-batches, the largest group's), and sessions waiting
        to prefill (a multi-row step: a prompt, or a verification's rows)."""
        ready = [s.group for s in self.sessions.values() if s.step is not None and s.step.is_decode]
        decoding = min(len(ready), self.config.n_batch)
        if self.config.micro_batches == 1:
            return Demand(decoding, len(self._rr))
        return Demand(decoding, len(self._rr), min(max(Counter(ready).values(), default=0), decoding))

    def plan(
        self,
        prefill_budget: int | None = None,
        halves: Callable[[int], bool] | None = None,
        fillers_pay: Callable[[int], bool] | None = None,
    ) -> Plan | None:
        """The next iteration's llama_decode calls, or None when there is nothing to run.

        `prefill_budget` lowers the prefill rows of an iteration that also carries decodes (sized
        from measured step times; 0: decode-only, to measure a decode step); invariant mode keeps
        fixed chunks. `halves(rows)`: whether a call of only decodes runs as two (call_split.py;
        only where `config.may_halve`). `fillers_pay(rows)`: whether a call of only decodes
        takes the filler rows its row blocks offer (row_blocks.py); a call with prefill does.
        """
        cfg = self.config
        decodes = sorted(
            (s for s in self.sessions.values() if s.step is not None and s.step.is_decode),
            key=lambda s: s.step.arrival if s.step else 0,
        )[: cfg.n_batch]
        decode_chunks = [Chunk(s.key, s.seq, s.length, 0, 1, True) for s in decodes]
        halved = False
        if cfg.batch_invariant:
            calls = _invariant_calls(self.sessions, self._rr, decode_chunks, cfg)
        else:
            budget = min(cfg.n_batch - len(decode_chunks), cfg.max_prefill_tokens)
            if decode_chunks and prefill_budget is not None:
                budget = min(budget, max(0, prefill_budget))
            chunks = decode_chunks + _prefill_chunks(self.sessions, self._rr, budget, None)
            groups = _by_group(self.sessions, _rows_aligned(self.sessions, chunks, cfg.row_multiple))
            if halves is not None and cfg.may_halve and len(chunks) == len(decode_chunks):
                calls = _halved(groups, halves)
                halved = len(calls) > len(groups)
            else:
                calls = [Call(group) for group in groups]
            if cfg.row_blocks:
                calls = _with_fillers(calls, {c.key for c in decode_chunks}, cfg, fillers_pay)
        if not calls:
            return None
        self.iteration += 1
        return Plan(self.iteration, tuple(calls), halved)

    def commit(self, plan: Plan, now_ms: float, step_ms: float) -> list[Step[StepPayload]]:
        """Record a plan that ran; returns the steps it completed (to be answered)."""
        self.estimates.observe_step(step_ms)
        finished: list[Step[StepPayload]] = []
        for chunk in plan.chunks:
            session = self.sessions[chunk.key]
            step = session.step
            assert step is not None and step.pos + step.done == chunk.pos
            step.done += chunk.count
            session.length = chunk.pos + chunk.count
            session.last_active_ms = now_ms
            if chunk.completes:
                finished.append(step)
                session.step = None
                self.queued_bytes -= step.nbytes
                if chunk.key in self._rr:
                    self._rr.remove(chunk.key)
        return finished

    def fail(self, plan: Plan) -> list[Step[StepPayload]]:
        """A plan's call failed: its steps are dropped and their sessions set back to each step's start."""
        failed: list[Step[StepPayload]] = []
        for key in dict.fromkeys(c.key for c in plan.chunks):
            session = self.sessions[key]
            step = session.step
            assert step is not None
            session.length = step.pos
            session.step = None
            self.queued_bytes -= step.nbytes
            if key in self._rr:
                self._rr.remove(key)
            failed.append(step)
        return failed

    def rollback(self, key: SessionKey, pos: int) -> bool:
        """Shorten an idle session to `pos` (a completed step undone); False if it cannot be."""
        session = self.sessions.get(key)
        if session is None or session.step is not None or pos > session.length:
            return False
        session.length = pos
        return True

    def hold(self, cells: int) -> None:
        """Keep cells a closed session (or an open one's rewound tail) left counted until
        `release_held` (batch-invariant mode)."""
        self.kv_held += cells

    def release_held(self) -> int:
        """The held cells are free again (compacted away, or nobody is open); returns how many."""
        released, self.kv_held, self.compaction_failed_at = self.kv_held, 0, None
        return released

    def wants_compaction(self) -> bool:
        """Whether the held cells should be freed: an open waiting for room would fit then, so
        many are held (`compact_held_cells`), or with the rewound tails of open sessions among
        them, open sessions could grow past the cache. Not again at the held count a
        compaction failed at: only once more cells are held."""
        if not self._may_compact():
            return False
        limit = self.config.compact_held_cells
        if (limit is not None and self.kv_held >= limit) or self.kv_reserved + self.kv_held > self.config.kv_cells:
            return True
        return any(self._fits_once_compacted(w.max_tokens) for w in self.waiting)

    def compaction_failed(self) -> None:
        """The cells stay held (nothing changed); opens waiting for them wait for their deadline."""
        self.compaction_failed_at = self.kv_held

    def begin_shutdown(self, now_ms: float) -> list[Refused[OpenPayload]]:
        """Refuse new work from now on; waiting opens are rejected."""
        self.shutting_down = True
        return self.poll_waiting(now_ms)[1]


def idle_sessions(sessions: Mapping[SessionKey, Session[Any]], now_ms: float, idle_ms: float) -> list[SessionKey]:
    """The sessions with no step in flight that have been quiet for `idle_ms`."""
    return [k for k, s in sessions.items() if s.step is None and now_ms - s.last_active_ms >= idle_ms]
