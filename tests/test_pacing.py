"""The prefill pace: an adaptive budget from measured costs, the gaps' p99 and who waits (pure)."""

from __future__ import annotations

import copy

from hypothesis import example, given
from hypothesis import strategies as st

from engine.pacing import Demand, PrefillPace

FOUR_DECODING = Demand(decoding=4, prefilling=1)  # as many as in the decode-only calls measured


def measured(decode_ms: float, prefill_token_ms: float) -> PrefillPace:
    """A pace that has seen one decode-only call of `decode_ms` and knows a prompt token's cost."""
    pace = PrefillPace(prefill_token_ms=prefill_token_ms)
    pace.observe(decode_rows=4, prefill_rows=0, ms=decode_ms)
    return pace


def test_first_asks_for_a_decode_only_iteration_then_probes_then_sizes_from_costs() -> None:
    pace = PrefillPace()
    assert pace.prefill_budget(1.0) == 0  # no decode cost yet: measure one
    pace.observe(decode_rows=4, prefill_rows=0, ms=40.0)
    assert pace.prefill_budget(1.0, demand=FOUR_DECODING) == PrefillPace.MIN_CHUNK  # prefill cost unknown: a probe
    pace.observe(decode_rows=4, prefill_rows=100, ms=240.0)  # 200 ms for 100 rows: 2 ms each
    assert pace.gain == 1.0  # a probe is not sized by the gain: it teaches the gain nothing
    # The default target is 1 + share decode steps: room for `share` steps of prefill.
    assert pace.prefill_budget(1.0, demand=FOUR_DECODING) == PrefillPace.MIN_CHUNK  # 20 rows: under the floor
    assert pace.prefill_budget(4.0, demand=FOUR_DECODING) == 80
    assert pace.target_ms == 5 * 40.0


def test_an_operator_target_sets_the_room_whatever_the_share() -> None:
    pace = measured(40.0, 0.5)
    assert pace.prefill_budget(1.0, itl_target_ms=100.0, demand=FOUR_DECODING) == 120  # (100 - 40) / 0.5
    assert pace.prefill_budget(9.0, itl_target_ms=100.0, demand=FOUR_DECODING) == 120
    assert pace.prefill_budget(1.0, itl_target_ms=30.0, demand=FOUR_DECODING) == PrefillPace.MIN_CHUNK  # no room


def test_a_mixed_call_before_any_decode_measurement_teaches_nothing() -> None:
    pace = PrefillPace()
    pace.observe(decode_rows=5, prefill_rows=8, ms=80.0)
    assert pace.prefill_token_ms is None and pace.prefill_budget(1.0) == 0


def test_prefill_only_calls_measure_the_token_cost_directly() -> None:
    pace = PrefillPace()
    pace.observe(decode_rows=0, prefill_rows=256, ms=420.0)
    pace.observe(decode_rows=8, prefill_rows=0, ms=60.0)
    assert pace.prefill_token_ms is not None and abs(pace.prefill_token_ms - 420 / 256) < 1e-9
    assert pace.prefill_budget(2.0, demand=FOUR_DECODING) == int(2 * 60 / (420 / 256))


def test_a_stale_decode_estimate_is_measured_again() -> None:
    pace = PrefillPace()
    pace.observe(decode_rows=4, prefill_rows=0, ms=40.0)
    for _ in range(PrefillPace.REMEASURE_EVERY - 1):
        pace.observe(decode_rows=4, prefill_rows=32, ms=100.0)
        assert pace.prefill_budget(1.0, demand=FOUR_DECODING) > 0
    pace.observe(decode_rows=4, prefill_rows=32, ms=100.0)
    assert pace.prefill_budget(1.0, demand=FOUR_DECODING) == 0
    pace.observe(decode_rows=6, prefill_rows=0, ms=50.0)
    assert pace.prefill_budget(1.0, demand=FOUR_DECODING) > 0
    assert pace.steps.estimate(6) == 50.0 and pace.steps.estimate(4) == 40.0


