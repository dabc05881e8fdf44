"""The llama.cpp stage backend: one layer range, many sequences, one `llama_decode` per batch.

A batch is a list of segments; each is a run of consecutive positions of one
sequence (a decode step is a segment of one token, a prefill chunk a longer one).
Everything a segment claims is checked before llama.cpp sees it, and a failed
decode removes what it wrote to the KV cache, so every sequence stays exactly as
it was. The backend is synchronous and single-owner: the engine calls it from one
worker thread at a time.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as lc
import numpy as np
import numpy.typing as npt

from engine.batch_buffer import BatchBuffer
from engine.gguf_facts import KEY_LAYER_END, KEY_LAYER_START, KEY_SOURCE_BLOCKS, KEY_SOURCE_MODEL
from engine.hidden_capture import HiddenCapture
from engine.kernels import KERNEL_CHOICES
from engine.kv_compaction import Compaction, compact
from engine.llama_handles import LlamaContext, LlamaModel, SamplerChain, capture_llama_log, logged_buffers
from engine.messages import Output
from engine.process_memory import release_free_heap
from engine.window_pins import WindowPins, context_sequences
from protocol.errors import ErrorCode, Fault
from protocol.sampling import GREEDY, Sampling

# KV cache element types: name -> (ggml type id, bytes per element)
KV_TYPES = {"f32": (0, 4), "f16": (1, 2)}


class DecodeOutcome(enum.IntEnum):
    """`llama_decode` return codes; negative codes are fatal errors."""

    OK = 0
    NO_KV_SLOT = 1
    ABORTED = 2
    FATAL = -1

    @classmethod
    def of(cls, rc: int) -> DecodeOutcome:
        return cls.FATAL if rc < 0 else cls(rc) if rc in (0, 1, 2) else cls.FATAL


class DecodeFailed(Exception):
    """llama.cpp failed the batch; every sequence was rolled back to before it."""

    def __init__(self, outcome: DecodeOutcome, rc: int) -> None:
        super().__init__(f"llama_decode failed: {outcome.name} (return code {rc})")
        self.outcome = outcome
        self.rc = rc


@dataclass(frozen=True, slots=True)
class ContextConfig:
    """Explicit llama.cpp parameters of a stage: its context, and the kernel path of its weights."""

    n_seq_max: int = 8
    n_ctx: int = 4096  # KV cells, shared by all sequences (unified cache)
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int = 2
    swa_full: bool = False
    kv_type: str = "f16"  # element type of the K and V caches: "f16" or "f32"
    flash_attn: bool | None = None  # None: llama.cpp decides (its CPU kernel rounds through f16)
    kernels: str = "auto"  # weight kernel path: auto, repack, plain or amx (engine/kernels.py)

    def __post_init__(self) -> None:
        if self.kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(KV_TYPES)}, not {self.kv_type!r}")
        if not 1 <= self.n_ubatch <= self.n_batch:
            raise ValueError(f"need 1 <= n_ubatch ({self.n_ubatch}) <= n_batch ({self.n_batch})")
        if self.n_seq_max < 1 or self.n_ctx < 1 or self.n_threads < 1:
            raise ValueError("n_seq_max, n_ctx and n_threads must be >= 1")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, not {self.kernels!r}")


def context_params(config: ContextConfig) -> lc.llama_context_params:
    """llama.cpp context parameters for `config` (also what a bare loop must use to compare)."""
    params: lc.llama_context_params = lc.llama_context_default_params()
    params.n_ctx = config.n_ctx
    params.n_batch = config.n_batch
    params.n_ubatch = config.n_ubatch
    params.n_seq_max = config.n_seq_max
    params.n_threads = params.n_threads_batch = config.n_threads
    params.kv_unified = True  # rows come back in batch order only with a unified cache
    params.swa_full = config.swa_full
    params.type_k = params.type_v = KV_TYPES[config.kv_type][0]
    if config.flash_attn is not None:
        params.flash_attn_type = int(config.flash_attn)  # LLAMA_FLASH_ATTN_TYPE_{DISABLED,ENABLED}
    params.no_perf = True
    return params


@dataclass(frozen=True, slots=True)
class StageInfo:
    """What a stage serves (PROTOCOL.md `opened.stage`)."""

    first: bool
    last: bool
    layers: tuple[int, int]
    n_embd: int
    n_vocab: int
    n_layer: int
    n_swa: int
    model: str
    arch: str


@dataclass(frozen=True, slots=True)
class Segment:
    """Consecutive positions pos..pos+n-1 of sequence `seq`: token ids or hidden rows."""

    seq: int
    pos: int
    tokens: npt.NDArray[np.int32] | None = None
    hidden: npt.NDArray[np.float32] | None = None
    output: Output = Output.NONE
    continues: bool = False  # a later part of the same step: undoing the step may reach its earlier parts

    @property
    def n(self) -> int:
        if self.tokens is not None:
            return len(self.tokens)
        return 0 if self.hidden is None else len(self.hidden)


@dataclass(frozen=True, slots=True)
class SegmentResult:
    seq: int
    hidden: npt.NDArray[np.float32] | None = None
    logits: npt.NDArray[np.float32] | None = None
    token: int | None = None
    tokens: npt.NDArray[np.int32] | None = None


# What a last stage may give, and which of those need every row's logits.
_LAST_OUTPUTS = (Output.LOGITS, Output.TOKEN, Output.TOKENS)


@dataclass(slots=True)
class _Sequence:
    length: int = 0
    sampler: SamplerChain | None = None


class StageBackend:
    """Runs one layer range of a GGUF model for up to `n_seq_max` sequences."""

    def __init__(self, model_path: Path, config: ContextConfig) -> None:
        self.config = config
        self.model = LlamaModel(model_path, config.kernels)
        m = self.model
        start = int(m.meta(KEY_LAYER_START) or 0)
        source_blocks = int(m.meta(KEY_SOURCE_BLOCKS) or m.n_layer)
        end = int(m.meta(KEY_LAYER_END) or start + m.n_layer)  # a capture block after them is not computed
        self.info = StageInfo(
            first=start == 0,
            last=end == source_blocks,
            layers=(start, end),
            n_embd=m.n_embd,
            n_vocab=m.n_vocab,
            n_layer=end - start,
            n_swa=m.n_swa,
            model=m.meta(KEY_SOURCE_MODEL) or m.meta("general.name") or model_path.stem,
            arch=m.meta("general.architecture") or "",
        )
        capture = None if self.info.last else HiddenCapture(self.info.n_layer, m.n_embd, config.n_batch)
        # With a capture block the last computed layer sees every row without outputs (neuron_tai/shard.py).
        self.capture_all = capture is not None and m.n_layer > self.info.n_layer
        params = context_params(config)
        params.n_seq_max = context_sequences(config.n_seq_max, m.n_swa)  # with a pin sequence each
        if capture is not None:
            params.cb_eval = capture.callback
        if self.capture_all:
            params.n_outputs_max = params.n_seq_max  # no output rows: no graph nor buffer for logits
        try:
            with capture_llama_log() as lines:
                self.ctx = LlamaContext(m, params)
        except BaseException:
            m.close()
            raise
        self.context_log = lines
        self._batch = BatchBuffer(config.n_batch, 0 if self.info.first else m.n_embd)
        self._capture = capture
        self._seqs: dict[int, _Sequence] = {}
        pinned = params.n_seq_max > config.n_seq_max
        self.pins = WindowPins(self.ctx, config.n_seq_max, m.n_swa) if pinned else None
        self.decode_seconds = 0.0  # time spent inside llama_decode, for overhead accounting
        self.decode_calls = 0
        release_free_heap()  # what loading freed is not held for allocations that never come

    @property
    def compute_buffer_bytes(self) -> int:
        """llama.cpp's compute buffer for this context, as it logged it at creation."""
        return sum(logged_buffers(self.context_log, "compute").values())

    def output_buffer_bytes(self) -> int:
        """The logits buffer llama.cpp may grow to: a row per output row, and a last stage's calls
        ask for up to a whole batch of them (`out: "tokens"`: every row of a step)."""
        rows = 0 if self.capture_all else self.config.n_batch
        return 4 * self.info.n_vocab * max(rows, self.ctx.n_seq_max)  # llama.cpp reserves a row per sequence id

    # -- sequences ---------------------------------------------------------------

    def open_sequence(self, sampling: Sampling = GREEDY) -> int:
        """Claim a free sequence id."""
        free = next((s for s in range(self.config.n_seq_max) if s not in self._seqs), None)
        if free is None:
            raise Fault(ErrorCode.SESSION_LIMIT, f"all {self.config.n_seq_max} sequences are in use")
        sampler = None
        if self.info.last:
            sampler = SamplerChain(
                sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed, self.info.n_vocab
            )
        self._seqs[free] = _Sequence(sampler=sampler)
        return free

    def close_sequence(self, seq: int) -> None:
        """Free a sequence's KV and sampler; closing an unknown sequence does nothing."""
        state = self._seqs.pop(seq, None)
        if state is None:
            return
        self._unpin(seq)
        self.ctx.seq_rm(seq, 0, -1)
        if state.sampler is not None:
            state.sampler.close()

    def retire_sequence(self, seq: int, graveyard: int) -> int:
        """Free a sequence id but keep its cells occupied under `graveyard`; returns the cells held.

        New tokens go to the lowest free cells: freeing a closed session's cells in the middle
        of the cache would put later tokens of live sessions before their earlier ones, and
        flash attention accumulates in cell order. Holding them keeps live layouts unchanged
        until `compact` frees them.
        """
        state = self._seqs.pop(seq, None)
        if state is None:
            return 0
        self._unpin(seq)
        self.ctx.seq_cp(seq, graveyard)
        self.ctx.seq_rm(seq, 0, -1)
        if state.sampler is not None:
            state.sampler.close()
        return state.length

    def release_graveyard(self, graveyard: int) -> None:
        self.ctx.seq_rm(graveyard, 0, -1)

    def compact(self, graveyard: int) -> Compaction:
        """Free the cells held under `graveyard` while sequences stay open, each keeping its cells
        in their order (engine/kv_compaction.py). A sequence whose cells could not be put back
        is left empty, at length 0: its session must be closed."""
        lengths = {seq: state.length for seq, state in self._seqs.items() if seq != graveyard}
        result = compact(self.ctx, lengths)
        if self.pins is not None:
            self.pins.forget()
        for seq in result.lost:
            self._seqs[seq].length = 0
        return result

    def length(self, seq: int) -> int:
        return self._known(seq).length

    @property
    def open_sequences(self) -> int:
        return len(self._seqs)

    def can_rewind(self, seq: int, pos: int) -> bool:
        """Whether the cache still holds what recomputing from `pos` needs.

        Sliding-window layers keep only recent positions: llama.cpp reuses cells that slid
        out of a window, and a compaction copies only the window. A token at `pos` attends
        to positions pos-n_swa+1..pos, which must still be there. Undoing the last step is
        always possible while its cells are pinned (engine/window_pins.py).
        """
        state = self._known(seq)
        if not 0 <= pos <= state.length:
            return False
        if pos in (state.length, 0) or self.info.n_swa <= 0:
            return True
        return self.ctx.seq_pos_min(seq) <= max(0, pos - self.info.n_swa + 1)

    def rewind(self, seq: int, pos: int, hold_in: int | None = None) -> int:
        """Drop positions pos.. of a sequence; refused when the cache cannot honour it.

        `hold_in`: keep the dropped cells occupied under that sequence (as `retire_sequence`
        does) instead of freeing them in the middle of the cache; returns the cells held.
        """
        state = self._known(seq)
        if pos > state.length or pos < 0:
            raise Fault(ErrorCode.POSITION, f"cannot rewind to {pos}: sequence holds {state.length} positions")
        if not self.can_rewind(seq, pos):
            raise Fault(
                ErrorCode.POSITION,
                f"cannot rewind to {pos}: the sliding-window cache (window {self.info.n_swa}) "
                f"no longer holds positions before {self.ctx.seq_pos_min(seq)}",
            )
        held = 0
        if pos < state.length:
            self._unpin(seq)  # the window is back where nothing it needs can be given away
            if hold_in is not None:
                self.ctx.seq_cp(seq, hold_in, pos)
                held = state.length - pos
            self.ctx.seq_rm(seq, pos, -1)
            state.length = pos
        return held

    def _unpin(self, seq: int) -> None:
        if self.pins is not None:
            self.pins.release(seq)

    def _known(self, seq: int) -> _Sequence:
        state = self._seqs.get(seq)
        if state is None:
            raise Fault(ErrorCode.UNKNOWN_SESSION, f"no open sequence {seq}")
        return state

    # -- decoding ----------------------------------------------------------------

    def validate(self, segments: Sequence[Segment]) -> None:
        """Refuse a batch that llama.cpp must not see; changes nothing."""
        seen, total = set(), 0
        for s in segments:
            state = self._known(s.seq)
            if s.seq in seen:
                raise Fault(ErrorCode.BAD_REQUEST, f"sequence {s.seq} appears twice in one batch")
            seen.add(s.seq)
            if s.n < 1:
                raise Fault(ErrorCode.BAD_REQUEST, "a segment needs at least one row")
            if s.pos != state.length:
                raise Fault(
                    ErrorCode.POSITION, f"sequence {s.seq}: segment starts at {s.pos}, sequence holds {state.length}"
                )
            self.check_segment(s.tokens, s.hidden, s.output)
            total += s.n
        if total > self.config.n_batch:
            raise Fault(ErrorCode.TOO_LARGE, f"batch of {total} rows exceeds n_batch {self.config.n_batch}")

    def check_payload(
        self, tokens: npt.NDArray[np.int32] | None, hidden: npt.NDArray[np.float32] | None, output: Output
    ) -> None:
        """Refuse a request's input or output this stage cannot take, before it can share a batch:
        what `check_segment` checks, and that hidden states are finite. The engine asks once per
        step as it arrives; a decode does not scan every value again."""
        self.check_segment(tokens, hidden, output)
        if hidden is not None and not np.isfinite(hidden).all():
            raise Fault(ErrorCode.BAD_REQUEST, "hidden states must be finite (no NaN or Inf)")

    def check_segment(
        self, tokens: npt.NDArray[np.int32] | None, hidden: npt.NDArray[np.float32] | None, output: Output
    ) -> None:
        """Refuse what llama.cpp must never see: the wrong input kind or output, a hidden state of
        the wrong width, a token id outside the vocabulary (every decode checks this)."""
        info = self.info
        if (tokens is None) == (hidden is None):
            raise Fault(ErrorCode.BAD_REQUEST, "a segment carries either tokens or hidden states")
        if (info.first and tokens is None) or (not info.first and hidden is None):
            want = "token ids" if info.first else "hidden states"
            raise Fault(ErrorCode.WRONG_STAGE, f"this stage (layers {info.layers[0]}-{info.layers[1]}) takes {want}")
        if output in _LAST_OUTPUTS and not info.last:
            raise Fault(ErrorCode.WRONG_STAGE, f"only a last stage gives {output.value}; this one gives hidden")
        if output is Output.HIDDEN and info.last:
            raise Fault(ErrorCode.WRONG_STAGE, "a last stage gives logits or tokens, not hidden states")
        if tokens is not None:
            if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= info.n_vocab):
                raise Fault(ErrorCode.BAD_REQUEST, f"token ids must be in [0, {info.n_vocab})")
        elif hidden is not None and (hidden.ndim != 2 or hidden.shape[1] != info.n_embd):
            raise Fault(ErrorCode.BAD_REQUEST, f"hidden states must be [n, {info.n_embd}], got {list(hidden.shape)}")

    def decode(self, segments: Sequence[Segment]) -> list[SegmentResult]:
        """Run one batch; returns one result per segment, in order."""
        self.validate(segments)
        self._batch.clear()
        rows: list[range] = []
        for s in segments:
            outputs = s.output is Output.TOKENS or (s.output in (Output.HIDDEN, Output.PAD) and not self.capture_all)
            r = self._batch.add(s.seq, s.pos, tokens=s.tokens, hidden=s.hidden, outputs=outputs)
            if s.output in (Output.LOGITS, Output.TOKEN):
                self._batch.logits[r.stop - 1] = 1
            rows.append(r)
        if self._capture is not None:
            self._capture.reset()
        if self.pins is not None:
            for s in segments:
                self.pins.before(s.seq, s.pos, s.n, continues=s.continues)
        started = time.perf_counter()
        rc = self.ctx.decode(self._batch.view())
        self.decode_seconds += time.perf_counter() - started
        self.decode_calls += 1
        expected = sum(s.n for s in segments if self.capture_all or s.output in (Output.HIDDEN, Output.PAD))
        if rc == 0 and self._capture is not None and (self._capture.overflow or self._capture.rows != expected):
            rc = -100  # the capture did not see the rows it must: treat as fatal, roll back
        if rc != 0:
            for s in segments:
                self.ctx.seq_rm(s.seq, self._seqs[s.seq].length, -1)
            raise DecodeFailed(DecodeOutcome.of(rc), rc)
        if self.pins is not None:
            for s in segments:
                self.pins.after(s.seq, s.pos, s.n)
        return self._collect(segments, rows)

    def _collect(self, segments: Sequence[Segment], rows: list[range]) -> list[SegmentResult]:
        results: list[SegmentResult] = []
        captured = 0
        for s, r in zip(segments, rows, strict=True):
            state = self._seqs[s.seq]
            state.length += s.n
            if s.output is Output.HIDDEN:
                assert self._capture is not None
                hidden = self._capture.buffer[captured : captured + s.n].copy()
                captured += s.n
                results.append(SegmentResult(s.seq, hidden=hidden))
            elif s.output is Output.PAD or (self.capture_all and s.output is Output.NONE):
                captured += s.n if self._capture is not None else 0
                results.append(SegmentResult(s.seq))
            elif s.output is Output.LOGITS:
                row = np.ctypeslib.as_array(self.ctx.logits_row(r.stop - 1), shape=(self.info.n_vocab,))
                results.append(SegmentResult(s.seq, logits=row.copy()))
            elif s.output is Output.TOKEN:
                assert state.sampler is not None
                results.append(SegmentResult(s.seq, token=state.sampler.sample(self.ctx, r.stop - 1, state.length)))
            elif s.output is Output.TOKENS:
                results.append(SegmentResult(s.seq, tokens=self._row_tokens(state, s.pos, r)))
            else:
                results.append(SegmentResult(s.seq))
        return results

    def _row_tokens(self, state: _Sequence, pos: int, rows: range) -> npt.NDArray[np.int32]:
        """Row i's token as `Output.TOKEN` would have sampled it had the step ended at row i.

        The sampler draws from (seed, position of the sampled token), so sampling the rows one
        by one in order is exactly what as many one-row steps would have drawn, and a rewind
        leaves nothing behind in it.
        """
        assert state.sampler is not None
        sample = state.sampler.sample
        return np.array([sample(self.ctx, row, pos + i + 1) for i, row in enumerate(rows)], np.int32)

    # -- vocabulary ---------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.model.tokenize(text, add_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        bad = [t for t in tokens if not 0 <= t < self.info.n_vocab]
        if bad:
            raise Fault(ErrorCode.BAD_REQUEST, f"token ids must be in [0, {self.info.n_vocab}), got {bad[:4]}")
        return self.model.detokenize(list(tokens))

    # -- lifetime -----------------------------------------------------------------

    def close(self) -> None:
        """Free samplers, then the context, then the model; safe to call twice."""
        for state in self._seqs.values():
            if state.sampler is not None:
                state.sampler.close()
        self._seqs.clear()
        if hasattr(self, "ctx"):
            self.ctx.close()
        self.model.close()

    def __enter__(self) -> StageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
