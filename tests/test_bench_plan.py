"""How `just bench` keeps four reports within its time: the cuts each report's plan makes, repetitions first."""

from __future__ import annotations

from pathlib import Path

from bench.report import FULL, QUICK, plan_for

MODEL = Path("/models/some-model.gguf")


def test_the_default_report_keeps_every_system_request_and_proof() -> None:
    plan = plan_for(FULL, "prompt", MODEL, None, named=False)
    assert (plan.per_client, plan.proofs, plan.variants, plan.out_dir) == (0, True, True, FULL.out_dir)
    assert plan.chain_at == ()  # the chain at every concurrency


def test_a_decode_heavy_report_serves_one_request_per_client_and_leaves_the_proofs_to_the_default_one() -> None:
    plan = plan_for(FULL, "decode", MODEL, None, named=False)
    assert (plan.max_new, plan.reps, plan.per_client, plan.proofs, plan.variants) == (128, 1, 1, False, False)
    assert plan.chain_at == (1, 8)
    assert plan.out_dir == FULL.out_dir / "report-decode"


def test_another_models_prompt_heavy_report_serves_two_requests_per_client_and_the_chain_at_two_points() -> None:
    plan = plan_for(FULL, "prompt", MODEL, None, named=True)
    assert (plan.max_new, plan.reps, plan.per_client, plan.proofs, plan.variants) == (32, 1, 2, False, False)
    assert plan.chain_at == (1, 8)
    assert plan.out_dir == FULL.out_dir / "report-some-model"


def test_quick_reports_cut_nothing_but_repetitions() -> None:
    for workload in ("prompt", "decode"):
        plan = plan_for(QUICK, workload, MODEL, Path("/tmp/x"), named=True)
        assert (plan.reps, plan.per_client, plan.proofs, plan.variants, plan.chain_at) == (1, 0, True, True, ())
        assert plan.out_dir == Path("/tmp/x")