def test_gaps_over_the_target_shrink_the_gain_and_full_calls_well_under_it_grow_it() -> None:
    pace = measured(40.0, 1.0)
    rows = pace.prefill_budget(1.0, demand=FOUR_DECODING)  # target 80 ms: 40 rows
    assert rows == 40
    pace.observe(decode_rows=4, prefill_rows=rows, ms=120.0)  # a gap of 120 ms: over
    assert pace.gain == PrefillPace.SHRINK
    pace = measured(40.0, 1.0)
    rows = pace.prefill_budget(1.0, demand=FOUR_DECODING)
    pace.observe(decode_rows=4, prefill_rows=rows - 1, ms=50.0)  # under, but the prompt ran out: no evidence
    assert pace.gain == 1.0
    rows = pace.prefill_budget(1.0, demand=FOUR_DECODING)
    pace.observe(decode_rows=4, prefill_rows=rows, ms=50.0)  # the whole budget, well under the target
    assert pace.gain == PrefillPace.GROW
    assert pace.prefill_budget(1.0, demand=FOUR_DECODING) > rows


def test_sessions_waiting_to_prefill_share_the_iteration_with_those_decoding() -> None:
    pace = measured(40.0, 0.25)
    alone = pace.prefill_budget(1.0, demand=Demand(decoding=2, prefilling=1))
    assert alone == 160 and not pace.boosted
    wave = pace.prefill_budget(1.0, demand=Demand(decoding=2, prefilling=6))
    assert pace.boosted and wave == 3 * alone
    pace.observe(decode_rows=2, prefill_rows=wave, ms=160.0)  # a boosted gap: not what the target holds
    assert pace.gain == 1.0 and not pace.gaps


def test_the_default_target_follows_the_undisturbed_gaps_jitter_not_one_stall() -> None:
    pace = measured(40.0, 1.0)
    for ms in [40.0] * 8 + [48.0, 2000.0]:  # a little jitter, and one stall of the machine
        pace.observe(decode_rows=4, prefill_rows=0, ms=ms)
    pace.prefill_budget(1.0, demand=FOUR_DECODING)
    assert pace.target_ms == 2 * 48.0  # twice the 90th percentile of the decode-only calls


calls = st.tuples(st.integers(0, 16), st.integers(0, 512), st.floats(0.1, 1000.0))
demands = st.builds(Demand, st.integers(0, 16), st.integers(0, 16))
targets = st.one_of(st.none(), st.floats(1.0, 500.0))


@given(st.lists(st.tuples(calls, demands), max_size=80), st.floats(0.1, 8.0), targets, demands)
@example([((1, 0, 1.0), Demand(0, 0))], 1.0, None, Demand(0, 2))  # the probe, two prompts waiting
def test_prefill_is_never_held_back_twice_in_a_row(
    history: list[tuple[tuple[int, int, float], Demand]], share: float, target: float | None, last: Demand
) -> None:
    """A zero budget (decode-only, to measure) is answered by a decode-only call: the next is not
    zero. Whatever happened before, the gain stays within its bounds, and a budget that is not
    zero carries a smallest chunk for each prompt waiting."""
    pace = PrefillPace()
    for (decode_rows, prefill_rows, ms), demand in history:
        pace.prefill_budget(share, target, demand)
        pace.observe(decode_rows, prefill_rows, ms)
        assert PrefillPace.MIN_GAIN <= pace.gain <= PrefillPace.MAX_GAIN
    after_last = copy.deepcopy(pace).prefill_budget(share, target, last)
    assert after_last == 0 or after_last >= PrefillPace.MIN_CHUNK * max(last.prefilling, 1)
    budget = pace.prefill_budget(share, target, FOUR_DECODING)
    assert budget == 0 or budget >= PrefillPace.MIN_CHUNK
    if budget == 0:
        pace.observe(decode_rows=4, prefill_rows=0, ms=30.0)  # the decode-only iteration it asked for
        assert pace.prefill_budget(share, target, FOUR_DECODING) >= PrefillPace.MIN_CHUNK


