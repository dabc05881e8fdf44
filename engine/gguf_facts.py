"""Facts about a model or shard read from its GGUF header (no llama.cpp needed).

The node's budgets are computed from these before llama.cpp allocates anything,
so a configuration that cannot fit fails with a message, not an allocation error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from engine.architectures import SWA_DEFAULT_PATTERN, swa_layers

KEY_SOURCE_MODEL = "neuron_tai.source_model"
KEY_SOURCE_BLOCKS = "neuron_tai.source_block_count"
KEY_LAYER_START = "neuron_tai.layer_start"
KEY_LAYER_END = "neuron_tai.layer_end"

_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class ModelFacts:
    arch: str
    name: str
    block_count: int  # layers in this file
    source_blocks: int  # layers in the whole source model
    start: int  # index of this file's first layer in the source model
    n_embd: int
    k_widths: tuple[int, ...]  # per layer: K row width (head_dim_k * n_head_kv)
    v_widths: tuple[int, ...]
    swa: tuple[bool, ...]  # per layer: sliding-window attention
    n_swa: int
    weights_bytes: int  # bytes of the tensors this stage computes with

    @property
    def end(self) -> int:
        return self.start + self.block_count

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.source_blocks


def field_value(reader: gguf.GGUFReader, key: str) -> Any:
    f = reader.get_field(key)
    return None if f is None else f.contents()


def swa_pattern(reader: gguf.GGUFReader, arch: str, n_layer: int) -> list[bool] | None:
    """Per-layer sliding-window flags as llama.cpp derives them; None without a window."""
    if arch not in SWA_DEFAULT_PATTERN or reader.get_field(f"{arch}.attention.sliding_window") is None:
        return None
    period, dense_first = SWA_DEFAULT_PATTERN[arch]
    value = field_value(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(value, list):
        return [bool(v) for v in value]
    if value is not None:
        period = int(value)
    return swa_layers(n_layer, period, dense_first)


def _per_layer(value: Any, n: int) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * n


def read_facts(path: Path) -> ModelFacts:
    return facts_from_reader(gguf.GGUFReader(str(path), "r"), path)


def facts_from_reader(reader: gguf.GGUFReader, path: Path) -> ModelFacts:
    """Raises ValueError when a key the facts need is missing or mistyped."""
    try:
        return _facts(reader, path)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: incomplete model metadata ({exc})") from exc


def _facts(reader: gguf.GGUFReader, path: Path) -> ModelFacts:
    arch = str(field_value(reader, "general.architecture"))
    n = int(field_value(reader, f"{arch}.block_count"))
    n_embd = int(field_value(reader, f"{arch}.embedding_length"))
    heads = _per_layer(field_value(reader, f"{arch}.attention.head_count"), n)
    kv_heads = _per_layer(field_value(reader, f"{arch}.attention.head_count_kv") or heads, n)
    head_k = field_value(reader, f"{arch}.attention.key_length")
    head_v = field_value(reader, f"{arch}.attention.value_length")
    k_widths = [int(head_k or n_embd // h) * kv for h, kv in zip(heads, kv_heads, strict=True)]
    v_widths = [int(head_v or n_embd // h) * kv for h, kv in zip(heads, kv_heads, strict=True)]
    swa = swa_pattern(reader, arch, n) or [False] * n
    start = int(field_value(reader, KEY_LAYER_START) or 0)
    source_blocks = int(field_value(reader, KEY_SOURCE_BLOCKS) or n)
    first, last = start == 0, start + n == source_blocks
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names  # the vocabulary projection reuses token_embd
    used = 0
    for t in reader.tensors:
        if _BLOCK.match(t.name):
            used += int(t.n_bytes)
        elif t.name == "token_embd.weight":
            used += int(t.n_bytes) if first or (last and tied) else 0
        elif t.name in ("output.weight", "output_norm.weight"):
            used += int(t.n_bytes) if last else 0
        else:
            used += int(t.n_bytes)
    return ModelFacts(
        arch=arch,
        name=str(field_value(reader, KEY_SOURCE_MODEL) or field_value(reader, "general.name") or path.stem),
        block_count=n,
        source_blocks=source_blocks,
        start=start,
        n_embd=n_embd,
        k_widths=tuple(k_widths),
        v_widths=tuple(v_widths),
        swa=tuple(swa),
        n_swa=int(field_value(reader, f"{arch}.attention.sliding_window") or 0) if any(swa) else 0,
        weights_bytes=used,
    )
