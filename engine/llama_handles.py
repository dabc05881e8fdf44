"""Owned llama.cpp handles: explicit `close()`, safe to call twice, freed in dependency order.

Modelled on llama-cpp-python's `_internals.py`: every C pointer has exactly one
Python owner; a context must be closed before the model it was made from.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import llama_cpp as lc
import numpy as np
import numpy.typing as npt

from engine.gguf_facts import facts_from_header
from engine.gguf_header import Header, read_header
from engine.kernels import (
    AMX_BUFFER,
    REPACK_BUFFER,
    KernelPath,
    Placement,
    WeightTensor,
    choose_path,
    cpu_features,
    path_of_buffers,
    placement,
)
from engine.process_memory import release_mapped_file
from engine.vocab_text import detokenize, tokenize

log = logging.getLogger("llama.cpp")

_init_lock = threading.Lock()
_initialised = False
_log_sinks: list[list[str]] = []
_pending: list[str] = []
_pending_level = 0

# ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continues the previous message
_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
_CONT = 5


def _on_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    global _pending_level
    if level != _CONT:
        _flush_pending()
        _pending_level = level
    piece = text.decode("utf-8", "replace")
    _pending.append(piece)
    if piece.endswith("\n"):
        _flush_pending()


_on_log_c = lc.llama_log_callback(_on_log)  # module-level: llama.cpp keeps the pointer


def _flush_pending() -> None:
    if not _pending:
        return
    line = "".join(_pending).rstrip("\n")
    _pending.clear()
    for sink in _log_sinks:
        sink.append(line)
    log.log(_LEVELS.get(_pending_level, logging.DEBUG), "%s", line)


def ensure_backend() -> None:
    """Initialise llama.cpp once per process and route its log into `logging`."""
    global _initialised
    with _init_lock:
        if not _initialised:
            lc.llama_log_set(_on_log_c, ctypes.c_void_p(0))
            lc.llama_backend_init()
            _initialised = True


@contextmanager
def capture_llama_log() -> Iterator[list[str]]:
    """Collect llama.cpp's log lines while the block runs (buffer sizes are logged there)."""
    lines: list[str] = []
    _log_sinks.append(lines)
    try:
        yield lines
    finally:
        _flush_pending()
        _log_sinks.remove(lines)


