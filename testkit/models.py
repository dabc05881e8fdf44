"""Random-weight GGUF models: tiny ones for tests, and real models' exact geometry for benches.

They load in stock llama.cpp like any real model, so everything above them (shards,
the backend, the engine, the node) runs the real code path without a download.
F32 weights keep batched-vs-solo differences at rounding size. Quantized ones
(`TinySpec.quant`) are made by llama.cpp's own quantizer with the same type mix as a
real file of that type, so they reach the quantized matmul and weight-repacking kernels
that real models use (the `gguf` package cannot write K-quants). Large models are written
tensor by tensor as random Q8_0 blocks (`source="q8_0"`, no F32 copy in memory or on disk)
and requantized from there.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import llama_cpp as lc
import numpy as np
import numpy.typing as npt

from engine.llama_handles import ensure_backend

# SentencePiece-style vocabulary: specials, 256 byte-fallback tokens, and a few pieces.
_SPECIALS = ("<unk>", "<s>", "</s>")
_PIECES = ("\u2581", "\u2581the", "\u2581a", "e", "t", "\u2581and", "in", "er", "on")

# `TinySpec.quant` -> llama.cpp file type, and the block size its matrix rows must fill
# (n_embd and n_ff elements): llama.cpp's quantizer would fall back to other
# types for tensors whose rows do not fit.
FILE_TYPES = {
    "f32": (lc.LLAMA_FTYPE_ALL_F32, 1),
    "q8_0": (lc.LLAMA_FTYPE_MOSTLY_Q8_0, 32),
    "q4_0": (lc.LLAMA_FTYPE_MOSTLY_Q4_0, 32),
    "q4_k_m": (lc.LLAMA_FTYPE_MOSTLY_Q4_K_M, 256),
}
_Q8_BLOCK = 32  # elements per Q8_0 block: an f16 scale and 32 int8


@dataclass(frozen=True, slots=True)
class TinySpec:
    """Shape of a generated model; the defaults are the test model."""

    arch: str = "llama"
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx_train: int = 2048
    sliding_window: int = 0  # gemma3 only: window of its sliding-window layers
    seed: int = 1234
    quant: str = "f32"  # a key of FILE_TYPES: "q4_k_m" is mostly Q4_K, some Q6_K, F32 norms
    eos_token: int = 2  # end of generation; another id gives the same weights a different end
    n_vocab: int = 0  # pad the small vocabulary with unused tokens to this size (0: no padding)
    tied_output: bool = False  # no output.weight: the head reuses token_embd, as Llama-3.2-1B does
    rope_freq_base: float = 10000.0
    source: str = "f32"  # what the quantizer starts from: "f32" or "q8_0" (random Q8_0 blocks, streamed)
    name: str = ""  # general.name; empty: tiny-ARCH


def vocabulary(n_vocab: int = 0) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of the tiny SPM vocabulary, padded to `n_vocab` with unused tokens."""
    tokens = list(_SPECIALS)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    tokens += list(_PIECES)
    types += [gguf.TokenType.NORMAL] * len(_PIECES)
    scores = [0.0] * (len(_SPECIALS) + 256) + [-float(i) for i in range(len(_PIECES))]
    pad = max(0, n_vocab - len(tokens))
    tokens += [f"<unused{i}>" for i in range(pad)]
    types += [gguf.TokenType.UNUSED] * pad
    scores += [-1e9] * pad
    return tokens, scores, [int(t) for t in types]


def write_tiny_model(path: Path, spec: TinySpec = TinySpec()) -> Path:
    """Write a random model of architecture `spec.arch` ("llama" or "gemma3"), typed `spec.quant`."""
    if spec.arch not in ("llama", "gemma3"):
        raise ValueError(f"tiny models exist for llama and gemma3, not {spec.arch!r}")
    if spec.quant not in FILE_TYPES:
        raise ValueError(f"quant must be one of {sorted(FILE_TYPES)}, not {spec.quant!r}")
    if spec.source not in ("f32", "q8_0"):
        raise ValueError(f"source must be 'f32' or 'q8_0', not {spec.source!r}")
    file_type, block = FILE_TYPES[spec.quant]
    block = max(block, _Q8_BLOCK if spec.source == "q8_0" else 1)
    if spec.n_embd % block or spec.n_ff % block:
        raise ValueError(f"{spec.quant} from {spec.source} needs n_embd and n_ff in multiples of {block}")
    if spec.quant == spec.source:
        return _write_source(path, spec)
    source = path.with_name(path.name + f".{spec.source}.tmp")
    try:
        _write_source(source, spec)
        _quantize(source, path, file_type)
    finally:
        source.unlink(missing_ok=True)
    return path


