"""`neuron-tai plan` and `shard --balance plan`: the split, the shares, the bound and the serve lines."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from neuron_tai.cli import main
from neuron_tai.layer_costs import Measure, chain_rows, load_costs, measure_costs, save_costs
from neuron_tai.placement import Host, ModelCosts, RowCosts, Workload, plan


def uniform_costs(n: int, head: float) -> ModelCosts:
    """Layers of 1 ms a decode row; a head that costs `head` ms a decode row (nothing in prefill)."""
    return ModelCosts(
        layers=(RowCosts(0.001, 0.0001),) * n,
        embedding=RowCosts(0.0, 0.0),
        head=RowCosts(head / 1000, 0.0),
        stage=RowCosts(0.0, 0.0),
        weight_bytes=(2**20,) * n,
        kv_bytes_per_cell=(256,) * n,
        head_bytes=4 * 2**20,
    )


@pytest.fixture
def costs_file(tmp_path: Path) -> Path:
    return save_costs(uniform_costs(4, head=2.0), tmp_path / "costs.json", {"made": "by hand"})


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out.splitlines(), out.err


def test_costs_round_trip_through_json(tmp_path: Path) -> None:
    costs = uniform_costs(3, head=1.5)
    assert load_costs(save_costs(costs, tmp_path / "c.json")) == costs
    (tmp_path / "bad.json").write_text(json.dumps({"layers": []}))
    with pytest.raises(ValueError, match="not a costs file"):
        load_costs(tmp_path / "bad.json")


def test_plan_prints_the_split_the_bound_and_serve_lines_tail_first(
    tiny_model: Path, costs_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hosts = ["2@tcp://10.0.0.1:5555", "1@tcp://10.0.0.2:5556", "1@tcp://10.0.0.3:5557"]
    given = ["--costs", str(costs_file), "--workload", "0:1", *(f"--host={h}" for h in hosts)]
    code, lines, _ = run(capsys, "plan", str(tiny_model), *given)
    assert code == 0
    expected = plan(uniform_costs(4, 2.0), [Host(2), Host(1), Host(1)], Workload(0, 1))
    assert expected.bounds == [(0, 2), (2, 3), (3, 4)]  # the fast host takes two layers; the head goes alone
    rows = [line.split() for line in lines if line[:1].isdigit()]
    assert [r[1] for r in rows] == ["0:2", "2:3", "3:4"]
    assert [float(r[-2]) for r in rows] == [round(s.share, 3) for s in expected.stages]
    assert any(f"efficiency bound: {expected.efficiency_bound:.3f}" in line for line in lines)
    serve = [shlex.split(line) for line in lines if line.strip().startswith("neuron-tai serve")]
    assert [s[s.index("--layers") + 1] for s in serve] == ["3:4", "2:3", "0:2"]  # tail first
    assert [s[s.index("--bind") + 1] for s in serve] == [h.split("@")[1] for h in reversed(hosts)]
    assert "--next" not in serve[0]
    assert [s[s.index("--next") + 1] for s in serve[1:]] == ["tcp://10.0.0.3:5557", "tcp://10.0.0.2:5556"]
    # Three stages keep three micro-batches in flight: the head is told; the stages below run its groups.
    assert ["--micro-batches" in s for s in serve] == [False, False, True]
    assert serve[2][serve[2].index("--micro-batches") + 1] == "3"


def test_a_memory_limit_moves_layers_and_an_impossible_one_is_one_line(
    tiny_model: Path, costs_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["plan", str(tiny_model), "--costs", str(costs_file), "--workload", "0:1", "--kv-cells", "1024"]
    code, lines, _ = run(capsys, *base, "--host", "4:1300K", "--host", "1")  # 1.25 MiB a layer
    assert code == 0
    assert [line.split()[1] for line in lines if line[:1].isdigit()] == ["0:1", "1:4"]
    code, _, err = run(capsys, *base, "--host", "1:1M", "--host", "1:1M")
    assert code == 2 and err.count("\n") == 1 and "fits their memory" in err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--host", "fast"], "expected SPEED[:MEM][@ADDR]"),
        (["--host", "1@10.0.0.1:5555"], "is not an address"),
        (["--stages", "3", "--host", "1", "--host", "1"], "one --host per stage"),
        (["--stages", "2", "--workload", "16"], "PREFILL:DECODE"),
        (["--stages", "9"], "need 1 <= stages <= layers"),
        ([], "give --stages N or one --host"),
    ],
)
def test_plan_mistakes_are_one_line(
    tiny_model: Path, costs_file: Path, capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    code, _, err = run(capsys, "plan", str(tiny_model), "--costs", str(costs_file), *args)
    assert code == 2 and said in err and err.count("\n") == 1


def test_measured_costs_of_the_tiny_model_plan_and_shard(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    costs = measure_costs(tiny_model, Measure(reps=2))
    assert len(costs.layers) == 4 and costs.head_bytes > 0 and all(w > 0 for w in costs.weight_bytes)
    # Timings: a tiny model's layer costs, found by differences, may round to nothing; they are
    # never negative, and a plan is made from whatever they are.
    assert all(c.decode >= 0 and c.prefill >= 0 for c in costs.layers)
    code, lines, _ = run(capsys, "plan", str(tiny_model), "--measure")
    assert code == 0 and float(lines[0].split()[1]) > 0
    cached = tmp_path / "cache" / "neuron-tai" / "costs"
    assert [p.name.split(".")[-2] for p in cached.glob("*.json")] == ["t1-d8-p64"]  # 8 sessions in one call
    code, lines, _ = run(capsys, "plan", str(tiny_model), "--stages", "2")
    planned = [line.split()[1] for line in lines if line[:1].isdigit()]
    assert len(planned) == 2 and "4-row decode calls" in lines[0]  # a chain's head: 2 micro-batches of 4
    assert not any("--micro-batches" in line for line in lines)  # serve's default with --next
    assert sorted(p.name.split(".")[-2] for p in cached.glob("*.json")) == ["t1-d4-p64", "t1-d8-p64"]
    code, lines, _ = run(capsys, "shard", str(tiny_model), "--stages", "2", "-o", str(tmp_path / "shards"))
    assert code == 0 and [line.split()[1] for line in lines] == planned  # shard --stages uses the plan


def test_decode_rows_a_stage_is_measured_at() -> None:
    # A chain of N stages runs N micro-batches: 1/N of the sessions a call.
    assert [chain_rows(8, 1), chain_rows(8, 2), chain_rows(8, 3), chain_rows(7, 2), chain_rows(1, 2)] == [8, 4, 3, 4, 1]
    with pytest.raises(ValueError, match="concurrency >= 1"):
        chain_rows(0, 2)


def test_shard_balance_plan_reads_a_costs_file(
    tiny_model: Path, costs_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["shard", str(tiny_model), "--stages", "2", "--costs", str(costs_file), "-o", str(tmp_path / "p")]
    code, lines, _ = run(capsys, *args)
    expected = plan(uniform_costs(4, 2.0), [Host(), Host()], Workload()).bounds
    assert code == 0 and [line.split()[1] for line in lines] == [f"{a}:{b}" for a, b in expected]
    code, lines, _ = run(capsys, *args[:-2], "--balance", "even", "-o", str(tmp_path / "e"))
    assert code == 0 and [line.split()[1] for line in lines] == ["0:2", "2:4"]


def test_costs_of_a_sliding_window_model_are_measured(
    tiny_gemma: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    costs = measure_costs(tiny_gemma, Measure(reps=1, decode_rows=2, prefill_rows=8))
    assert len(costs.layers) == 6 and len(plan(costs, [Host(), Host()], Workload()).bounds) == 2
