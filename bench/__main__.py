"""`python -m bench SUITE... [--model M] [--quick] [--out DIR]`: the one entry point of the bench.

Each suite runs in a process of its own (its nodes and peers are stopped with it), one
after another, and the time each took is printed. `all` is what `just bench` runs: the
report on gemma-3-270m and on the Llama-3.2-1B shape, each with the prompt-heavy and the
decode-heavy workload (each report also measures llama-batched-bench's ceiling), then
kernels, CURVE, stage costs and memory (both models), multi-host for both models,
placement on unequal stages (the 1B shape), the gateway, speculation, and the pipeline
figures (folded into the reports with the stages, placement, gateway and speculation).
Chaos measures robustness, not speed: it is `just chaos`. With `--quick`, `all` is the
quick report on the tiny test model.

`--model` takes a GGUF file, `gemma-3-270m` or a model shape (`llama-3.2-1b`, `llama-3.1-8b`;
written once into ~/.cache/neuron-tai/shapes): every suite then measures that model, shards
it itself, and its reports go beside the default one (evidence/DGR-012/report-MODEL/ and
report-decode-MODEL/), named in every table. `--out DIR` puts every report and JSON that a suite lets place there.

    python -m bench all                       # just bench
    python -m bench all --quick               # just bench quick
    python -m bench report --quick --model my-model.gguf
    python -m bench list                      # the suites
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.attach import PARTS as ATTACHED_PARTS
from bench.common import EVIDENCE, MODEL_ENV, WORK, shown
from bench.interrupts import interrupt_on_signals
from bench.progress import say

SHAPE = "llama-3.2-1b"  # the stand-in for the models users split, beside gemma-3-270m


@dataclass(frozen=True, slots=True)
class Suite:
    """A bench part: its module, its arguments in full and quick runs (None: no quick form), what it shows."""

    module: str
    full: tuple[str, ...]
    quick: tuple[str, ...] | None
    about: str
    out: str = ""  # "dir": takes --out DIR; "file": takes --out FILE.json; "": writes where it always does
    default_out: str = ""  # --out of a full run on the default model, when the suite needs one


SUITES = {
    "report": Suite("bench.report", ("full",), ("quick",), "nodes, chain, llama-server, bare loop at c=1-16, "
                    "the ceiling, proofs, burst (prompt-heavy)", "dir"),
    "report-decode": Suite("bench.report", ("full", "--workload", "decode"),
                           ("quick", "--workload", "decode"), "the same, decode-heavy: 16-token prompts, 128 new",
                           "dir"),
    "ceiling": Suite("bench.ceiling", (), ("--quick",), "llama-batched-bench S_TG at B=1-16", "file"),
    "kernels": Suite("bench.kernel_paths", ("--reps", "1"), None, "bare loop on each weight kernel path"),
    "curve": Suite("bench.curve_cost", ("--reps", "1"), ("--quick",), "the cost of CurveZMQ links", "file"),
    "stages": Suite("bench.stage_cost", ("--reps", "1"), ("--quick",), "per-stage decode cost of a split"),
    "fillers": Suite("bench.filler_cost", (), ("--quick", "--reps", "2"), "decode calls with and without the "
                     "filler rows of row blocks"),
    "multihost": Suite("bench.multihost", (), ("--quick", "--out", str(WORK / "multihost-quick.json")),
                       "2-stage chain across network namespaces", "file", "evidence/multihost.json"),
    "gateway": Suite("bench.gateway_bench", (), ("--quick",), "OpenAI gateway against llama-server's", "file",
                     "evidence/gateway.json"),
    "pipeline": Suite("bench.pipeline_evidence", (), None, "evidence/pipeline.json from the report and multihost"),
    "attach": Suite("bench.attach", (), None, "fold gateway, speculation and pipeline into the report"),
    "chaos": Suite("bench.chaos", ("full",), ("quick",), "hostile peers against nodes and chains; replicas "
                   "killed, hung and cut off"),
    "compaction": Suite("bench.kv_compaction", (), None, "what one KV compaction costs"),
    "padding": Suite("bench.invariance_padding", ("--steps", "24", "--pads", "2,4,8"), None,
                     "decode-batch padding for batch invariance"),
    "backend": Suite("bench.backend_sweep", ("--steps", "96", "--reps", "7"), None, "backend against bare loop"),
    "engine": Suite("bench.engine_sweep", (), None, "engine throughput, TTFT/ITL, interference"),
    "node": Suite("bench.node_sweep", (), None, "nodes over ZeroMQ against the engine"),
    "micro-batches": Suite("bench.micro_batches", (), None, "micro-batches 1 vs 2 at c=8"),
    "placement": Suite("bench.placement", (), ("--quick",), "plan's split vs even and weight-balanced on unequal "
                       "stages (cgroup quota), c=8", "file"),
    "speculation": Suite("bench.speculation", (), ("--quick",), "speculative generate against speculate 0: "
                         "single node and chain, c=1/4/8, copy-heavy and non-repetitive", "file"),
}  # fmt: skip

# `just bench`: (suite, model; None = the suite's default, gemma-3-270m), each suite with its full arguments.
# Within 45 minutes on 2 cores: the reports beside the default cut repetitions, then systems (bench.report
# plan_for); the sweeps run one repetition; multi-host measures scale-out at c = 1, 8 and 16 (where its
# targets are), a client serving 2 prompt-heavy requests (all 16 from c = 8 on) or 1 decode-heavy one, the
# latency tolerance at 0 and 5 ms on gemma-3-270m only; placement runs two repetitions on the 1B shape;
# the gateway serves 4 requests per client.
FULL_SET: list[tuple[str, str | None]] = [
    ("report", None),
    ("report-decode", None),
    ("report", SHAPE),
    ("report-decode", SHAPE),
    ("kernels", None),
    ("fillers", None),
    ("fillers", SHAPE),
    ("curve", None),
    ("stages", None),
    ("multihost", None),
    ("multihost", SHAPE),
    ("stages", SHAPE),
    ("placement", SHAPE),
    ("gateway", None),
    ("speculation", None),
    ("pipeline", None),
    ("attach", None),
    ("pipeline", SHAPE),
    ("attach", SHAPE),
]
FULL_EXTRA: dict[tuple[str, str | None], tuple[str, ...]] = {
    ("multihost", None): ("--per-client", "2", "--delays", "0,5", "--concurrency", "1,8,16", "--reps", "3"),
    ("multihost", SHAPE): ("--per-client", "2", "--delays", "none", "--concurrency", "1,8,16", "--reps", "3"),
    ("placement", SHAPE): ("--reps", "2"),
}
QUICK_SET: list[tuple[str, str | None]] = [("report", None)]


def model_tag(model: str) -> str:
    """How a model names the files of its runs: a shape's name, or the GGUF file's name."""
    return Path(model).name.removesuffix(".gguf")


def command(name: str, model: str | None, quick: bool, out: Path | None) -> list[str]:
    """The suite's command line: its module, its mode's arguments, the model and where it writes."""
    suite = SUITES[name]
    args = suite.quick if quick else suite.full
    if args is None:
        raise SystemExit(f"{name} has no quick form; run it without --quick")
    cmd = [sys.executable, "-m", suite.module, *args, *(() if quick else FULL_EXTRA.get((name, model), ()))]
    if model is not None and suite.module in ("bench.report", "bench.ceiling"):
        cmd += ["--model", model]
    tag = f"-{model_tag(model)}" if model else ""
    reports = out or (WORK / "DGR-012-quick" if quick else EVIDENCE / "DGR-012")
    if suite.out == "dir" and (out is not None or model or name != "report"):
        cmd += ["--out", str(reports / f"{name}{tag}")]  # the default model's prompt-heavy report: DGR-012 itself
    elif suite.out == "file" and (out is not None or (model and not quick)):
        cmd += ["--out", str((out or EVIDENCE) / f"{name}{tag}.json")]
    elif suite.default_out and not quick:
        cmd += ["--out", suite.default_out]
    if model is not None and name in ("pipeline", "attach"):  # what this model's report and multihost wrote
        report, files = reports / f"report{tag}", out or EVIDENCE
        cmd += (
            ["--report", str(report / "bench.json"), "--multihost", str(files / f"multihost{tag}.json")]
            if name == "pipeline"
            else ["--report-dir", str(report)]
            + [x for flag, stem in ATTACHED_PARTS for x in (f"--{flag}", str(files / f"{stem}{tag}.json"))]
        )
    return cmd


SUITE_STOP_S = 300.0  # how long an interrupted suite may take to stop what it started


def run_suite(cmd: list[str], env: dict[str, str]) -> int:
    """The suite's exit status. The suite runs in a session of its own, so an interrupt (Ctrl-C
    at the terminal, or SIGINT or SIGTERM sent to this process) reaches it once, from here; it
    then stops its nodes and removes its network namespaces while this waits (killed halfway,
    it would leave them behind). A second interrupt kills it."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=SUITE_STOP_S)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        return 130


