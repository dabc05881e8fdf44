"""The physical ceiling: llama.cpp's own `llama-batched-bench` decode speed (S_TG) at B = 1, 2, 4, 8, 16.

It decodes B independent sequences in lockstep with no server, no sampling and no Python:
what this CPU and this llama.cpp build can do with the model. The report shows every
system as a fraction of it. S_TG counts generated tokens over generation time only, so a
system whose tok/s includes prefill (the closed loop) sits a little further below it.

    python -m bench ceiling [--model M] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import WORK, bench_model, resolve_model, shown, write_evidence
from bench.llama_server import BATCHED_BENCH, cached_binary, ensure_llama_server
from bench.progress import say

BATCHES = (1, 2, 4, 8, 16)


def parse_table(text: str) -> dict[int, float]:
    """{B: S_TG t/s} from llama-batched-bench's markdown table."""
    header: list[str] = []
    out: dict[int, float] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S_TG t/s" in cells:
            header = cells
        elif header and len(cells) == len(header) and cells[0].isdigit():
            row = dict(zip(header, cells, strict=True))
            out[int(row["B"])] = float(row["S_TG t/s"])
    return out


def measure(
    binary: Path, model: Path, *, pp: int, tg: int, batches: Sequence[int] = BATCHES, threads: int = 2
) -> dict[str, Any]:
    """One llama-batched-bench run: every B in one process, prompts not shared, flash attention as the node's."""
    n_kv = max(batches) * (pp + tg)
    cmd = [
        str(binary),
        "-m",
        str(model),
        "-c",
        str(n_kv),
        "-b",
        "512",
        "-ub",
        "512",
        "-t",
        str(threads),
        "-npp",
        str(pp),
        "-ntg",
        str(tg),
        "-npl",
        ",".join(map(str, batches)),
    ]
    say("$ " + shown(" ".join(cmd)))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    s_tg = parse_table(done.stdout)
    if done.returncode != 0 or set(s_tg) != set(batches):
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-12:])
        raise RuntimeError(f"llama-batched-bench exited {done.returncode} with B={sorted(s_tg)}:\n{tail}")
    return {
        "tool": BATCHED_BENCH,
        "command": shown(" ".join(cmd)),
        "pp": pp,
        "tg": tg,
        "threads": threads,
        "s_tg": {str(b): s_tg[b] for b in batches},
    }


def ceiling_for(model: Path, *, pp: int, tg: int, build: bool) -> dict[str, Any] | None:
    """The ceiling of `model`, or None (with the reason said) when llama-batched-bench is not to be had."""
    binary = cached_binary(BATCHED_BENCH)
    if binary is None and build:
        binary, note = ensure_llama_server(BATCHED_BENCH)
        say(f"{BATCHED_BENCH}: {shown(note)}")
    if binary is None:
        say(f"ceiling: skipped, {BATCHED_BENCH} is not built (`just bench` builds it once)")
        return None
    try:
        return measure(binary, model, pp=pp, tg=tg)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        say(f"ceiling: {exc}")
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a GGUF file, gemma-3-270m or a model shape")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 16 tokens; only an already built tool")
    parser.add_argument("--out", type=Path, help="the JSON result (default: evidence/ceiling-MODEL.json)")
    args = parser.parse_args()
    model = resolve_model(args.model) if args.model else bench_model(args.quick)
    result = ceiling_for(model, pp=16, tg=16 if args.quick else 128, build=not args.quick)
    if result is None:
        return 0 if args.quick else 1
    for b, tok_s in result["s_tg"].items():
        say(f"{model.name}: B={b} S_TG {tok_s:.1f} tok/s")
    payload = {"model": model.name, **result}
    if args.out or args.quick:
        out = args.out or WORK / f"ceiling-{model.stem}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_evidence(out.name, payload, directory=out.parent)
    else:
        write_evidence(f"ceiling-{model.stem}.json", payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