class _BuftOverride(ctypes.Structure):
    """llama.h `llama_model_tensor_buft_override` (the binding's own struct has an int where a pointer goes)."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


_LLAMA_LOAD_MODE_NONE = 0  # read into memory
_LLAMA_LOAD_MODE_MMAP = 1
_GGML_BACKEND_DEVICE_TYPE_CPU = 0
_libggml = ctypes.CDLL(str(Path(lc.__file__).parent / "lib" / "libggml.so"))
_libggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
_libggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
_libggml.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
_libggml.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
_libggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_libggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
_libggml.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
_libggml.ggml_backend_buft_name.restype = ctypes.c_char_p
_GetExtraBufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


def extra_buffer_types() -> dict[str, int]:
    """The CPU device's extra weight buffer types in llama.cpp's order of preference: name -> handle.

    Which ones exist is fixed when the library is built (AMX only in a build made for an
    AMX machine); this is what `llama_model_params.use_extra_bufts` would place weights in.
    """
    ensure_backend()
    dev = _libggml.ggml_backend_dev_by_type(_GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        return {}
    reg = _libggml.ggml_backend_dev_backend_reg(dev)
    fn = _libggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not fn:
        return {}
    array = _GetExtraBufts(fn)(dev)
    out: dict[str, int] = {}
    i = 0
    while array and array[i]:
        handle = int(array[i])
        out[_libggml.ggml_backend_buft_name(handle).decode()] = handle
        i += 1
    return out


def logged_buffers(lines: list[str], kind: str = "model") -> dict[str, int]:
    """Bytes per buffer type from llama.cpp's log lines `<type> <kind> buffer size = <x> MiB`
    (kind "model": where the weights went; "compute": the scratch it allocated)."""
    out: dict[str, int] = {}
    for line in lines:
        match = re.search(rf"(\S+) {kind} buffer size\s*=\s*([0-9.]+) MiB", line)
        if match:
            out[match.group(1)] = out.get(match.group(1), 0) + int(float(match.group(2)) * 2**20)
    return out


def weight_placement(path: Path, kernels: str = "auto") -> Placement:
    """How to load `path` for the requested kernel path ("auto", "repack", "plain", "amx") on this machine."""
    offered = extra_buffer_types()
    chosen = choose_path(kernels, offered)
    tensors: list[WeightTensor] = []
    if AMX_BUFFER in offered and chosen is KernelPath.REPACK:  # only then are tensors routed one by one
        tensors = [WeightTensor(t.name, t.ggml_type, t.dims) for t in read_header(path).tensors]
    return placement(chosen, offered, tensors, cpu_features())


def reads_every_weight(header: Header, path: Path) -> bool:
    """Whether a stage of this file computes with all of every weight it does not repack, each step.

    Such a stage gains nothing from mapping its file, so llama.cpp reads it into memory instead:
    it holds the output head, and the head is the token embedding (no `output.weight`), so not
    even the embedding is read row by row. Mapped, a file whose tensors are not grouped by type
    (a model as downloaded; shards are grouped, neuron_tai/shard.py) keeps more: reading each
    small tensor in place maps its page-cache folio's neighbours, the originals of repacked
    matrices among them (the whole 1B shape: 1126.0 MiB mapped, 1047.3 read;
    evidence/tied-head-load/)."""
    return facts_from_header(header, path).last and all(t.name != "output.weight" for t in header.tensors)


def _maps(path: Path) -> bool:
    try:
        return not reads_every_weight(read_header(path), path)
    except (OSError, ValueError):  # not a model: llama.cpp's loader says what is wrong with it
        return True


class OwnedModel:
    """A llama.cpp model pointer with one owner, and text to ids and back with its vocabulary."""

    _ptr: lc.llama_model_p | None = None
    _vocab: lc.llama_vocab_p | None = None

    @property
    def vocab(self) -> lc.llama_vocab_p:
        """The vocabulary's pointer, while the model is open (it is part of the model)."""
        if self._ptr is None or self._vocab is None:
            raise RuntimeError("model is closed")
        return self._vocab

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return tokenize(self.vocab, text, add_special)

    def detokenize(self, tokens: list[int]) -> str:
        return detokenize(self.vocab, tokens)

    def close(self) -> None:
        if self._ptr is not None:
            lc.llama_model_free(self._ptr)
            self._ptr = None
            self._vocab = None

    def __del__(self) -> None:
        self.close()


class LlamaModel(OwnedModel):
    """A loaded (shard) model, memory-mapped, its weights on the kernel path `kernels` asks for.

    `weight_buffers` (bytes per llama.cpp buffer type) and `kernel_path` say where the
    weights actually went, read back from llama.cpp's load log.
    """

    def __init__(self, path: Path, kernels: str = "auto") -> None:
        self._ptr: lc.llama_model_p | None = None  # closed until loaded: __del__ may run after a failed start
        ensure_backend()
        self.placement = weight_placement(path, kernels)
        params = lc.llama_model_default_params()
        self.mapped = _maps(path)
        params.load_mode = _LLAMA_LOAD_MODE_MMAP if self.mapped else _LLAMA_LOAD_MODE_NONE
        params.use_extra_bufts = self.placement.use_extra_bufts
        overrides = None
        if self.placement.repack_patterns:
            repack = extra_buffer_types()[REPACK_BUFFER]
            rows = [_BuftOverride(p.encode(), repack) for p in self.placement.repack_patterns]
            overrides = (_BuftOverride * (len(rows) + 1))(*rows)  # ends with a zeroed row
            params.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
        with capture_llama_log() as lines:
            ptr = lc.llama_model_load_from_file(str(path).encode(), params)
        if not ptr:
            raise ValueError(f"{path}: llama.cpp could not load this model")
        self._ptr = ptr
        self._overrides = overrides  # llama.cpp may read the override table for the model's lifetime
        if self.mapped:
            release_mapped_file(path)  # loading read the whole file; keep resident only what decodes touch
        self.weight_buffers = logged_buffers(lines)
        self.kernel_path = path_of_buffers(self.weight_buffers)
        if self.kernel_path is KernelPath.AMX and self.placement.path is not KernelPath.AMX:
            self.close()
            raise RuntimeError(f"{path}: llama.cpp put weights in the AMX buffer although {kernels!r} was asked for")
        self._vocab = lc.llama_model_get_vocab(ptr)
        self.n_embd = int(lc.llama_model_n_embd(ptr))
        self.n_layer = int(lc.llama_model_n_layer(ptr))
        self.n_vocab = int(lc.llama_vocab_n_tokens(self.vocab))
        self.n_swa = int(lc.llama_model_n_swa(ptr))
        self.size_bytes = int(lc.llama_model_size(ptr))

    @property
    def ptr(self) -> lc.llama_model_p:
        if self._ptr is None:
            raise RuntimeError("model is closed")
        return self._ptr

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(512)
        n = lc.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self.vocab, token))


