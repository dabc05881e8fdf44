"""The corruption proof (batch-invariant nodes, bit-exact) and the default-mode agreement analysis."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from bench.bare_loop import BareLoop, forced_logits
from bench.corruption import LogitsGap, Mismatch, agreement, exact
from bench.node_driver import closed_loop, each_alone
from bench.progress import say
from bench.systems import NODE
from bench.workload import Request
from neuron_tai.client import open_client


async def invariant_proof(
    single_address: str, chain_address: str, primary: list[Request], partners: list[Request]
) -> dict[str, Any]:
    """Bit-exact, on nodes in batch-invariant mode: concurrency 8 = alone = beside swapped partners = the chain."""
    async with (
        open_client(single_address, timeout_s=300) as single,
        open_client(chain_address, timeout_s=300) as chain,
    ):
        solo = await each_alone(single, primary, "inv-solo")
        say(f"invariant: {len(primary)} sessions run alone")
        runs: dict[str, dict[int, list[int]]] = {}
        traces, _ = await closed_loop(single, primary, len(primary), "inv-together")
        runs["concurrency 8 = alone"] = {t.rid: t.tokens for t in traces}
        half = len(primary) // 2
        swapped: dict[int, list[int]] = {}
        for group, tag in ((primary[:half] + partners[:half], "a"), (partners[half:] + primary[half:], "b")):
            traces, _ = await closed_loop(single, group[::-1], len(group), f"inv-swapped-{tag}")
            swapped.update({t.rid: t.tokens for t in traces if t.rid in solo})
        runs["swapped partners = alone"] = swapped
        traces, _ = await closed_loop(chain, primary, len(primary), "inv-chain")
        runs["2-stage chain at concurrency 8 = single node alone"] = {t.rid: t.tokens for t in traces}
    mismatches: list[Mismatch] = []
    checks = []
    for check, got in runs.items():
        found = exact(check, solo, got)
        mismatches += found
        checks.append(
            {"check": check, "sessions": len(got), "tokens": sum(map(len, got.values())), "mismatches": len(found)}
        )
        say(f"invariant: {check}: {len(got)} sessions, {len(found)} mismatches")
    for m in mismatches:
        print(m.describe(), file=sys.stderr, flush=True)
    return {"checks": checks, "mismatch_details": [asdict(m) for m in mismatches], "mismatches": len(mismatches)}


async def default_mode(
    address: str,
    sweep_tokens: Mapping[tuple[str, int], Mapping[int, Sequence[int]]],
    primary: list[Request],
    bare: BareLoop,
) -> dict[str, Any]:
    """Default mode: agreement with the solo run, and teacher-forced logits to size the gap.

    The yardstick for the gap is llama.cpp itself: the bare loop fed the same tokens, each
    session alone and then all of them in one batch.
    """
    solo = sweep_tokens[(NODE, 1)]
    out: dict[str, Any] = {"agreement": {}}
    for (system, c), tokens in sorted(sweep_tokens.items()):
        if (system, c) != (NODE, 1):
            out["agreement"][f"{system} c={c}"] = agreement(solo, tokens)
    gap = LogitsGap()
    forced = {r.rid: solo[r.rid] for r in primary}
    async with open_client(address, timeout_s=300) as client:
        await each_alone(client, primary, "tf-solo", forced=forced, on_logits=gap.keep_solo)
        await closed_loop(client, primary, len(primary), "tf-together", forced=forced, on_logits=gap.compare)
    out["teacher_forced"] = gap.summary()
    bare_gap = LogitsGap()
    for req in primary:
        forced_logits(bare, [req], forced, bare_gap.keep_solo)
    forced_logits(bare, primary, forced, bare_gap.compare)
    out["teacher_forced_bare"] = bare_gap.summary()
    worst = {k: max(r["max_abs_diff"] for r in out[k]) for k in ("teacher_forced", "teacher_forced_bare")}
    say(
        f"default mode: teacher-forced logits alone vs together, max |diff| node {worst['teacher_forced']}, "
        f"bare llama_decode {worst['teacher_forced_bare']}"
    )
    return out
