"""Cut a GGUF model into layer-range shards that stock llama.cpp loads as models.

A shard of layers [a, b) keeps all metadata, sets `{arch}.block_count = b - a`,
keeps blocks a..b-1 renumbered from 0 and every tensor outside the blocks (the
loader requires them; with mmap a stage never touches what it does not use), their data
grouped by type (`grouped_by_type` says why).
Per-layer metadata arrays are sliced, and a sliding-window pattern that llama.cpp
would otherwise derive from the (renumbered) layer index is written explicitly.
Metadata the shard does not change is copied byte for byte, and tensor data is
streamed from the source file in chunks: never the whole model in memory.

A shard that does not end the model also carries block b, its capture block: llama.cpp
drops the rows that are not outputs inside a model's last block, so with block b last the
stage's real last layer (b-1) computes every row with no row marked an output, and the
stage captures its output there (engine/hidden_capture.py) and stops. Marking every row an
output instead makes llama.cpp keep a vocabulary-wide logits row per row (1 MiB a row for
a 262k vocabulary). The capture block is never computed; it costs its KV cache and, where
its weights are repacked, their copy. `neuron_tai.layer_end` says where the computed
layers end.
"""

from __future__ import annotations

import glob
import itertools
import os
import re
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from engine.architectures import refusal
from engine.gguf_facts import (
    KEY_LAYER_END,
    KEY_LAYER_START,
    KEY_SOURCE_BLOCKS,
    KEY_SOURCE_MODEL,
    ModelFacts,
    facts_from_header,
    swa_pattern,
)
from engine.gguf_header import (
    ARRAY,
    MAGIC,
    STRING,
    Header,
    HeaderError,
    TensorInfo,
    encode_entry,
    encode_string,
    read_header,
)
from neuron_tai.process_exists import process_exists

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_UINT32, _BOOL = 4, 7
_CHUNK = 8 * 2**20


class ShardError(Exception):
    """A shard cannot be written; the message says why, for people."""


def open_header(path: Path) -> Header:
    if not path.is_file():
        raise ShardError(f"{path}: no such file")
    try:
        return read_header(path)
    except HeaderError as exc:
        raise ShardError(f"{path}: not a GGUF file ({exc})") from None


def read_model_layers(path: Path, header: Header | None = None) -> ModelFacts:
    """Layer facts of a model or shard file (where its layers sit in the source model)."""
    return _facts(header or open_header(path), path)


def _facts(header: Header, path: Path) -> ModelFacts:
    try:
        return facts_from_header(header, path)
    except ValueError as exc:
        raise ShardError(str(exc)) from None


def check_layer_range(block_count: int, start: int, end: int) -> None:
    """ShardError unless layers [start, end) are within a file of `block_count` layers."""
    if not 0 <= start < end <= block_count:
        raise ShardError(
            f"layer range {start}:{end} is not within the model's {block_count} layers "
            f"(need 0 <= A < B <= {block_count})"
        )


def write_shard(src: Path, start: int, end: int, out: Path, header: Header | None = None) -> Path:
    """Write layers [start, end) of `src` (indices within `src`) to `out`."""
    header = header or open_header(src)
    arch = header.get("general.architecture")
    if not isinstance(arch, str):
        raise ShardError(f"{src}: no general.architecture key")
    why = refusal(arch)
    if why:
        raise ShardError(f"{src}: {why}")
    layers = _facts(header, src)
    check_layer_range(layers.block_count, start, end)
    capture = 1 if end < layers.file_blocks else 0  # a shard that does not end the model: block `end` too
    entries = _shard_entries(header, arch, layers, start, end, capture)
    kept = _shard_tensors(header, start, end + capture)
    remove_abandoned_parts(out)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.part")  # a writer of its own: two may race for one shard
    try:
        with src.open("rb") as fin, tmp.open("wb") as fout:
            _write(fout, fin, header, entries, kept)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


# A writer in another PID namespace (a container sharing the cache) is invisible to `process_exists`;
# it is still writing, so its file changed within this many seconds.
ABANDONED_AFTER_S = 60.0


def remove_abandoned_parts(out: Path) -> list[Path]:
    """Delete half-written copies of `out` whose writer is gone (killed mid-write: its `except`
    never ran) and that nothing wrote to for ABANDONED_AFTER_S; a living writer's copy stays.
    Returns what was deleted."""
    removed = []
    for part in out.parent.glob(f"{glob.escape(out.name)}.*.part"):
        pid = part.name[len(out.name) + 1 : -len(".part")]
        if not pid.isdigit() or process_exists(int(pid)):
            continue
        try:
            if time.time() - part.stat().st_mtime < ABANDONED_AFTER_S:
                continue
            part.unlink()
        except FileNotFoundError:
            continue  # another writer removed it first
        removed.append(part)
    return removed