def _quantize(source: Path, path: Path, file_type: int) -> None:
    """llama.cpp's quantizer, as `llama-quantize` runs it (no importance matrix)."""
    ensure_backend()
    params = lc.llama_model_quantize_default_params()
    params.ftype = file_type
    params.allow_requantize = True  # a Q8_0 source
    params.nthread = os.cpu_count() or 1  # results do not depend on the thread count
    if lc.llama_model_quantize(str(source).encode(), str(path).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to file type {file_type}")


def tensor_shapes(spec: TinySpec, n_vocab: int) -> Iterator[tuple[str, int, int]]:
    """(name, rows, columns) of every tensor in file order; columns 0 marks a norm vector of `rows`."""
    head_dim = spec.n_embd // spec.n_head
    n_embd_kv = head_dim * spec.n_head_kv
    e, f = spec.n_embd, spec.n_ff
    yield "token_embd.weight", n_vocab, e
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        yield from ((p + "attn_norm.weight", e, 0), (p + "attn_q.weight", e, e), (p + "attn_k.weight", n_embd_kv, e))
        yield from ((p + "attn_v.weight", n_embd_kv, e), (p + "attn_output.weight", e, e))
        yield from ((p + "ffn_norm.weight", e, 0), (p + "ffn_gate.weight", f, e), (p + "ffn_up.weight", f, e))
        yield p + "ffn_down.weight", e, f
        if spec.arch == "gemma3":
            yield from ((p + "attn_q_norm.weight", head_dim, 0), (p + "attn_k_norm.weight", head_dim, 0))
            yield from ((p + "post_attention_norm.weight", e, 0), (p + "post_ffw_norm.weight", e, 0))
    yield "output_norm.weight", e, 0
    if not spec.tied_output:
        yield "output.weight", n_vocab, e


def _write_metadata(w: gguf.GGUFWriter, spec: TinySpec) -> int:
    """Hyperparameters and the tokenizer; returns the vocabulary size."""
    tokens, scores, types = vocabulary(spec.n_vocab)
    head_dim = spec.n_embd // spec.n_head
    w.add_name(spec.name or f"tiny-{spec.arch}")
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(spec.rope_freq_base)
    if spec.arch == "llama":
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(len(tokens))
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(spec.sliding_window or 4)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(spec.eos_token)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if spec.source == "f32" else gguf.LlamaFileType.MOSTLY_Q8_0)
    return len(tokens)


def _write_source(path: Path, spec: TinySpec) -> Path:
    """The unquantized file: tensor infos first, then each tensor generated and written in turn."""
    w = gguf.GGUFWriter(str(path), spec.arch)
    n_vocab = _write_metadata(w, spec)
    shapes = list(tensor_shapes(spec, n_vocab))
    q8 = spec.source == "q8_0"
    for name, rows, cols in shapes:
        if cols and q8:
            nbytes = rows * cols // _Q8_BLOCK * 34
            w.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor_info(name, (rows, cols) if cols else (rows,), np.dtype(np.float32), rows * max(cols, 1) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(spec.seed)
    for name, rows, cols in shapes:
        gain = np.float32(4.0 if name == "token_embd.weight" else 1.0)
        if not cols:
            w.write_tensor_data(np.asarray(1.0 + 0.1 * rng.standard_normal(rows), np.float32))
        elif q8:
            w.write_tensor_data(_q8_blocks(rng, rows, cols, gain))
        else:
            w.write_tensor_data(np.asarray(rng.standard_normal((rows, cols)) / np.sqrt(cols), np.float32) * gain)
    w.close()
    return path


def _q8_blocks(rng: np.random.Generator, rows: int, cols: int, gain: np.float32) -> npt.NDArray[np.uint8]:
    """Random Q8_0 rows of standard deviation gain/sqrt(cols): one f16 scale, then 32 uniform int8, per block."""
    blocks = np.empty((rows, cols // _Q8_BLOCK, 34), np.uint8)
    scale = np.float16(gain / np.sqrt(cols) / np.sqrt(127 * 128 / 3))  # uniform int8 has variance about 127*128/3
    blocks[:, :, :2] = np.frombuffer(scale.tobytes(), np.uint8)
    blocks[:, :, 2:] = rng.integers(-127, 128, (rows, cols // _Q8_BLOCK, 32), np.int8).view(np.uint8)
    return blocks.reshape(rows, -1)
