"""What the engine is asked and what it answers: plain frozen data, no transport, no Trio.

A leaf: it imports neither llama.cpp nor the backend, so the node, the scheduler's
tests and any client of the engine can use these types without loading a model
library. Refusals are `protocol.errors.Fault`, the one error carrier.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from protocol.errors import Fault
from protocol.sampling import GREEDY, Sampling

Owner = Hashable  # the connection a session belongs to


class Output(enum.Enum):
    """What a step (or one segment of a batch) wants back."""

    NONE = "none"  # a prefill chunk that is not the last of its step
    HIDDEN = "hidden"  # every row's hidden state (non-last stages)
    LOGITS = "logits"  # the last row's logits (last stage)
    TOKEN = "token"  # a token sampled from the last row (last stage)
    TOKENS = "tokens"  # one token sampled from every row, as if each ended the step (last stage)
    PAD = "pad"  # padding rows: computed as outputs (fixed batch shape), nothing returned


@dataclass(frozen=True, slots=True)
class OpenRequest:
    owner: Owner
    session: str
    max_tokens: int
    sampling: Sampling = GREEDY
    wait_ms: int = 0


@dataclass(frozen=True, slots=True)
class StepRequest:
    owner: Owner
    session: str
    pos: int
    out: Output
    tokens: npt.NDArray[np.int32] | None = None
    hidden: npt.NDArray[np.float32] | None = None

    @property
    def n(self) -> int:
        data = self.tokens if self.tokens is not None else self.hidden
        return 0 if data is None else len(data)

    @property
    def nbytes(self) -> int:
        data = self.tokens if self.tokens is not None else self.hidden
        return 0 if data is None else int(data.nbytes)


@dataclass(frozen=True, slots=True)
class StepsEnded:
    """An in-process requester (server-side `generate`) sends no further step for the session:
    the loop stops holding a batch for one. A hint, never answered: lost, it costs one linger."""

    owner: Owner
    session: str


@dataclass(frozen=True, slots=True)
class CloseRequest:
    owner: Owner
    session: str


@dataclass(frozen=True, slots=True)
class Rollback:
    """Undo a completed step whose result could not be delivered downstream: back to `pos`."""

    owner: Owner
    session: str
    pos: int
    opening: int | None = None  # the session's `StepDone.opening`: one opened again since is left alone


@dataclass(frozen=True, slots=True)
class DropOwner:
    """The owner's connection is gone: free all its sessions."""

    owner: Owner


Request = OpenRequest | StepRequest | CloseRequest | Rollback | DropOwner


@dataclass(frozen=True, slots=True)
class Opened:
    """A session is open, with `max_tokens` KV cells reserved for it."""

    session: str
    max_tokens: int

    @property
    def kv_reserved(self) -> int:
        """The wire's name for `max_tokens` (cells are reserved up front)."""
        return self.max_tokens


@dataclass(frozen=True, slots=True)
class StepDone:
    """A completed step, with the session's state after it: nothing needs to ask the engine again."""

    session: str
    pos: int
    n: int
    out: Output
    length: int  # positions the session holds now (pos + n)
    max_tokens: int  # the session's reserved cells: the most `length` may grow to
    hidden: npt.NDArray[np.float32] | None = None
    logits: npt.NDArray[np.float32] | None = None
    token: int | None = None
    tokens: npt.NDArray[np.int32] | None = None  # `Output.TOKENS`: one per row
    opening: int | None = None  # which opening of the session it ran in (`Rollback.opening`)


@dataclass(frozen=True, slots=True)
class Closed:
    session: str
    existed: bool


Result = Opened | StepDone | Closed | Fault

# Requests that only free what exists: the engine takes them even when its inbox is full
# or it is draining (Engine.cleanup), so an undo the requester was promised always happens.
Cleanup = CloseRequest | Rollback | DropOwner


class EndReason(enum.Enum):
    """Why the engine freed a session."""

    CLOSED = "closed"  # a CloseRequest
    ROLLBACK_FAILED = "rollback_failed"  # a Rollback it could not go back for
    OWNER_GONE = "owner_gone"  # a DropOwner: its connection is gone
    REQUESTER_GONE = "requester_gone"  # nobody waited for its open or its step's result
    IDLE = "idle"  # idle past the idle timeout
    BACKEND_FAILED = "backend_failed"  # a failed decode it could not be rolled back from
    COMPACTION_LOST = "compaction_lost"  # a compaction could not put its KV cells back
    SHUTDOWN = "shutdown"  # the engine stopped: every session still open ends with it


@dataclass(frozen=True, slots=True)
class SessionEnded:
    """The engine freed this session: sent once per session, whatever the reason."""

    owner: Owner
    session: str
    reason: EndReason


@dataclass(frozen=True, slots=True)
class CloseAnswered:
    """A CloseRequest taken on the cleanup path is done; `existed`: it freed an open session
    (then its SessionEnded came just before). Closes of one session merged before the engine
    ran them are answered once each, only the first with `existed` possibly true."""

    owner: Owner
    session: str
    existed: bool


SessionEnd = SessionEnded | CloseAnswered  # what `Engine.session_ends` carries
