"""The report's derived figures: means over repetitions, the saturation rule, the gateway's median rounds."""

from __future__ import annotations

from pytest import MonkeyPatch

from bench import gateway_bench
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


def test_gateway_rounds_rotate_the_order_and_keep_each_system_s_median_round(monkeypatch: MonkeyPatch) -> None:
    order: list[str] = []
    rates = {"direct": iter([30.0, 10.0, 20.0]), "a": iter([5.0, 6.0, 7.0]), "b": iter([9.0, 8.0, 1.0])}

    async def run(url: str, *_: object) -> dict[str, object]:
        order.append(url)
        keys = ("ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
        return {"tok_s": next(rates[url]), "ttft_p50_ms": len(order), **dict.fromkeys(keys, 0.0)}

    monkeypatch.setattr(gateway_bench, "direct_loop", run)
    monkeypatch.setattr(gateway_bench, "closed_loop", lambda url, _model, *rest: run(url, *rest))
    urls = {gateway_bench.DIRECT: "direct", "gateway a": "a", "gateway b": "b"}
    rows = gateway_bench.measure_concurrency(urls, "m", [], 4, 3)
    assert order == ["direct", "a", "b", "a", "b", "direct", "b", "direct", "a"]
    direct = rows[gateway_bench.DIRECT]
    assert (direct["tok_s"], direct["ttft_p50_ms"], direct["rounds_tok_s"]) == (20.0, 8, [30.0, 10.0, 20.0])
    assert rows["gateway a"]["tok_s"] == 6.0 and rows["gateway b"]["tok_s"] == 8.0
    two = gateway_bench.median_round([{"tok_s": 2.0}, {"tok_s": 1.0}])
    assert two == {"tok_s": 1.0, "rounds_tok_s": [2.0, 1.0]}  # the lower middle of an even count
