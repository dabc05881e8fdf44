"""Text to token ids and back with a llama.cpp vocabulary: the one implementation a node and
a gateway share, so both give the same ids and the same text for the same vocabulary."""

from __future__ import annotations

import ctypes

import llama_cpp as lc


def tokenize(vocab: lc.llama_vocab_p, text: str, add_special: bool) -> list[int]:
    raw = text.encode("utf-8")
    cap = len(raw) + 8
    while True:
        out = (lc.llama_token * cap)()
        n = lc.llama_tokenize(vocab, raw, len(raw), out, cap, add_special, False)
        if n >= 0:
            return list(out[:n])
        cap = -n


def detokenize(vocab: lc.llama_vocab_p, tokens: list[int]) -> str:
    arr = (lc.llama_token * max(1, len(tokens)))(*tokens)
    cap = 16 * len(tokens) + 16
    while True:
        buf = ctypes.create_string_buffer(cap)
        n = lc.llama_detokenize(vocab, arr, len(tokens), buf, cap, False, False)
        if n >= 0:
            return buf.raw[:n].decode("utf-8", "replace")
        cap = -n