def _overrides(header: Header, arch: str, layers: ModelFacts, start: int, end: int, capture: int) -> dict[str, bytes]:
    """The metadata a shard of layers [start, end) (and `capture` blocks after them) states differently."""
    stop = end + capture  # the file's blocks
    overrides = {
        f"{arch}.block_count": encode_entry(f"{arch}.block_count", stop - start, _UINT32),
        KEY_SOURCE_MODEL: encode_entry(KEY_SOURCE_MODEL, layers.name, STRING),
        KEY_SOURCE_BLOCKS: encode_entry(KEY_SOURCE_BLOCKS, layers.source_blocks, _UINT32),
        KEY_LAYER_START: encode_entry(KEY_LAYER_START, layers.start + start, _UINT32),
        KEY_LAYER_END: encode_entry(KEY_LAYER_END, layers.start + end, _UINT32),
    }
    swa = swa_pattern(header, arch, layers.file_blocks)
    if swa is not None:
        key = f"{arch}.attention.sliding_window_pattern"
        overrides[key] = encode_entry(key, swa[start:stop], ARRAY, _BOOL)
        if not any(swa[start:stop]):
            # Only full-attention layers here: llama.cpp aborts building a sliding-window cache
            # with no sliding layer in it, and without a window these layers compute the same.
            window = f"{arch}.attention.sliding_window"
            overrides[window] = encode_entry(window, 0, _UINT32)
    return overrides


def _shard_entries(header: Header, arch: str, layers: ModelFacts, start: int, end: int, capture: int) -> list[bytes]:
    """The shard's metadata entries: the source's, per-layer arrays cut to the range, overrides applied."""
    overrides = _overrides(header, arch, layers, start, end, capture)
    entries: list[bytes] = []
    for key, entry in header.entries.items():
        if key in overrides:
            entries.append(overrides.pop(key))
        elif (
            entry.vtype == ARRAY
            and entry.elem_type not in (None, STRING)
            and key.startswith(f"{arch}.")
            and entry.count == layers.file_blocks
        ):
            entries.append(encode_entry(key, list(entry.value)[start : end + capture], ARRAY, entry.elem_type))
        else:
            entries.append(entry.raw)
    return entries + list(overrides.values())


def _shard_tensors(header: Header, start: int, end: int) -> list[tuple[str, TensorInfo]]:
    """Every tensor outside the blocks, and the blocks of the range renumbered from 0, in the
    order their data is written: grouped by type (`grouped_by_type`), the source's within one."""
    kept = []
    for t in header.tensors:
        m = _BLOCK.match(t.name)
        if m is None:
            kept.append((t.name, t))
        elif start <= int(m.group(1)) < end:
            kept.append((f"blk.{int(m.group(1)) - start}.{m.group(2)}", t))
    return sorted(kept, key=lambda named: named[1].ggml_type)


def grouped_by_type(header: Header) -> bool:
    """Whether the file's tensor data lies grouped by type, as shards write it.

    llama.cpp copies the matrices it repacks out of the mapped file and computes with the rest
    in place, the small F32 norms among them. Reading a norm maps the whole page-cache folio
    around it (up to 2 MiB on Linux 6.18, once a load read the file into large folios), so with
    each layer's tensors side by side a stage held megabytes of its repacked matrices' file
    pages beside their copies: 23 MiB on a 1B model's 5-layer last stage, 52 MiB on an 11-layer
    first stage (evidence/shard-layout/). Grouped, the norms border each other and the in-place
    types border few repacked ones."""
    types = [t.ggml_type for t in sorted(header.tensors, key=lambda t: t.offset)]
    return types == sorted(types)


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _write(
    fout: BinaryIO, fin: BinaryIO, header: Header, entries: list[bytes], kept: list[tuple[str, TensorInfo]]
) -> None:
    align = header.alignment
    infos, offset = [], 0
    for name, t in kept:
        offset = _align(offset, align)
        infos.append(
            encode_string(name)
            + struct.pack("<I", len(t.dims))
            + struct.pack(f"<{len(t.dims)}Q", *t.dims)
            + struct.pack("<IQ", t.ggml_type, offset)
        )
        offset += t.nbytes
    fout.write(struct.pack("<IIQQ", MAGIC, 3, len(kept), len(entries)))
    for raw in (*entries, *infos):
        fout.write(raw)
    fout.write(b"\0" * (_align(fout.tell(), align) - fout.tell()))
    data_start = fout.tell()
    for _, t in kept:
        fout.write(b"\0" * (_align(fout.tell() - data_start, align) - (fout.tell() - data_start)))
        fin.seek(header.data_offset + t.offset)
        left = t.nbytes
        while left:
            chunk = fin.read(min(left, _CHUNK))
            if not chunk:
                raise ShardError("the source file ends before its tensor data does")
            fout.write(chunk)
            left -= len(chunk)


