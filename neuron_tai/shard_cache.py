"""Shards kept between runs: a layer range is written once and reused while it is current.

`serve --layers`, `plan`'s cost probes and the bench's suites all ask for the same few
ranges of the same models; writing each anew costs a model's size on disk every time (a
1B model's splits, once per suite, filled gigabytes). Each source file has a folder of its
own, named after its stem and its resolved path: two models of one name in different
places never share a shard. A kept shard is current while it is no older than its source,
reads as a GGUF file, carries its capture block and has its tensors grouped by type (shards
written before either are rewritten). Writing is atomic (`write_shard`), so a run stopped
mid-write leaves no half shard behind.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from engine.gguf_facts import ModelFacts
from engine.gguf_header import Header
from neuron_tai.shard import (
    ShardError,
    check_layer_range,
    grouped_by_type,
    open_header,
    read_model_layers,
    shard_name,
    write_shard,
)

log = logging.getLogger("neuron_tai")


def user_shard_dir() -> Path:
    """Where `serve --layers` keeps its shards: `$XDG_CACHE_HOME/neuron-tai/shards` (~/.cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "neuron-tai" / "shards"


def cached_shard(
    model: Path, start: int, end: int, cache_dir: Path | None = None, header: Header | None = None
) -> Path:
    """Layers [start, end) of `model` as a shard in `cache_dir` (the user's by default),
    written only when there is no current one. `header`: the model's, if already read."""
    header = header or open_header(model)
    facts = read_model_layers(model, header)
    check_layer_range(facts.block_count, start, end)
    out = (cache_dir or user_shard_dir()) / source_folder(model) / shard_name(model, start, end)
    if not _current(out, model, facts):
        out.parent.mkdir(parents=True, exist_ok=True)
        log.info("writing shard %s", out)
        write_shard(model, start, end, out, header)
    return out


def cached_stages(model: Path, bounds: Sequence[tuple[int, int]], cache_dir: Path) -> list[Path]:
    """`cached_shard` for each layer range, in order (the model's header read once)."""
    header = open_header(model)
    return [cached_shard(model, a, b, cache_dir, header) for a, b in bounds]


def source_folder(model: Path) -> str:
    """`{stem}-{8 hex digits of the resolved path}`: the folder of one source file's shards."""
    digest = hashlib.sha256(str(model.resolve()).encode()).hexdigest()[:8]
    return f"{model.stem}-{digest}"


def _current(shard: Path, model: Path, facts: ModelFacts) -> bool:
    """A kept shard to serve as it is; one that is stale, from before capture blocks or tensors
    grouped by type, or no longer a readable GGUF (changed by hand, a disk error) is written again."""
    if not shard.exists() or shard.stat().st_mtime < model.stat().st_mtime:
        return False
    try:
        header = open_header(shard)
        written = read_model_layers(shard, header)
    except ShardError:
        return False
    if written.end < facts.end and written.capture_blocks == 0:  # before capture blocks
        return False
    return grouped_by_type(header)  # written before shards grouped their tensors: held more memory
