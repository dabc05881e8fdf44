"""Cut a GGUF model into layer-range shards that stock llama.cpp loads as models.

A shard of layers [a, b) keeps all metadata, sets `{arch}.block_count = b - a`,
keeps blocks a..b-1 renumbered from 0 and every tensor outside the blocks (the
loader requires them; with mmap a stage never touches what it does not use).
Per-layer metadata arrays are sliced, and a sliding-window pattern that llama.cpp
would otherwise derive from the (renumbered) layer index is written explicitly.
Tensors are streamed from the memory-mapped source, never loaded whole.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf

from engine.architectures import refusal
from engine.gguf_facts import (
    KEY_LAYER_END,
    KEY_LAYER_START,
    KEY_SOURCE_BLOCKS,
    KEY_SOURCE_MODEL,
    ModelFacts,
    facts_from_reader,
    field_value,
    swa_pattern,
)

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


class ShardError(Exception):
    """A shard cannot be written; the message says why, for people."""


def open_reader(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise ShardError(f"{path}: no such file")
    try:
        return gguf.GGUFReader(str(path), "r")
    except (ValueError, OSError) as exc:
        raise ShardError(f"{path}: not a GGUF file ({exc})") from exc


def read_model_layers(path: Path, reader: gguf.GGUFReader | None = None) -> ModelFacts:
    """Layer facts of a model or shard file (where its layers sit in the source model)."""
    return _facts(reader or open_reader(path), path)


def _facts(reader: gguf.GGUFReader, path: Path) -> ModelFacts:
    try:
        return facts_from_reader(reader, path)
    except ValueError as exc:
        raise ShardError(str(exc)) from None


def write_shard(src: Path, start: int, end: int, out: Path, reader: gguf.GGUFReader | None = None) -> Path:
    """Write layers [start, end) of `src` (indices within `src`) to `out`.

    Parsing a header with a large vocabulary takes seconds: pass `reader` to reuse one.
    """
    reader = reader or open_reader(src)
    arch = field_value(reader, gguf.Keys.General.ARCHITECTURE)
    if not isinstance(arch, str):
        raise ShardError(f"{src}: no general.architecture key")
    why = refusal(arch)
    if why:
        raise ShardError(f"{src}: {why}")
    layers = _facts(reader, src)
    if not 0 <= start < end <= layers.block_count:
        raise ShardError(
            f"layer range {start}:{end} is not within the model's {layers.block_count} layers "
            f"(need 0 <= A < B <= {layers.block_count})"
        )
    arch, n_keep = layers.arch, end - start
    swa = swa_pattern(reader, layers.arch, layers.block_count)
    overrides: dict[str, Any] = {
        f"{arch}.block_count": (n_keep, gguf.GGUFValueType.UINT32),
        KEY_SOURCE_MODEL: (layers.name, gguf.GGUFValueType.STRING),
        KEY_SOURCE_BLOCKS: (layers.source_blocks, gguf.GGUFValueType.UINT32),
        KEY_LAYER_START: (layers.start + start, gguf.GGUFValueType.UINT32),
        KEY_LAYER_END: (layers.start + end, gguf.GGUFValueType.UINT32),
    }
    if swa is not None:
        overrides[f"{arch}.attention.sliding_window_pattern"] = (swa[start:end], gguf.GGUFValueType.BOOL)

    tmp = out.with_name(out.name + ".part")
    writer = gguf.GGUFWriter(str(tmp), arch, endianess=reader.endianess)
    try:
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue
            if field.name in overrides:
                continue
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            value = field.contents()
            per_layer = (
                sub is not None
                and sub != gguf.GGUFValueType.STRING
                and field.name.startswith(f"{arch}.")
                and len(value) == layers.block_count
            )
            if per_layer:
                value = value[start:end]
            writer.add_key_value(field.name, value, vtype, sub_type=sub)
        for key, (value, vtype) in overrides.items():
            sub = gguf.GGUFValueType.BOOL if isinstance(value, list) else None
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY if sub else vtype, sub_type=sub)

        kept: list[tuple[str, Any]] = []
        for tensor in reader.tensors:
            m = _BLOCK.match(tensor.name)
            if m is None:
                kept.append((tensor.name, tensor))
            elif start <= int(m.group(1)) < end:
                kept.append((f"blk.{int(m.group(1)) - start}.{m.group(2)}", tensor))
        for name, tensor in kept:
            writer.add_tensor_info(name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, tensor in kept:
            writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


def stage_bounds(block_count: int, *, stages: int | None = None, split: Sequence[int] = ()) -> list[tuple[int, int]]:
    """Layer ranges of an even split into `stages`, or at explicit `split` boundaries."""
    if stages is not None:
        if not 1 <= stages <= block_count:
            raise ShardError(f"--stages {stages}: need 1 <= N <= {block_count} (the model's layers)")
        cuts = [round(i * block_count / stages) for i in range(stages + 1)]
    else:
        cuts = [0, *split, block_count]
        if any(b <= a for a, b in itertools.pairwise(cuts)):
            raise ShardError(
                f"--split {','.join(map(str, split))}: boundaries must increase within 1..{block_count - 1}"
            )
    return list(itertools.pairwise(cuts))


def write_stages(
    src: Path, out_dir: Path, bounds: Sequence[tuple[int, int]], reader: gguf.GGUFReader | None = None
) -> list[Path]:
    """One shard per layer range, named `{stem}.layers-A-B.gguf` in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = reader or open_reader(src)
    return [write_shard(src, a, b, out_dir / f"{src.stem}.layers-{a}-{b}.gguf", reader) for a, b in bounds]
