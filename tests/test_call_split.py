"""Halving an iteration's decodes: the measured rule (pure), properties and examples."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.call_split import MAX_RECHECK_EVERY, PROBES, RECHECK_EVERY, DecodeCallCosts, split_at


def measured(rows: int, whole: float, halved: float) -> DecodeCallCosts:
    """A rule past probing for `rows`: each choice measured PROBES times at a constant cost."""
    rule = DecodeCallCosts()
    for _ in range(PROBES):
        rule.observe(rows, whole)
        rule.observe_halved(rows, halved)
    return rule


def test_probes_each_choice_twice_alternating_whole_first_then_compares() -> None:
    rule = DecodeCallCosts()
    assert not rule.halves(8)  # nothing measured yet: run it whole
    rule.observe(8, 231.0)
    assert rule.halves(8)  # the halves are not measured: split to see them
    rule.observe_halved(8, 200.0)
    assert not rule.halves(8)  # each choice twice before a comparison
    rule.observe(8, 240.0)
    assert rule.halves(8)
    rule.observe_halved(8, 230.0)  # the halves' lower median of [200, 230]: 200 < 0.95 x 231
    assert rule.halves(8)
    rule.observe(8, 200.0)  # the whole call got cheaper: [231, 240, 200] costs 231
    rule.observe(8, 200.0)  # [240, 200, 200] costs 200, and 200 > 190
    assert not rule.halves(8)


def test_the_halves_sizes_measured_elsewhere_are_no_price_for_halving() -> None:
    """4-row calls measured while four sessions decoded do not decide for 8 rows: the halves
    of 8 are measured as such, right after the whole 8-row call."""
    rule = DecodeCallCosts()
    for _ in range(3):
        rule.observe(4, 95.0)  # dear at the end of a run of four sessions
    rule.observe(8, 166.0)
    assert rule.halves(8)  # 2 x 95 > 0.95 x 166, yet the halves of 8 are probed
    rule.observe_halved(8, 150.0)
    rule.observe(8, 166.0)
    rule.observe_halved(8, 151.0)
    assert rule.halves(8)  # 150 < 157.7


@given(
    whole=st.floats(10.0, 1000.0),
    half_share=st.floats(0.1, 2.0).filter(lambda s: abs(s - DecodeCallCosts.MARGIN) > 1e-3),
    stall=st.floats(1.0, 1e4),
    at=st.integers(0, 400),
)
def test_one_stalled_call_changes_no_decision(whole: float, half_share: float, stall: float, at: int) -> None:
    """Constant costs, once both shapes are measured: one call stretched by any factor (the
    host stalled, the process was stopped) leaves every decision as it was without it."""

    def decisions(stalled_at: int | None) -> list[bool]:
        rule = measured(8, whole, whole * half_share)
        out = []
        for n in range(600):
            halves = rule.halves(8)
            out.append(halves)
            factor = stall if n == stalled_at else 1.0
            if halves:
                rule.observe_halved(8, factor * whole * half_share)
            else:
                rule.observe(8, factor * whole)
        return out

    assert decisions(at) == decisions(None)


def test_one_row_is_never_split_and_odd_rows_split_larger_half_first() -> None:
    rule = DecodeCallCosts()
    rule.observe(1, 10.0)
    assert not rule.halves(1)
    assert [split_at(n) for n in (2, 3, 7, 8)] == [1, 2, 4, 4]


@given(
    fixed=st.floats(1.0, 100.0),
    per_row=st.floats(0.1, 50.0),
    sizes=st.lists(st.integers(1, 64), min_size=1, max_size=300),
)
def test_where_calls_cost_a_fixed_part_plus_rows_splits_are_only_probes(
    fixed: float, per_row: float, sizes: list[int]
) -> None:
    """With cost = fixed + per_row x rows, two halves always cost more than one call: the rule
    splits a size only to measure its halves, and PROBES times per RECHECK_EVERY decisions after."""
    rule = DecodeCallCosts()
    splits: dict[int, int] = {}
    seen: dict[int, int] = {}
    for rows in sizes:
        seen[rows] = seen.get(rows, 0) + 1
        if rule.halves(rows):
            splits[rows] = splits.get(rows, 0) + 1
            rule.observe_halved(rows, 2 * fixed + per_row * rows)
        else:
            rule.observe(rows, fixed + per_row * rows)
    for rows, n in splits.items():
        assert rows >= DecodeCallCosts.MIN_ROWS
        assert n <= PROBES + PROBES * (max(0, seen[rows] - 2 * PROBES) // RECHECK_EVERY)


def recheck_positions(decisions: int) -> set[int]:
    """Decisions that take the other choice while the measured one stays: a recheck of PROBES
    decisions RECHECK_EVERY decisions in, then twice as far apart each time (never further than
    MAX_RECHECK_EVERY), counted between rechecks."""
    at, every = 0, RECHECK_EVERY
    positions: set[int] = set()
    while at + every <= decisions:
        at += every
        positions.update(range(at, min(at + PROBES, decisions + 1)))
        at += PROBES - 1
        every = min(2 * every, MAX_RECHECK_EVERY)
    return positions


def decide(rule: DecodeCallCosts, rows: int, whole: float, halved: float) -> bool:
    """One decision for `rows`, its choice then measured at the given cost."""
    halves = rule.halves(rows)
    (rule.observe_halved if halves else rule.observe)(rows, halved if halves else whole)
    return halves


@given(whole=st.floats(10.0, 1000.0), half_share=st.floats(0.1, 2.0), decisions=st.integers(1, 3000))
def test_once_measured_the_cheaper_shape_wins_but_for_rechecks(whole: float, half_share: float, decisions: int) -> None:
    """Every decision takes the measured cheaper shape, except the rechecks, which take the
    other one PROBES times (so a cost that drifted is seen afresh), further apart while nothing changes."""
    rule = measured(8, whole, whole * half_share)
    cheaper = whole * half_share < DecodeCallCosts.MARGIN * whole
    rechecks = recheck_positions(decisions)
    for n in range(1, decisions + 1):
        assert decide(rule, 8, whole, whole * half_share) == (cheaper != (n in rechecks))


def test_a_recheck_measures_the_other_choice_afresh() -> None:
    """Two stretched whole calls right after a recheck made the halves look cheaper (a gemma
    node at two sessions, evidence/split-two-rows/): the next recheck drops them and measures
    the whole call PROBES times anew, and the whole call is taken again."""
    rule = measured(2, 26.0, 29.0)
    for cost in (39.0, 45.0):
        rule.observe(2, cost)  # [26, 39, 45]: the whole call costs 39 now
    choices = [decide(rule, 2, 27.0, 29.0) for _ in range(RECHECK_EVERY + PROBES + 3)]
    assert choices[: RECHECK_EVERY - 1] == [True] * (RECHECK_EVERY - 1)  # 29 < 0.95 x 39
    assert choices[RECHECK_EVERY - 1 :] == [False] * (PROBES + 4)  # 27, 27: 29 > 0.95 x 27


def test_rechecks_come_soon_again_once_the_choice_changes() -> None:
    """Rechecks far apart after a long steady run; when the costs move enough to change the
    choice, the next recheck is RECHECK_EVERY decisions away again."""
    rule = measured(8, 200.0, 300.0)  # halves 300 ms against 200: run whole
    steady = sum(1 for _ in range(1000) if decide(rule, 8, 200.0, 300.0))
    assert steady == len(recheck_positions(1000)) == 5 * PROBES  # at 32, 97, 226, 483 and 996
    for _ in range(20):
        rule.observe_halved(8, 120.0)  # the halves got cheap: 120 ms against 200
    choices = [decide(rule, 8, 200.0, 120.0) for _ in range(RECHECK_EVERY + PROBES)]
    assert choices == [True] * (RECHECK_EVERY - 1) + [False] * PROBES + [True]
