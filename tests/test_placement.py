"""The placement dynamic program against brute force, and the properties a split must have."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_tai.placement import Host, ModelCosts, PlacementError, RowCosts, Workload, evaluate, plan

COST = st.floats(0.0, 10.0, allow_nan=False)
ROW = st.builds(RowCosts, COST, COST)


@st.composite
def instances(draw: st.DrawFn, max_layers: int = 7) -> tuple[ModelCosts, list[Host], Workload]:
    n = draw(st.integers(1, max_layers))
    costs = ModelCosts(
        layers=tuple(draw(st.lists(ROW, min_size=n, max_size=n))),
        embedding=draw(ROW),
        head=draw(ROW),
        stage=draw(ROW),
        weight_bytes=tuple(draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))),
        kv_bytes_per_cell=tuple(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))),
        head_bytes=draw(st.integers(0, 100)),
    )
    stages = draw(st.integers(1, n))
    budget = st.none() | st.integers(0, 500)
    hosts = [Host(draw(st.floats(0.25, 4.0)), draw(budget)) for _ in range(stages)]
    work = Workload(draw(st.integers(0, 64)), draw(st.integers(1, 64)), draw(st.integers(0, 20)))
    return costs, hosts, work


def splits(n: int, stages: int) -> list[list[tuple[int, int]]]:
    """Every split of n layers into `stages` non-empty contiguous ranges."""
    out = []
    for cuts in itertools.combinations(range(1, n), stages - 1):
        edges = [0, *cuts, n]
        out.append(list(itertools.pairwise(edges)))
    return out


def fits(costs: ModelCosts, hosts: list[Host], work: Workload, bounds: list[tuple[int, int]]) -> bool:
    p = evaluate(costs, hosts, work, bounds)
    return all(h.memory_bytes is None or s.memory_bytes <= h.memory_bytes for s, h in zip(p.stages, hosts, strict=True))


@settings(max_examples=300, deadline=None)
@given(instances())
def test_the_plan_equals_brute_force(case: tuple[ModelCosts, list[Host], Workload]) -> None:
    costs, hosts, work = case
    feasible = [b for b in splits(len(costs.layers), len(hosts)) if fits(costs, hosts, work, b)]
    if not feasible:
        with pytest.raises(PlacementError, match="fits their memory"):
            plan(costs, hosts, work)
        return
    best = min(evaluate(costs, hosts, work, b).slowest_seconds for b in feasible)
    got = plan(costs, hosts, work)
    assert math.isclose(got.slowest_seconds, best, rel_tol=1e-9, abs_tol=1e-12)
    assert fits(costs, hosts, work, got.bounds)


@settings(max_examples=200, deadline=None)
@given(instances())
def test_budgets_hold_and_the_bound_is_a_fraction(case: tuple[ModelCosts, list[Host], Workload]) -> None:
    costs, hosts, work = case
    try:
        got = plan(costs, hosts, work)
    except PlacementError:
        return
    for stage, host in zip(got.stages, hosts, strict=True):
        assert host.memory_bytes is None or stage.memory_bytes <= host.memory_bytes
    assert 0 < got.efficiency_bound <= 1
    assert math.isclose(sum(s.share for s in got.stages), 1.0)
    assert max(s.load for s in got.stages) == pytest.approx(1.0)
    assert got.bounds[0][0] == 0 and got.bounds[-1][1] == len(costs.layers)


def uniform(n: int, head: float = 0.0) -> ModelCosts:
    return ModelCosts(
        layers=(RowCosts(1.0, 0.1),) * n,
        embedding=RowCosts(0.0, 0.0),
        head=RowCosts(head, head / 10),
        stage=RowCosts(0.0, 0.0),
        weight_bytes=(10,) * n,
        kv_bytes_per_cell=(1,) * n,
    )


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.integers(1, 8))
def test_equal_hosts_and_uniform_layers_split_evenly(n: int, stages: int) -> None:
    stages = min(stages, n)
    got = plan(uniform(n), [Host()] * stages, Workload())
    sizes = [b - a for a, b in got.bounds]
    assert max(sizes) - min(sizes) <= 1
    assert got.efficiency_bound == pytest.approx(n / (stages * max(sizes)))


@settings(max_examples=100, deadline=None)
@given(st.integers(3, 40), st.booleans())
def test_a_twice_as_fast_host_gets_more_layers(n: int, fast_first: bool) -> None:
    hosts = [Host(2.0), Host(1.0)] if fast_first else [Host(1.0), Host(2.0)]
    got = plan(uniform(n), hosts, Workload())
    fast, slow = (0, 1) if fast_first else (1, 0)
    sizes = [b - a for a, b in got.bounds]
    assert sizes[fast] > sizes[slow]


def test_the_head_moves_layers_off_the_last_stage() -> None:
    got = plan(uniform(12, head=4.0), [Host(), Host()], Workload(prefill_tokens=0, decode_tokens=1))
    assert got.bounds == [(0, 8), (8, 12)]  # 8 against 4 + the head's 4
    assert got.efficiency_bound == pytest.approx(1.0)


def test_a_memory_budget_caps_a_stage() -> None:
    costs = uniform(10)
    work = Workload(kv_cells=10)  # 20 bytes a layer
    got = plan(costs, [Host(4.0, memory_bytes=60), Host(1.0)], work)
    assert got.bounds[0] == (0, 3)  # the fast host would take 8 layers, but holds only 3
    with pytest.raises(PlacementError, match="fits their memory"):
        plan(costs, [Host(memory_bytes=60), Host(memory_bytes=60)], work)


def test_bad_input_is_refused() -> None:
    with pytest.raises(PlacementError, match="stages"):
        plan(uniform(2), [Host()] * 3, Workload())
    with pytest.raises(PlacementError, match="contiguous"):
        evaluate(uniform(4), [Host(), Host()], Workload(), [(0, 2), (3, 4)])
    with pytest.raises(ValueError, match="speed"):
        Host(0.0)
    with pytest.raises(ValueError, match="one entry per layer"):
        ModelCosts((RowCosts(1, 1),), RowCosts(0, 0), RowCosts(0, 0), RowCosts(0, 0), (1, 2), (1,))