class Vocabulary(OwnedModel):
    """A model file's vocabulary alone (no weights, no context): text to ids and back without a node."""

    def __init__(self, path: Path) -> None:
        self._ptr: lc.llama_model_p | None = None
        ensure_backend()
        params = lc.llama_model_default_params()
        params.vocab_only = True
        with capture_llama_log():
            ptr = lc.llama_model_load_from_file(str(path).encode(), params)
        if not ptr:
            raise ValueError(f"{path}: llama.cpp could not read its vocabulary")
        self._ptr = ptr
        self._vocab = lc.llama_model_get_vocab(ptr)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self.vocab))


class SeqState(enum.Enum):
    """What `llama_state_seq_get_data` / `_set_data` did: they return the bytes they wrote or read."""

    DONE = "done"  # every byte of the sequence's copy written, or read back
    FAILED = "failed"  # 0: llama.cpp refused (it logs why)
    SHORT = "short"  # another count: the copy and the size llama.cpp reports disagree

    @classmethod
    def of(cls, rc: int, size: int) -> SeqState:
        if rc == 0:
            return cls.FAILED
        return cls.DONE if rc == size else cls.SHORT


def _bytes_ptr(blob: npt.NDArray[np.uint8]) -> ctypes._Pointer[ctypes.c_uint8]:
    return blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