def run(plan: list[tuple[str, str | None]], quick: bool, out: Path | None) -> int:
    """Each suite in turn, timed; stops at an interrupt; 1 when any failed."""
    times: list[tuple[str, float, int]] = []
    for name, model in plan:
        cmd = command(name, model, quick, out)
        label = name + (f" ({model})" if model else "")
        env = {**os.environ, **({MODEL_ENV: model} if model else {})}
        say(f"== {label}: {shown(' '.join(cmd[1:]))}")
        start = time.perf_counter()
        status = run_suite(cmd, env)
        times.append((label, time.perf_counter() - start, status))
        say(f"== {label}: {'ok' if status == 0 else f'exit {status}'} in {times[-1][1]:.0f} s")
        if status in (130, -2):
            break
    say(
        "suite times: "
        + "; ".join(f"{label} {s:.0f} s" + ("" if rc == 0 else f" (exit {rc})") for label, s, rc in times)
    )
    say(f"total {sum(s for _, s, _ in times) / 60:.1f} min")
    return 0 if all(rc == 0 for *_, rc in times) else 130 if times and times[-1][2] in (130, -2) else 1


def main() -> int:
    interrupt_on_signals()  # SIGTERM too, and Ctrl-C even when started with SIGINT ignored
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("suites", nargs="+", metavar="SUITE", help=f"all, list, or: {', '.join(SUITES)}")
    parser.add_argument("--model", help="a GGUF file, gemma-3-270m or a model shape (llama-3.2-1b, llama-3.1-8b)")
    parser.add_argument("--quick", action="store_true", help="the quick form: tiny model unless --model, seconds")
    parser.add_argument("--out", type=Path, help="a directory for every report and JSON a suite lets place")
    args = parser.parse_args()
    if args.suites == ["list"]:
        for name, suite in SUITES.items():
            print(f"{name:14} {suite.about}{'' if suite.quick is not None else ' (full only)'}")
        return 0
    if args.suites == ["all"]:
        plan = QUICK_SET if args.quick else FULL_SET
        if args.model:  # every part, on the one model the user named
            plan = list(dict.fromkeys((name, args.model) for name, _ in plan))
    else:
        unknown = [s for s in args.suites if s not in SUITES]
        if unknown:
            parser.error(f"unknown suite {', '.join(unknown)}; known: all, list, {', '.join(SUITES)}")
        plan = [(name, args.model) for name in args.suites]
    return run(plan, args.quick, args.out)


if __name__ == "__main__":
    sys.exit(main())