@given(st.lists(calls, min_size=2, max_size=60), demands, st.integers(1, 16), st.floats(0.1, 8.0), targets)
def test_more_sessions_waiting_never_lower_the_budget(
    history: list[tuple[int, int, float]], demand: Demand, more: int, share: float, target: float | None
) -> None:
    pace = PrefillPace()
    for decode_rows, prefill_rows, ms in history:
        pace.prefill_budget(share, target, demand)
        pace.observe(decode_rows, prefill_rows, ms)
    fewer = copy.deepcopy(pace).prefill_budget(share, target, demand)
    busier = Demand(demand.decoding, demand.prefilling + more)
    assert copy.deepcopy(pace).prefill_budget(share, target, busier) >= fewer


@given(
    decode_ms=st.floats(2.0, 200.0),
    token_ms=st.floats(0.01, 10.0),
    decoding=st.integers(1, 16),
    prompt=st.integers(1, 4096),
    share=st.floats(0.25, 4.0),
)
def test_a_long_prompt_beside_decodes_keeps_every_gap_within_the_target(
    decode_ms: float, token_ms: float, decoding: int, prompt: int, share: float
) -> None:
    """The promise, on an engine whose calls cost decode_ms plus token_ms a prompt row: while one
    prompt prefills beside sessions decoding, no gap exceeds 1 + share decode steps (or one
    smallest chunk: prefill never stops), and the prompt is done within a bounded number of calls."""
    pace = PrefillPace()
    pace.observe(decoding, 0, decode_ms)  # the decode step, measured before the prompt came
    limit = max((1 + share) * decode_ms, decode_ms + PrefillPace.MIN_CHUNK * token_ms) * (1 + 1e-9)
    left, calls = prompt, 0
    while left:
        calls += 1
        rows = min(left, pace.prefill_budget(share, None, Demand(decoding, 1)), 256)
        gap = decode_ms + rows * token_ms
        assert gap <= limit
        pace.observe(decoding, rows, gap)
        left -= rows
    assert calls <= 2 * -(-prompt // PrefillPace.MIN_CHUNK)


def test_a_wave_of_sessions_is_paced_by_the_cost_of_as_many_rows_as_decode() -> None:
    """A 1-row decode step measured, then ten sessions decode: their step is measured before
    prefill is sized from it, and the target is twice that step, not twice the 1-row one."""
    pace = PrefillPace(prefill_token_ms=2.0)
    pace.observe(decode_rows=1, prefill_rows=0, ms=16.0)
    ten = Demand(decoding=10, prefilling=1)
    assert pace.prefill_budget(1.0, demand=ten) > 0  # just measured: never asked twice in a row
    pace.observe(decode_rows=0, prefill_rows=64, ms=128.0)
    assert pace.prefill_budget(1.0, demand=ten) == 0  # no measured size within 2x of ten rows
    pace.observe(decode_rows=10, prefill_rows=0, ms=70.0)
    assert pace.prefill_budget(1.0, demand=ten) == 35  # (2 x 70 - 70) ms of room at 2 ms a row
    assert pace.target_ms == 140.0
    pace.observe(decode_rows=10, prefill_rows=35, ms=140.0)
    wave = Demand(decoding=20, prefilling=30)  # 20 rows were never measured, but more wait than decode:
    assert pace.prefill_budget(1.0, demand=wave) > 0 and pace.boosted  # they join first


def test_the_prefill_floor_grows_with_the_prompts_waiting() -> None:
    """The target leaves room for 40 rows: one prompt waiting gets them; three waiting beside the
    same decodes get a smallest chunk each, and a call that carried them, past the target for
    their sake, is no evidence for the gain. One that carried no more than the target allows
    (a few rows of draft verification wait in the same round robin) is."""
    pace = measured(40.0, 1.0)
    assert pace.prefill_budget(1.0, demand=FOUR_DECODING) == 40 and not pace.boosted
    three = Demand(decoding=4, prefilling=3)
    assert pace.prefill_budget(1.0, demand=three) == 3 * PrefillPace.MIN_CHUNK
    pace.observe(decode_rows=4, prefill_rows=3 * PrefillPace.MIN_CHUNK, ms=40.0 + 3 * PrefillPace.MIN_CHUNK)
    assert pace.boosted and pace.gain == 1.0 and not pace.gaps
    assert pace.prefill_budget(1.0, demand=FOUR_DECODING) == 40
    pace.prefill_budget(1.0, demand=three)
    pace.observe(decode_rows=4, prefill_rows=15, ms=55.0)  # three verifications of 5 rows
    assert not pace.boosted and list(pace.gaps) == [55.0 / 80.0]


def test_a_first_prefill_carries_a_smallest_chunk_for_each_prompt_and_only_one_counts() -> None:
    """A prompt row's cost is not known yet: the probe carries the floor, and what it carries past
    one prompt's chunk is for the prompts' sake, no gap the gain follows."""
    for prompts, counted in ((1, 1), (3, 0)):
        probe = PrefillPace()
        probe.observe(decode_rows=4, prefill_rows=0, ms=40.0)
        rows = probe.prefill_budget(1.0, demand=Demand(decoding=4, prefilling=prompts))
        assert rows == prompts * PrefillPace.MIN_CHUNK
        probe.observe(decode_rows=4, prefill_rows=rows, ms=40.0 + rows)
        assert len(probe.gaps) == counted


def test_a_call_a_few_rows_short_of_its_budget_for_row_blocks_still_used_it() -> None:
    """The scheduler may leave fewer than `row_multiple` rows of a budget to the next call (row
    blocks): such a call used its budget, and a gap well under the target grows the gain."""
    for multiple, grown in ((1, False), (4, True)):
        pace = PrefillPace(prefill_token_ms=1.0, row_multiple=multiple)
        pace.observe(decode_rows=4, prefill_rows=0, ms=40.0)
        budget = pace.prefill_budget(1.0, demand=FOUR_DECODING)
        pace.observe(decode_rows=4, prefill_rows=budget - 3, ms=60.0)
        assert (pace.gain > 1.0) is grown


def test_one_gap_over_the_target_shrinks_the_gain_once_not_on_every_call_after_it() -> None:
    """A stall stays in the p99's window for many calls; only gaps over the target shrink the gain."""
    pace = measured(40.0, 1.0)
    rows = pace.prefill_budget(1.0, demand=FOUR_DECODING)  # target 80 ms
    pace.observe(decode_rows=4, prefill_rows=rows, ms=200.0)
    assert pace.gain == PrefillPace.SHRINK
    for _ in range(10):
        rows = pace.prefill_budget(1.0, demand=FOUR_DECODING)
        pace.observe(decode_rows=4, prefill_rows=rows, ms=75.0)  # under the target, the p99 still over it
    assert pace.gain == PrefillPace.SHRINK


def test_a_micro_batched_engine_is_paced_by_its_calls_rows_and_shared_by_all_its_sessions() -> None:
    """Groups of 4 and 5 decode in calls of their own: the 4-row step sizes the budget (no 9-row one
    is asked for), and 6 sessions waiting to prefill are no wave beside 9 decoding, though more
    than the 5 rows of the largest call."""
    pace = measured(40.0, 1.0)
    pace.observe(decode_rows=4, prefill_rows=32, ms=72.0)
    groups = Demand(decoding=9, prefilling=1, largest_call=5)
    assert pace.prefill_budget(1.0, demand=groups) == 40 and not pace.boosted
    cheap = measured(40.0, 0.1)  # room for 400 rows: above 6 smallest chunks
    six = cheap.prefill_budget(1.0, demand=Demand(decoding=9, prefilling=6, largest_call=5))
    assert six == 400 and not cheap.boosted
    assert pace.prefill_budget(1.0, demand=Demand(decoding=9, prefilling=1)) == 0  # 9 rows in one call: measure it
