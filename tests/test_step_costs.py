"""A decode step's cost by its rows: the lower median of recent calls, interpolated between sizes (pure)."""

from __future__ import annotations

import statistics

from hypothesis import given
from hypothesis import strategies as st

from engine.step_costs import DecodeStepCosts


def test_a_size_costs_the_lower_median_of_its_recent_calls_so_one_stall_does_not_move_it() -> None:
    costs = DecodeStepCosts()
    for ms in (40.0, 41.0, 2000.0, 39.0):
        costs.observe(4, ms)
    assert costs.estimate(4) == 40.0
    assert costs.observe(4, 42.0) == 40.0  # the cost before this call, which then joins it
    assert costs.cost(4) == 41.0


@given(
    truth=st.floats(1.0, 1000.0),
    stall=st.floats(1.0, 1e6),
    keep=st.integers(2, 9),
    before=st.integers(1, 20),
    after=st.integers(0, 20),
)
def test_one_stall_after_a_size_s_first_call_is_never_its_cost(
    truth: float, stall: float, keep: int, before: int, after: int
) -> None:
    """Calls of one size that cost `truth`, one of them stretched by any factor: the size's
    cost stays `truth` at every point after its first call."""
    costs = DecodeStepCosts(keep=keep)
    for ms in [truth] * before + [truth * stall] + [truth] * after:
        costs.observe(3, ms)
        assert costs.cost(3) == truth


def test_an_unmeasured_size_is_interpolated_or_taken_from_the_nearest() -> None:
    costs = DecodeStepCosts()
    assert costs.estimate(4) is None and not costs.measured()
    costs.observe(2, 20.0)
    costs.observe(10, 60.0)
    assert costs.estimate(6) == 40.0
    assert costs.estimate(1) == 20.0 and costs.estimate(16) == 60.0
    assert costs.near(1) and costs.near(4) and costs.near(20)  # 2 is within a factor 2 of 1 and 4, 10 of 20
    assert not costs.near(21) and not DecodeStepCosts().near(1)


@given(st.lists(st.tuples(st.integers(1, 64), st.floats(0.1, 1000.0)), min_size=1, max_size=60), st.integers(1, 64))
def test_an_estimate_lies_within_the_measured_sizes_costs(calls: list[tuple[int, float]], rows: int) -> None:
    costs = DecodeStepCosts()
    for size, ms in calls:
        costs.observe(size, ms)
    medians = {size: statistics.median_low(recent) for size, recent in costs.samples.items()}
    estimate = costs.estimate(rows)
    assert estimate is not None
    assert min(medians.values()) - 1e-9 <= estimate <= max(medians.values()) + 1e-9
    if rows in medians:
        assert estimate == medians[rows]
    assert all(len(recent) <= costs.keep for recent in costs.samples.values())
