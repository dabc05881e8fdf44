"""Kept shards: written once per source and range, rewritten when the source changes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.gguf_header import Header, TensorInfo
from neuron_tai import shard as shard_module
from neuron_tai.shard import ShardError, grouped_by_type, open_header, read_model_layers, shard_name
from neuron_tai.shard_cache import cached_shard, cached_stages, source_folder, user_shard_dir
from testkit.models import TinySpec, write_tiny_model


def test_a_current_shard_is_kept_and_a_newer_source_rewrites_it(tiny_model: Path, tmp_path: Path) -> None:
    source = tmp_path / "m" / "tiny.gguf"
    source.parent.mkdir()
    shutil.copy(tiny_model, source)
    first, second = cached_stages(source, [(0, 2), (2, 4)], tmp_path / "cache")
    assert [read_model_layers(p).end for p in (first, second)] == [2, 4] and first.parent == second.parent
    kept = first.stat().st_ino  # a rewrite replaces the file (a new inode)
    assert cached_shard(source, 0, 2, tmp_path / "cache") == first and first.stat().st_ino == kept
    os.utime(source, ns=(1, first.stat().st_mtime_ns + 10**9))  # the source changed after the shard
    assert cached_shard(source, 0, 2, tmp_path / "cache") == first and first.stat().st_ino != kept
    assert not list(first.parent.glob("*.part"))


def test_a_kept_shard_that_no_longer_reads_is_written_again(tiny_model: Path, tmp_path: Path) -> None:
    shard = cached_shard(tiny_model, 0, 2, tmp_path / "cache")
    shard.write_bytes(b"GGUF but not a model")  # newer than its source, and unreadable
    assert cached_shard(tiny_model, 0, 2, tmp_path / "cache") == shard
    assert read_model_layers(shard).end == 2


def test_a_kept_shard_in_its_sources_tensor_order_is_written_again(
    tiny_quant: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    grouped = shard_module._shard_tensors

    def in_source_order(header: Header, start: int, end: int) -> list[tuple[str, TensorInfo]]:
        return sorted(grouped(header, start, end), key=lambda named: named[1].offset)

    with monkeypatch.context() as patch:  # as shards were written before they grouped their tensors
        patch.setattr(shard_module, "_shard_tensors", in_source_order)
        shard = cached_shard(tiny_quant, 0, 2, tmp_path / "cache")
    assert not grouped_by_type(open_header(shard))
    kept = shard.stat().st_ino
    assert cached_shard(tiny_quant, 0, 2, tmp_path / "cache") == shard and shard.stat().st_ino != kept
    assert grouped_by_type(open_header(shard))
    rewritten = shard.stat().st_ino
    assert cached_shard(tiny_quant, 0, 2, tmp_path / "cache") == shard and shard.stat().st_ino == rewritten


def test_a_killed_writers_half_shard_is_removed_and_a_living_ones_kept(tiny_model: Path, tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    living = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        folder = tmp_path / "cache" / source_folder(tiny_model)
        folder.mkdir(parents=True)
        name = shard_name(tiny_model, 0, 2)
        abandoned, writing = (folder / f"{name}.{p.pid}.part" for p in (gone, living))
        other = folder / f"{shard_name(tiny_model, 2, 4)}.{gone.pid}.part"  # another shard's: not this writer's
        unseen = folder / f"{name}.{2**22 + 1}.part"  # above any pid: a writer in another PID namespace
        for part in (abandoned, writing, other, unseen):
            part.write_bytes(b"half")
            os.utime(part, (0, 0))  # untouched since 1970
        unseen.touch()  # but this one is being written
        shard = cached_shard(tiny_model, 0, 2, tmp_path / "cache")
        assert read_model_layers(shard).end == 2
        assert not abandoned.exists() and writing.exists() and other.exists() and unseen.exists()
    finally:
        living.communicate()


def test_two_sources_of_one_name_never_share_a_shard(tiny_model: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "tiny.gguf", tmp_path / "b" / "tiny.gguf"
    a.parent.mkdir()
    b.parent.mkdir()
    shutil.copy(tiny_model, a)
    write_tiny_model(b, TinySpec(n_layer=6, seed=5))
    shard_a, shard_b = (cached_shard(m, 2, 4, tmp_path / "cache") for m in (a, b))
    assert shard_a != shard_b and shard_a.name == shard_b.name
    assert read_model_layers(shard_a).source_blocks == 4 and read_model_layers(shard_b).source_blocks == 6


def test_a_bad_range_writes_nothing(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ShardError, match="not within the model's 4 layers"):
        cached_shard(tiny_model, 3, 9, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_the_users_cache_follows_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert user_shard_dir() == tmp_path / "neuron-tai" / "shards"