class LlamaContext:
    """A llama.cpp context (KV cache + compute buffers) over a model."""

    _ptr: lc.llama_context_p | None = None  # also while __init__ fails: `close` then has nothing to free
    _memory: lc.llama_memory_t | None = None

    def __init__(self, model: LlamaModel, params: lc.llama_context_params) -> None:
        ptr = lc.llama_init_from_model(model.ptr, params)
        if not ptr:
            raise ValueError("llama.cpp could not create a context with these parameters")
        self._ptr = ptr
        self._params = params  # keeps the eval callback object alive with the context
        self._memory = lc.llama_get_memory(ptr)
        self.n_ctx = int(lc.llama_n_ctx(ptr))
        self.n_seq_max = int(lc.llama_n_seq_max(ptr))

    @property
    def ptr(self) -> lc.llama_context_p:
        if self._ptr is None:
            raise RuntimeError("context is closed")
        return self._ptr

    @property
    def memory(self) -> lc.llama_memory_t:
        """The context's KV memory, while the context is open."""
        if self._ptr is None or self._memory is None:
            raise RuntimeError("context is closed")
        return self._memory

    def decode(self, batch: lc.llama_batch) -> int:
        return int(lc.llama_decode(self.ptr, batch))

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        return bool(lc.llama_memory_seq_rm(self.memory, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Tag `src`'s cells of positions [p0, p1) with `dst` too (cells are shared, not copied;
        -1: from the start, to the end)."""
        lc.llama_memory_seq_cp(self.memory, src, dst, p0, p1)

    def memory_clear(self) -> None:
        """Forget every cell of every sequence (the data stays; the cells become free, search
        heads go back to cell 0)."""
        lc.llama_memory_clear(self.memory, False)

    def seq_state(self, seq: int) -> tuple[SeqState, npt.NDArray[np.uint8]]:
        """A copy of `seq`'s KV cells as llama.cpp serialises them: positions and rows, in cell order
        (of a sliding-window cache, only the cells still in the sequence's window)."""
        size = int(lc.llama_state_seq_get_size(self.ptr, seq))
        blob = np.empty(size, np.uint8)
        rc = int(lc.llama_state_seq_get_data(self.ptr, _bytes_ptr(blob), size, seq)) if size else 0
        return SeqState.of(rc, size), blob

    def set_seq_state(self, seq: int, blob: npt.NDArray[np.uint8]) -> SeqState:
        """Put a `seq_state` copy into the empty `seq`: in each cache, the first run of contiguous
        free cells from the search head takes the cells in the copy's order, and the head moves
        past it. FAILED: llama.cpp refused it (what it had placed may still be there)."""
        rc = int(lc.llama_state_seq_set_data(self.ptr, _bytes_ptr(blob), blob.size, seq))
        return SeqState.of(rc, blob.size)

    def seq_pos_min(self, seq: int) -> int:
        return int(lc.llama_memory_seq_pos_min(self.memory, seq))

    def seq_pos_max(self, seq: int) -> int:
        return int(lc.llama_memory_seq_pos_max(self.memory, seq))

    def logits_row(self, i: int) -> ctypes._Pointer[ctypes.c_float]:
        """Logits of batch row `i` of the last decode (valid until the next decode)."""
        return cast("ctypes._Pointer[ctypes.c_float]", lc.llama_get_logits_ith(self.ptr, i))

    def close(self) -> None:
        if self._ptr is not None:
            lc.llama_free(self._ptr)
            self._ptr = None
            self._memory = None

    def __del__(self) -> None:
        self.close()


class SamplerChain:
    """A session's llama.cpp sampler chain.

    The random step is re-seeded from (seed, position) before every draw, so a
    retried step samples the same token as the first try (PROTOCOL.md: retries
    are idempotent) and a rewound session resamples exactly as a fresh one.
    """

    def __init__(self, temperature: float, top_k: int, top_p: float, seed: int, n_vocab: int) -> None:
        self.greedy = temperature <= 0.0
        self.seed = seed
        self.n_vocab = n_vocab
        self._ptr: lc.llama_sampler_p | None = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if self.greedy:
            lc.llama_sampler_chain_add(self._ptr, lc.llama_sampler_init_greedy())
            return
        if top_k > 0:
            lc.llama_sampler_chain_add(self._ptr, lc.llama_sampler_init_top_k(top_k))
        if top_p < 1.0:
            lc.llama_sampler_chain_add(self._ptr, lc.llama_sampler_init_top_p(top_p, 1))
        lc.llama_sampler_chain_add(self._ptr, lc.llama_sampler_init_temp(temperature))
        lc.llama_sampler_chain_add(self._ptr, lc.llama_sampler_init_dist(seed & 0xFFFFFFFF))

    def sample(self, ctx: LlamaContext, row: int, pos: int) -> int:
        """Sample from batch row `row` of the last decode; `pos` is the sampled token's position."""
        if self._ptr is None:
            raise RuntimeError("sampler is closed")
        if self.greedy:
            # The first largest logit, as llama.cpp's greedy sampler picks it, without copying the
            # whole vocabulary into a candidate array first (2.5 ms a token at 262k entries).
            return int(np.argmax(np.ctypeslib.as_array(ctx.logits_row(row), shape=(self.n_vocab,))))
        last = lc.llama_sampler_chain_n(self._ptr) - 1
        lc.llama_sampler_free(lc.llama_sampler_chain_remove(self._ptr, last))
        lc.llama_sampler_chain_add(self._ptr, lc.llama_sampler_init_dist(_mix(self.seed, pos)))
        return int(lc.llama_sampler_sample(self._ptr, ctx.ptr, row))

    def close(self) -> None:
        if self._ptr is not None:
            lc.llama_sampler_free(self._ptr)
            self._ptr = None

    def __del__(self) -> None:
        self.close()


def _mix(seed: int, pos: int) -> int:
    """A 32-bit seed for one draw (splitmix64 finaliser of seed and position)."""
    z = (seed * 0x9E3779B97F4A7C15 + pos + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0xFFFFFFFF
