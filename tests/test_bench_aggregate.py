"""The report's derived figures: means over repetitions and the saturation rule."""

from __future__ import annotations

from bench.aggregate import mean_by, saturation


def rows(system: str, rates: dict[int, list[float]]) -> list[dict[str, object]]:
    return [{"system": system, "concurrency": c, "tok_s": r} for c, rs in rates.items() for r in rs]


def test_saturation_is_the_first_concurrency_within_ten_percent_of_the_best() -> None:
    runs = rows("node", {1: [40, 44], 2: [38.0], 4: [60.0], 8: [68.0], 16: [70.0]})
    assert mean_by(runs, "tok_s")["node"][1] == 42.0
    sat = saturation(runs)["node"]
    assert sat["saturates_at"] == 8 and sat["best_tok_s"] == 70.0  # 68 >= 0.9 * 70, 60 is not
    assert sat["gains"]["1->2"] < 0  # a dip does not stop the search


def test_a_system_measured_at_one_concurrency_has_no_saturation_point() -> None:
    assert saturation(rows("serial", {1: [50.0]}))["serial"]["saturates_at"] is None
