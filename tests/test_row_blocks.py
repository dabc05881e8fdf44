"""Filler rows for kernels that take rows in blocks (engine/row_blocks.py): pure."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.call_split import RECHECK_EVERY
from engine.row_blocks import MeasuredFillers, filler_rows, weight_passes

REPACK = (16, 4)


@pytest.mark.parametrize(
    ("rows", "passes"), [(1, 1), (3, 3), (4, 1), (7, 4), (8, 2), (15, 6), (16, 1), (31, 7), (32, 2), (63, 9), (64, 4)]
)
def test_a_pass_for_each_block_largest_first_and_for_each_row_left_over(rows: int, passes: int) -> None:
    assert weight_passes(rows, REPACK) == passes


@pytest.mark.parametrize(
    ("rows", "fillers"),
    [(1, 0), (2, 0), (3, 1), (4, 0), (6, 0), (7, 1), (12, 0), (13, 0), (14, 2), (15, 1), (16, 0), (30, 2), (31, 1)],
)
def test_fillers_only_where_they_save_more_passes_than_their_number(rows: int, fillers: int) -> None:
    """3 rows (3 matrix-vector passes) run as one block of 4; 14 (3 blocks of 4 and 2 rows) as one
    of 16. 13 rows would need 3 fillers to save 3 passes: no gain, none added."""
    assert filler_rows(rows, REPACK, 512) == fillers


def test_fillers_never_take_a_call_past_its_limit_and_no_blocks_means_none() -> None:
    assert filler_rows(15, REPACK, 15) == 0
    assert filler_rows(14, REPACK, 15) == 0  # one filler would make 15: dearer than 14
    assert filler_rows(14, REPACK, 16) == 2
    assert filler_rows(15, (), 512) == 0
    assert filler_rows(0, REPACK, 512) == 0


@given(
    rows=st.integers(1, 600),
    blocks=st.sampled_from([REPACK, (8,), (4,), (32, 16, 4), (16, 8, 2)]),
    slack=st.integers(0, 40),
)
def test_fillers_give_the_cheapest_call_within_reach(rows: int, blocks: tuple[int, ...], slack: int) -> None:
    """Fewer than the smallest block, within the limit, and no number of fillers in reach costs
    less (a filler counted as dear as a pass); any filler saves a pass more than it adds."""
    limit = rows + slack
    n = filler_rows(rows, blocks, limit)
    assert 0 <= n < blocks[-1] and rows + n <= limit
    cost = n + weight_passes(rows + n, blocks)
    reach = range(min(blocks[-1] - 1, slack) + 1)
    costs = [k + weight_passes(rows + k, blocks) for k in reach]
    assert cost == min(costs) and n == costs.index(cost), "the cheapest, and of equals the fewest fillers"
    assert n == 0 or cost < weight_passes(rows, blocks)


def test_a_decode_call_measures_both_shapes_then_keeps_the_cheaper_and_rechecks_it() -> None:
    """With fillers first, then without; then the cheaper, except once every RECHECK_EVERY
    decisions, when the other shape runs again so a cost that moved is seen."""
    fillers = MeasuredFillers()
    assert fillers.pays(7)
    fillers.observe(7, True, 190.0)
    assert not fillers.pays(7)
    fillers.observe(7, False, 180.0)
    choices = [fillers.pays(7) for _ in range(RECHECK_EVERY)]
    assert choices == [False] * (RECHECK_EVERY - 1) + [True]
    fillers.observe(3, True, 105.0)
    fillers.observe(3, False, 121.0)
    assert fillers.pays(3), "each size is measured on its own"
    for _ in range(20):
        fillers.observe(7, True, 150.0)  # the filled shape got cheaper: the running cost follows
    assert fillers.pays(7)


@given(
    filled=st.floats(10.0, 1000.0),
    bare_share=st.floats(0.5, 2.0).filter(lambda s: abs(s - 1.0) > 1e-3),
    stall=st.floats(1.0, 1e4),
    at=st.integers(2, 300),
)
def test_one_stalled_call_changes_no_filler_decision(filled: float, bare_share: float, stall: float, at: int) -> None:
    """Constant costs, once both shapes are measured (the first two calls): one call stretched
    by any factor leaves every choice as it was without it."""

    def decisions(stalled_at: int | None) -> list[bool]:
        fillers = MeasuredFillers()
        out = []
        for n in range(400):
            pays = fillers.pays(7)
            out.append(pays)
            factor = stall if n == stalled_at else 1.0
            fillers.observe(7, pays, factor * (filled if pays else filled * bare_share))
        return out

    assert decisions(at) == decisions(None)
