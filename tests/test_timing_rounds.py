"""Rounds and the times read from them: what a drifting machine must not change."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from neuron_tai.timing_rounds import rotated, same_round_times

NAMES = ["first", "middle", "last", "whole"]
TIME = st.floats(1e-4, 10.0, allow_nan=False)
FACTOR = st.floats(0.25, 8.0, allow_nan=False)


def _ratios(times: dict[str, float]) -> dict[str, float]:
    return {name: t / times["whole"] for name, t in times.items()}


@given(st.lists(TIME, min_size=4, max_size=4), st.lists(FACTOR, min_size=1, max_size=9))
def test_a_slowdown_that_hits_whole_rounds_changes_no_ratio(base: list[float], factors: list[float]) -> None:
    # Every round at its own speed, each thing's time that speed x its own cost.
    times = {name: [b * k for k in factors] for name, b in zip(NAMES, base, strict=True)}
    measured = _ratios(same_round_times(times, "whole"))
    expected = _ratios(dict(zip(NAMES, base, strict=True)))
    assert all(math.isclose(measured[n], expected[n], rel_tol=1e-9) for n in NAMES)


@given(
    st.lists(TIME, min_size=4, max_size=4),
    st.lists(FACTOR, min_size=3, max_size=9),
    st.sampled_from(NAMES),
    st.data(),
    st.floats(1.0, 100.0),
)
def test_one_call_slowed_alone_moves_nothing(
    base: list[float], factors: list[float], slowed: str, data: st.DataObject, by: float
) -> None:
    times = {name: [b * k for k in factors] for name, b in zip(NAMES, base, strict=True)}
    times[slowed][data.draw(st.integers(0, len(factors) - 1))] *= by
    measured = _ratios(same_round_times(times, "whole"))
    expected = _ratios(dict(zip(NAMES, base, strict=True)))
    assert all(math.isclose(measured[n], expected[n], rel_tol=1e-9) for n in NAMES)


def test_the_reference_keeps_its_median_time() -> None:
    times = {"whole": [3.0, 1.0, 2.0], "last": [1.5, 0.5, 1.0]}
    assert same_round_times(times, "whole") == {"whole": 2.0, "last": 1.0}


@given(st.integers(0, 12), st.integers(1, 6))
def test_rotated_rounds_hold_every_side_once_each_first_in_turn(rounds: int, n: int) -> None:
    sides = list(range(n))
    order = list(rotated(rounds, sides))
    assert len(order) == rounds * n
    for k in range(rounds):
        this_round = [side for r, side in order if r == k]
        assert sorted(this_round) == sides and this_round[0] == k % n
