"""Facts about a model or shard read from its GGUF header (no llama.cpp needed).

The node's budgets are computed from these before llama.cpp allocates anything,
so a configuration that cannot fit fails with a message, not an allocation error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.architectures import SWA_DEFAULT_PATTERN, swa_layers
from engine.gguf_header import Header, read_header

KEY_SOURCE_MODEL = "neuron_tai.source_model"
KEY_SOURCE_BLOCKS = "neuron_tai.source_block_count"
KEY_LAYER_START = "neuron_tai.layer_start"
KEY_LAYER_END = "neuron_tai.layer_end"

_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class ModelFacts:
    arch: str
    name: str
    block_count: int  # layers this file computes
    source_blocks: int  # layers in the whole source model
    start: int  # index of this file's first layer in the source model
    n_embd: int
    k_widths: tuple[int, ...]  # per layer: K row width (head_dim_k * n_head_kv)
    v_widths: tuple[int, ...]
    swa: tuple[bool, ...]  # per layer: sliding-window attention
    n_swa: int
    weights_bytes: int  # bytes of the tensors this stage computes with
    capture_blocks: int = 0  # blocks after them in the file (a non-last shard's capture block)

    @property
    def file_blocks(self) -> int:
        """Blocks in the file as llama.cpp sees them (it allocates KV for each)."""
        return self.block_count + self.capture_blocks

    @property
    def end(self) -> int:
        return self.start + self.block_count

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.source_blocks


def swa_pattern(header: Header, arch: str, n_layer: int) -> list[bool] | None:
    """Per-layer sliding-window flags as llama.cpp derives them; None without a window."""
    if arch not in SWA_DEFAULT_PATTERN or header.get(f"{arch}.attention.sliding_window") is None:
        return None
    period, dense_first = SWA_DEFAULT_PATTERN[arch]
    value = header.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(value, list):
        return [bool(v) for v in value]
    if value is not None:
        period = int(value)
    return swa_layers(n_layer, period, dense_first)


def _per_layer(value: Any, n: int) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * n


def read_facts(path: Path) -> ModelFacts:
    return facts_from_header(read_header(path), path)


def facts_from_header(header: Header, path: Path) -> ModelFacts:
    """Raises ValueError when a key the facts need is missing or mistyped."""
    try:
        return _facts(header, path)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: incomplete model metadata ({exc})") from exc


def _facts(header: Header, path: Path) -> ModelFacts:
    arch = str(header.get("general.architecture"))
    n = int(header.get(f"{arch}.block_count"))  # every block in the file; per-layer shapes are the file's
    n_embd = int(header.get(f"{arch}.embedding_length"))
    heads = _per_layer(header.get(f"{arch}.attention.head_count"), n)
    kv_heads = _per_layer(header.get(f"{arch}.attention.head_count_kv") or heads, n)
    head_k = header.get(f"{arch}.attention.key_length")
    head_v = header.get(f"{arch}.attention.value_length")
    k_widths = [int(head_k or n_embd // h) * kv for h, kv in zip(heads, kv_heads, strict=True)]
    v_widths = [int(head_v or n_embd // h) * kv for h, kv in zip(heads, kv_heads, strict=True)]
    swa = swa_pattern(header, arch, n) or [False] * n
    start = int(header.get(KEY_LAYER_START) or 0)
    source_blocks = int(header.get(KEY_SOURCE_BLOCKS) or n)
    computed = int(header.get(KEY_LAYER_END) or start + n) - start  # a capture block is not computed
    first, last = start == 0, start + computed == source_blocks
    names = {t.name for t in header.tensors}
    tied = "output.weight" not in names  # the vocabulary projection reuses token_embd
    used = 0
    for t in header.tensors:
        if block := _BLOCK.match(t.name):
            used += t.nbytes if int(block.group(1)) < computed else 0
        elif t.name == "token_embd.weight":
            used += t.nbytes if first or (last and tied) else 0
        elif t.name in ("output.weight", "output_norm.weight"):
            used += t.nbytes if last else 0
        else:
            used += t.nbytes
    return ModelFacts(
        arch=arch,
        name=str(header.get(KEY_SOURCE_MODEL) or header.get("general.name") or path.stem),
        block_count=computed,
        source_blocks=source_blocks,
        start=start,
        n_embd=n_embd,
        k_widths=tuple(k_widths),
        v_widths=tuple(v_widths),
        swa=tuple(swa),
        n_swa=int(header.get(f"{arch}.attention.sliding_window") or 0) if any(swa) else 0,
        weights_bytes=used,
        capture_blocks=n - computed,
    )
