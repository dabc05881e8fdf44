"""The prefill pace: budgets from measured costs, a decode step re-measured when stale (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.pacing import PrefillPace


def test_first_asks_for_a_decode_only_iteration_then_probes_then_sizes_from_costs() -> None:
    pace = PrefillPace()
    assert pace.prefill_budget(1.0) == 0  # no decode cost yet: measure one
    pace.observe(decode_rows=5, prefill_rows=0, ms=40.0)
    assert pace.prefill_budget(1.0) == PrefillPace.MIN_CHUNK  # prefill cost unknown: a probe
    pace.observe(decode_rows=5, prefill_rows=100, ms=240.0)  # 200 ms for 100 rows: 2 ms each
    assert pace.prefill_budget(1.0) == PrefillPace.MIN_CHUNK  # 20 rows would be under the floor
    assert pace.prefill_budget(4.0) == 80


def test_a_mixed_call_before_any_decode_measurement_teaches_nothing() -> None:
    pace = PrefillPace()
    pace.observe(decode_rows=5, prefill_rows=8, ms=80.0)
    assert pace.prefill_token_ms is None and pace.prefill_budget(1.0) == 0


def test_prefill_only_calls_measure_the_token_cost_directly() -> None:
    pace = PrefillPace()
    pace.observe(decode_rows=0, prefill_rows=256, ms=420.0)
    pace.observe(decode_rows=8, prefill_rows=0, ms=60.0)
    assert pace.prefill_token_ms is not None and abs(pace.prefill_token_ms - 420 / 256) < 1e-9
    assert pace.prefill_budget(2.0) == int(2 * 60 / (420 / 256))


def test_a_stale_decode_estimate_is_measured_again() -> None:
    pace = PrefillPace()
    pace.observe(decode_rows=5, prefill_rows=0, ms=40.0)
    for _ in range(PrefillPace.REMEASURE_EVERY - 1):
        pace.observe(decode_rows=5, prefill_rows=32, ms=100.0)
        assert pace.prefill_budget(1.0) > 0
    pace.observe(decode_rows=5, prefill_rows=32, ms=100.0)
    assert pace.prefill_budget(1.0) == 0
    pace.observe(decode_rows=6, prefill_rows=0, ms=50.0)
    assert pace.prefill_budget(1.0) > 0 and pace.decode_ms == 40.0 + 0.2 * (50.0 - 40.0)


calls = st.tuples(st.integers(0, 16), st.integers(0, 512), st.floats(0.1, 1000.0))


@given(st.lists(calls, max_size=80), st.floats(0.1, 8.0))
def test_prefill_is_never_held_back_twice_in_a_row(history: list[tuple[int, int, float]], share: float) -> None:
    """A zero budget (decode-only, to measure) is answered by a decode-only call: the next is not zero."""
    pace = PrefillPace()
    for decode_rows, prefill_rows, ms in history:
        pace.observe(decode_rows, prefill_rows, ms)
    budget = pace.prefill_budget(share)
    assert budget == 0 or budget >= PrefillPace.MIN_CHUNK
    if budget == 0:
        pace.observe(decode_rows=4, prefill_rows=0, ms=30.0)  # the decode-only iteration it asked for
        assert pace.prefill_budget(share) >= PrefillPace.MIN_CHUNK