def stage_bounds(block_count: int, *, stages: int | None = None, split: Sequence[int] = ()) -> list[tuple[int, int]]:
    """Layer ranges of an even split into `stages` (by layer count), or at explicit `split` boundaries."""
    if stages is not None:
        if not 1 <= stages <= block_count:
            raise ShardError(f"--stages {stages}: need 1 <= N <= {block_count} (the model's layers)")
        cuts = [round(i * block_count / stages) for i in range(stages + 1)]
    else:
        cuts = [0, *split, block_count]
        if any(b <= a for a, b in itertools.pairwise(cuts)):
            shown = ",".join(map(str, split))
            raise ShardError(f"--split {shown}: boundaries must increase within 1..{block_count - 1}")
    return list(itertools.pairwise(cuts))


def layer_weights(header: Header) -> tuple[list[int], int]:
    """Bytes of each layer's tensors, and of the vocabulary projection only a last stage multiplies by.

    What a stage reads per token is what it computes: the chain runs at the pace of the stage
    that reads most. The projection is `output.weight`, or `token_embd.weight` where the model
    ties them (the first stage only looks rows of the embeddings up).
    """
    layers: dict[int, int] = {}
    output = embeddings = 0
    for t in header.tensors:
        m = _BLOCK.match(t.name)
        if m:
            layers[int(m.group(1))] = layers.get(int(m.group(1)), 0) + t.nbytes
        elif t.name == "output.weight":
            output = t.nbytes
        elif t.name == "token_embd.weight":
            embeddings = t.nbytes
    end, start = header.get(KEY_LAYER_END), header.get(KEY_LAYER_START)
    computed = int(end) - int(start or 0) if end is not None else max(layers, default=-1) + 1  # not a capture block
    return [layers.get(i, 0) for i in range(computed)], output or embeddings


def balanced_bounds(layer_bytes: Sequence[int], projection_bytes: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per stage, each stage at least one layer, such that the stage
    reading the most weight bytes per token (the last one also reads the projection) reads as
    little as it can; among such splits, the most even one."""
    n = len(layer_bytes)
    if not 1 <= stages <= n:
        raise ShardError(f"--stages {stages}: need 1 <= N <= {n} (the model's layers)")
    prefix = list(itertools.accumulate(layer_bytes, initial=0))

    def cost(a: int, b: int) -> int:
        return prefix[b] - prefix[a] + (projection_bytes if b == n else 0)

    # best[k][b]: (largest stage, sum of squares) splitting layers [0, b) into k stages; cut[k][b]: its last cut.
    inf = (float("inf"), float("inf"))
    best: list[list[tuple[float, float]]] = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0, 0)
    for k in range(1, stages + 1):
        for b in range(k, n + 1):
            for a in range(k - 1, b):
                if best[k - 1][a] == inf:
                    continue
                c = cost(a, b)
                score = (max(best[k - 1][a][0], c), best[k - 1][a][1] + c * c)
                if score < best[k][b]:
                    best[k][b], cut[k][b] = score, a
    bounds, b = [], n
    for k in range(stages, 0, -1):
        a = cut[k][b]
        bounds.append((a, b))
        b = a
    return bounds[::-1]


def weight_balanced_bounds(path: Path, stages: int, header: Header | None = None) -> list[tuple[int, int]]:
    """`balanced_bounds` for a model or shard file: its layers' bytes, and the projection if it ends the model."""
    header = header or open_header(path)
    layers, projection = layer_weights(header)
    return balanced_bounds(layers, projection if _facts(header, path).last else 0, stages)


def write_stages(
    src: Path, out_dir: Path, bounds: Sequence[tuple[int, int]], header: Header | None = None
) -> list[Path]:
    """One shard per layer range, named `{stem}.layers-A-B.gguf` in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    header = header or open_header(src)
    return [write_shard(src, a, b, out_dir / shard_name(src, a, b), header) for a, b in bounds]


def shard_name(src: Path, start: int, end: int) -> str:
    """The file name of layers [start, end) of `src`: `{stem}.layers-A-B.gguf`."""
    return f"{src.stem}.layers-{start}-{end}.gguf"
