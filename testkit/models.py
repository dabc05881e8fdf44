"""Tiny random GGUF models, written in well under a second, for tests and quick benches.

They load in stock llama.cpp like any real model, so everything above them (shards,
the backend, the engine, the node) runs the real code path without a download.
F32 weights keep batched-vs-solo differences at rounding size. Quantized ones
(`TinySpec.quant`) are made by llama.cpp's own quantizer with the same type mix as a
real file of that type, so they reach the quantized matmul and weight-repacking kernels
that real models use (the `gguf` package cannot write K-quants).
"""

from __future__ import annotations

import ctypes
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


@dataclass(frozen=True, slots=True)
class TinySpec:
    """Shape of a tiny model; the defaults are the test model."""

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


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of the tiny SPM vocabulary."""
    tokens = list(_SPECIALS)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    tokens += list(_PIECES)
    types += [gguf.TokenType.NORMAL] * len(_PIECES)
    scores = [0.0] * (len(_SPECIALS) + 256) + [-float(i) for i in range(len(_PIECES))]
    return tokens, scores, [int(t) for t in types]


def write_tiny_model(path: Path, spec: TinySpec = TinySpec()) -> Path:
    """Write a random model of architecture `spec.arch` ("llama" or "gemma3"), typed `spec.quant`."""
    if spec.arch not in ("llama", "gemma3"):
        raise ValueError(f"tiny models exist for llama and gemma3, not {spec.arch!r}")
    if spec.quant not in FILE_TYPES:
        raise ValueError(f"quant must be one of {sorted(FILE_TYPES)}, not {spec.quant!r}")
    file_type, block = FILE_TYPES[spec.quant]
    if spec.n_embd % block or spec.n_ff % block:
        raise ValueError(f"{spec.quant} needs n_embd and n_ff in multiples of {block}")
    if spec.quant == "f32":
        return _write_f32(path, spec)
    source = path.with_name(path.name + ".f32.tmp")
    try:
        _write_f32(source, spec)
        _quantize(source, path, file_type)
    finally:
        source.unlink(missing_ok=True)
    return path


def _quantize(source: Path, path: Path, file_type: int) -> None:
    """llama.cpp's quantizer, as `llama-quantize` runs it (no importance matrix)."""
    ensure_backend()
    params = lc.llama_model_quantize_default_params()
    params.ftype = file_type
    params.nthread = 1  # a tiny model; results do not depend on the thread count anyway
    if lc.llama_model_quantize(str(source).encode(), str(path).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to file type {file_type}")


def _write_f32(path: Path, spec: TinySpec) -> Path:
    rng = np.random.default_rng(spec.seed)
    tokens, scores, types = vocabulary()
    n_vocab = len(tokens)
    head_dim = spec.n_embd // spec.n_head
    n_embd_kv = head_dim * spec.n_head_kv

    def weight(rows: int, cols: int) -> npt.NDArray[np.float32]:
        return np.asarray(rng.standard_normal((rows, cols)) / np.sqrt(cols), np.float32)

    def norm(n: int) -> npt.NDArray[np.float32]:
        return np.asarray(1.0 + 0.1 * rng.standard_normal(n), np.float32)

    arch = spec.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(n_vocab)
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
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    w.add_tensor("token_embd.weight", weight(n_vocab, spec.n_embd) * 4.0)
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(spec.n_embd))
        w.add_tensor(p + "attn_q.weight", weight(spec.n_embd, spec.n_embd))
        w.add_tensor(p + "attn_k.weight", weight(n_embd_kv, spec.n_embd))
        w.add_tensor(p + "attn_v.weight", weight(n_embd_kv, spec.n_embd))
        w.add_tensor(p + "attn_output.weight", weight(spec.n_embd, spec.n_embd))
        w.add_tensor(p + "ffn_norm.weight", norm(spec.n_embd))
        w.add_tensor(p + "ffn_gate.weight", weight(spec.n_ff, spec.n_embd))
        w.add_tensor(p + "ffn_up.weight", weight(spec.n_ff, spec.n_embd))
        w.add_tensor(p + "ffn_down.weight", weight(spec.n_embd, spec.n_ff))
        if arch == "gemma3":
            w.add_tensor(p + "attn_q_norm.weight", norm(head_dim))
            w.add_tensor(p + "attn_k_norm.weight", norm(head_dim))
            w.add_tensor(p + "post_attention_norm.weight", norm(spec.n_embd))
            w.add_tensor(p + "post_ffw_norm.weight", norm(spec.n_embd))
    w.add_tensor("output_norm.weight", norm(spec.n_embd))
    w.add_tensor("output.weight", weight(n_vocab, spec.n_embd))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
