"""The shard tool: layer ranges that load in llama.cpp, carried metadata, clear refusals."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.architectures import refusal, swa_layers
from engine.gguf_facts import KEY_LAYER_END, KEY_LAYER_START, KEY_SOURCE_BLOCKS
from neuron_tai.cli import main
from neuron_tai.shard import (
    ShardError,
    balanced_bounds,
    grouped_by_type,
    layer_weights,
    open_header,
    read_model_layers,
    stage_bounds,
    write_shard,
)
from testkit.models import write_tiny_model


def open_reader(path: Path) -> gguf.GGUFReader:
    """The gguf package's own reader: an independent check of what the shard tool wrote."""
    return gguf.GGUFReader(str(path), "r")


def field(path: Path, key: str) -> object:
    f = open_reader(path).get_field(key)
    return None if f is None else f.contents()


@pytest.mark.parametrize("model", ["tiny_model", "tiny_quant"])
def test_shard_keeps_range_renumbered_with_source_metadata(
    model: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    tiny_model: Path = request.getfixturevalue(model)
    out = write_shard(tiny_model, 1, 3, tmp_path / "mid.gguf")
    reader = open_reader(out)
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output_norm.weight", "output.weight"} <= names
    assert {n.split(".")[1] for n in names if n.startswith("blk.")} == {"0", "1", "2"}  # 2: the capture block
    src = {t.name: t for t in open_reader(tiny_model).tensors}
    dst = {t.name: t for t in reader.tensors}
    assert np.array_equal(dst["blk.0.attn_q.weight"].data, src["blk.1.attn_q.weight"].data)
    assert np.array_equal(dst["blk.1.ffn_down.weight"].data, src["blk.2.ffn_down.weight"].data)
    assert all(dst[n].tensor_type == src[n].tensor_type for n in ("token_embd.weight", "output.weight"))
    assert dst["blk.1.attn_v.weight"].tensor_type == src["blk.2.attn_v.weight"].tensor_type
    assert np.array_equal(dst["blk.2.ffn_down.weight"].data, src["blk.3.ffn_down.weight"].data)
    assert field(out, "llama.block_count") == 3
    assert (field(out, KEY_LAYER_START), field(out, KEY_LAYER_END), field(out, KEY_SOURCE_BLOCKS)) == (1, 3, 4)
    assert field(out, "tokenizer.ggml.tokens") == field(tiny_model, "tokenizer.ggml.tokens")
    layers = read_model_layers(out)
    assert (layers.start, layers.end, layers.source_blocks, layers.name) == (1, 3, 4, "tiny-llama")
    assert (layers.block_count, layers.capture_blocks, len(layers.k_widths)) == (2, 1, 3)
    last = read_model_layers(write_shard(tiny_model, 3, 4, tmp_path / "last.gguf"))
    assert (last.block_count, last.capture_blocks) == (1, 0)  # the model's end: nothing to capture


def test_a_shards_tensor_data_lies_grouped_by_type_and_unchanged(tiny_quant: Path, tmp_path: Path) -> None:
    assert not grouped_by_type(open_header(tiny_quant))  # the source interleaves F32, Q4_K and Q6_K per layer
    out = write_shard(tiny_quant, 1, 3, tmp_path / "mid.gguf")
    assert grouped_by_type(open_header(out))
    src = {t.name: t for t in open_reader(tiny_quant).tensors}
    for t in open_reader(out).tensors:
        m = re.match(r"blk\.(\d+)\.(.*)", t.name)
        name = f"blk.{int(m.group(1)) + 1}.{m.group(2)}" if m else t.name
        assert t.tensor_type == src[name].tensor_type and np.array_equal(t.data, src[name].data), t.name


def test_shard_of_a_shard_reports_source_positions(tiny_model: Path, tmp_path: Path) -> None:
    mid = write_shard(tiny_model, 1, 4, tmp_path / "a.gguf")
    inner = write_shard(mid, 1, 2, tmp_path / "b.gguf")
    layers = read_model_layers(inner)
    assert (layers.start, layers.end, layers.source_blocks) == (2, 3, 4)


def test_sliding_window_pattern_is_written_per_shard(tiny_gemma: Path, tmp_path: Path) -> None:
    # 6 layers, llama.cpp's gemma3 default: every 6th layer global -> [T, T, T, T, T, F]
    assert field(tiny_gemma, "gemma3.attention.sliding_window_pattern") is None
    tail = write_shard(tiny_gemma, 3, 6, tmp_path / "tail.gguf")
    assert field(tail, "gemma3.attention.sliding_window_pattern") == [True, True, False]


def test_per_layer_arrays_are_sliced(tmp_path: Path) -> None:
    src = write_tiny_model(tmp_path / "m.gguf")
    # Rewrite with a per-layer head count array, as some architectures have.
    reader = open_reader(src)
    w = gguf.GGUFWriter(str(tmp_path / "arr.gguf"), "llama")
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", "llama.attention.head_count_kv"):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    w.add_key_value("llama.attention.head_count_kv", [2, 2, 1, 1], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = write_shard(tmp_path / "arr.gguf", 1, 3, tmp_path / "arr-shard.gguf")
    assert field(out, "llama.attention.head_count_kv") == [2, 1, 1]  # and the capture block's


@pytest.mark.parametrize(("a", "b"), [(0, 0), (3, 2), (-1, 2), (0, 5)])
def test_bad_ranges_are_refused(tiny_model: Path, tmp_path: Path, a: int, b: int) -> None:
    with pytest.raises(ShardError, match="layer range"):
        write_shard(tiny_model, a, b, tmp_path / "x.gguf")
    assert not list(tmp_path.iterdir())


def test_missing_and_non_gguf_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ShardError, match="no such file"):
        write_shard(tmp_path / "nope.gguf", 0, 1, tmp_path / "x.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all" * 10)
    with pytest.raises(ShardError, match="not a GGUF file"):
        write_shard(junk, 0, 1, tmp_path / "x.gguf")


def test_architectures_without_layer_outputs_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(4)
    w.add_tensor("blk.0.ssm_in.weight", np.zeros((2, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ShardError, match="recurrent state"):
        write_shard(path, 0, 2, tmp_path / "x.gguf")
    assert refusal("bert") is not None and "l_out" in str(refusal("some-future-arch"))
    assert refusal("llama") is None and refusal("gemma3") is None


def test_stage_bounds() -> None:
    assert stage_bounds(18, stages=3) == [(0, 6), (6, 12), (12, 18)]
    assert stage_bounds(4, stages=3) == [(0, 1), (1, 3), (3, 4)]
    assert stage_bounds(18, split=[6, 12]) == [(0, 6), (6, 12), (12, 18)]
    for bad in ([12, 6], [0, 6], [6, 18]):
        with pytest.raises(ShardError):
            stage_bounds(18, split=bad)
    with pytest.raises(ShardError):
        stage_bounds(4, stages=5)


def test_balanced_bounds_give_the_projection_to_the_last_stage() -> None:
    # gemma-3-270m's shape: 18 layers of ~3.6 MiB, a tied 170 MiB vocabulary projection.
    assert balanced_bounds([36] * 18, 1700, 2) == [(0, 17), (17, 18)]
    assert balanced_bounds([36] * 18, 1700, 3) == [(0, 8), (8, 17), (17, 18)]
    assert balanced_bounds([10] * 6, 0, 3) == [(0, 2), (2, 4), (4, 6)]
    assert balanced_bounds([10] * 6, 20, 2) == [(0, 4), (4, 6)]
    with pytest.raises(ShardError):
        balanced_bounds([10] * 4, 0, 5)


@given(
    st.lists(st.integers(0, 1000), min_size=1, max_size=12).flatmap(
        lambda layers: st.tuples(st.just(layers), st.integers(0, 5000), st.integers(1, len(layers)))
    )
)
def test_balanced_bounds_is_the_best_contiguous_split(case: tuple[list[int], int, int]) -> None:
    layers, projection, stages = case
    bounds = balanced_bounds(layers, projection, stages)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(layers) and len(bounds) == stages
    assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in itertools.pairwise(bounds))

    def worst(split: Sequence[tuple[int, int]]) -> int:
        return max(sum(layers[a:b]) + (projection if b == len(layers) else 0) for a, b in split)

    every = [
        stage_bounds(len(layers), split=list(cuts))
        for cuts in itertools.combinations(range(1, len(layers)), stages - 1)
    ]
    assert worst(bounds) == min(worst(split) for split in every)


def test_shard_cli_balances_by_weights(tiny_gemma: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    header = open_header(tiny_gemma)
    layers, projection = layer_weights(header)
    assert len(layers) == 6 and projection == next(t.nbytes for t in header.tensors if t.name == "output.weight")
    expected = balanced_bounds(layers, projection, 2)
    for extra, bounds in ((["--balance", "weights"], expected), (["--balance", "layers"], [(0, 3), (3, 6)])):
        assert main(["shard", str(tiny_gemma), "--stages", "2", "-o", str(tmp_path / str(extra)), *extra]) == 0
        printed = capsys.readouterr().out.splitlines()
        assert [line.split()[1] for line in printed] == [f"{a}:{b}" for a, b in bounds]


def test_swa_layers_matches_llama_cpp_rule() -> None:
    assert swa_layers(7, 6, False) == [True] * 5 + [False, True]
    assert swa_layers(5, 4, True) == [False, True, True, True, False]


def test_cli_shard(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["shard", str(tiny_model), "--split", "1,3", "-o", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and "layers 1:3" in printed[1]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "tiny-llama.layers-0-1.gguf",
        "tiny-llama.layers-1-3.gguf",
        "tiny-llama.layers-3-4.gguf",
    ]
    assert main(["shard", str(tiny_model), "--layers", "0:9", "-o", str(tmp_path / "x.gguf")]) == 2
    assert "not within the model's 4 layers" in capsys.readouterr().err


def test_header_reader_agrees_with_the_gguf_package(tiny_gemma: Path, tmp_path: Path) -> None:
    from engine.gguf_header import HeaderError, read_header  # noqa: PLC0415

    ours = read_header(tiny_gemma)
    theirs = open_reader(tiny_gemma)
    for key in (
        "general.architecture",
        "gemma3.block_count",
        "gemma3.attention.sliding_window",
        "tokenizer.ggml.bos_token_id",
        "gemma3.attention.layer_norm_rms_epsilon",
    ):
        assert ours.get(key) == pytest.approx(field(tiny_gemma, key)), key
    tokens = field(tiny_gemma, "tokenizer.ggml.tokens")
    assert isinstance(tokens, list) and ours.entries["tokenizer.ggml.tokens"].count == len(tokens)
    assert [(t.name, t.offset, t.nbytes) for t in ours.tensors] == [
        (t.name, int(t.data_offset) - ours.data_offset, int(t.n_bytes)) for t in theirs.tensors
    ]
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(tiny_gemma.read_bytes()[:3000])
    for bad in (truncated, tmp_path / "empty.gguf"):
        bad.touch()
        with pytest.raises(HeaderError):
            read_header(bad)
