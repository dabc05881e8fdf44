"""What each part of a model costs on this machine, measured with llama.cpp, for the placement plan.

Four files are timed with the node's backend, one decode step of `decode_rows` sessions
and one prefill chunk of `prefill_rows` rows each: the first layer (token input, the
embedding lookup), the second layer (hidden input and output), the last layer (with the
output head) and the whole model. The four are open at once and timed in `reps` rounds,
one call of each a round in rotating order; a file's time is its median ratio to the whole
model's in the same round, times the whole model's median. Timed one file after another,
a slow spell of the machine that fell on one file moved work from one part to another: on
an AMD EPYC one such measurement put the 1B shape's output head at 12.3 ms a row where
eleven others found 8.8-9.3, and the plan's decode split at 0:12 / 12:16, stages of 18.1
and 15.0 ms a row, instead of 0:11 / 11:16 (16.7 and 16.7). Within a round, a spell falls
on every file alike. With one unknown per part,

    first = stage + embedding + c*b0      middle = stage + c*b1
    last  = stage + head + c*b[n-1]       whole  = stage + embedding + head + c*sum(b)

give c, the cost per weight byte of a layer (each layer then costs c times its bytes, so
mixed quantization types are weighed), the per-call cost every stage pays, the
embedding's and the head's. Decode and prefill are solved separately, divided by their
rows. The three one-layer shards are written once into the shard cache `serve` uses, and
the result is cached as JSON (`load_costs` reads such a file: tests and the bench need not
measure again).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.backend import ContextConfig, Segment, StageBackend
from engine.messages import Output
from neuron_tai.placement import ModelCosts, RowCosts
from neuron_tai.shard import ShardError, layer_weights, open_header, read_model_layers
from neuron_tai.shard_cache import cached_shard
from neuron_tai.timing_rounds import rotated, same_round_times

__all__ = [
    "Measure",
    "cached_costs",
    "chain_micro_batches",
    "chain_rows",
    "costs_cache_path",
    "load_costs",
    "measure_costs",
    "save_costs",
]

_CONTEXT_TOKENS = 16  # each decode session's prompt: the step attends to a short context


@dataclass(frozen=True, slots=True)
class Measure:
    """How costs are measured: llama.cpp threads (a stage's own), rows per call, rounds of the four files."""

    threads: int = 1
    decode_rows: int = 8
    prefill_rows: int = 64
    reps: int = 5

    @classmethod
    def for_chain(cls, concurrency: int, stages: int, threads: int = 1) -> Measure:
        """Timed at the rows each stage's decode calls carry (`chain_rows`)."""
        return cls(threads=threads, decode_rows=chain_rows(concurrency, stages))


def chain_rows(concurrency: int, stages: int) -> int:
    """Decode rows per call of each stage when `stages` serve `concurrency` sessions at once: a
    chain's head runs its sessions in as many micro-batches as the chain has stages (2 is
    `serve`'s default with `--next`; `plan` gives longer chains theirs), a lone node in one
    call. Costs are measured at this many rows because llama.cpp's cost per row depends on
    rows per call, and not smoothly: its repacked and tiled matmul kernels take rows in
    blocks of 4, or from 8 rows on."""
    if concurrency < 1 or stages < 1:
        raise ValueError(f"need concurrency >= 1 and stages >= 1, not {concurrency} and {stages}")
    return -(-concurrency // chain_micro_batches(stages))


def chain_micro_batches(stages: int) -> int:
    """The micro-batches a chain of `stages` keeps in flight so that every stage can be busy at
    once: one per stage (1 for a lone node)."""
    return stages


@dataclass(frozen=True, slots=True)
class _Timing:
    decode: float  # seconds per decode step of `decode_rows` sessions
    prefill: float  # seconds per prefill chunk of `prefill_rows` rows


def _context(how: Measure) -> ContextConfig:
    cells = how.decode_rows * (_CONTEXT_TOKENS + how.reps + 2) + how.prefill_rows + 64
    batch = max(how.prefill_rows, how.decode_rows * _CONTEXT_TOKENS)
    return ContextConfig(
        n_seq_max=how.decode_rows + 1, n_ctx=cells, n_batch=batch, n_ubatch=batch, n_threads=how.threads
    )


def _segment(backend: StageBackend, seq: int, pos: int, rows: int, out: Output) -> Segment:
    info = backend.info
    if info.first:
        return Segment(seq, pos, tokens=np.full(rows, 100 + seq % 50, np.int32), output=out)
    rng = np.random.default_rng(seq * 1000 + pos)
    return Segment(seq, pos, hidden=rng.standard_normal((rows, info.n_embd)).astype(np.float32), output=out)


@dataclass(frozen=True, slots=True)
class _Subject:
    """One file open for timing: what a call of its decode step, and of its prefill chunk, decodes."""

    decode: Callable[[], list[Segment]]
    prefill: Callable[[], list[Segment]]
    backend: StageBackend

    def seconds(self, batch: Callable[[], list[Segment]]) -> float:
        segments = batch()
        start = time.perf_counter()
        self.backend.decode(segments)
        return time.perf_counter() - start


def _open_subject(stack: ExitStack, path: Path, how: Measure) -> _Subject:
    """`path` loaded, its decode sessions given their context and one warm step."""
    backend = stack.enter_context(StageBackend(path, _context(how)))
    out = Output.TOKEN if backend.info.last else Output.HIDDEN
    seqs = [backend.open_sequence() for _ in range(how.decode_rows)]
    backend.decode([_segment(backend, s, 0, _CONTEXT_TOKENS, Output.NONE) for s in seqs])
    pos = [_CONTEXT_TOKENS]

    def step() -> list[Segment]:
        pos[0] += 1
        return [_segment(backend, s, pos[0] - 1, 1, out) for s in seqs]

    backend.decode(step())  # warm
    # A prompt: every row's hidden state below the tail, the last row's token at the tail.
    prompt = backend.open_sequence()

    def chunk() -> list[Segment]:
        backend.rewind(prompt, 0)
        return [_segment(backend, prompt, 0, how.prefill_rows, out)]

    return _Subject(step, chunk, backend)


def _time_files(files: dict[str, Path], how: Measure, reference: str) -> dict[str, _Timing]:
    """Each file's decode and prefill time over `how.reps` rounds (`same_round_times`)."""
    with ExitStack() as stack:
        subjects = {name: _open_subject(stack, path, how) for name, path in files.items()}
        decode = _rounds(subjects, how.reps, lambda subject: subject.decode)
        prefill = _rounds(subjects, how.reps, lambda subject: subject.prefill)
    d, p = same_round_times(decode, reference), same_round_times(prefill, reference)
    return {name: _Timing(d[name], p[name]) for name in files}


def _rounds(
    subjects: dict[str, _Subject], reps: int, batch: Callable[[_Subject], Callable[[], list[Segment]]]
) -> dict[str, list[float]]:
    """Each subject's time of a `batch` call in each of `reps` rotated rounds."""
    times: dict[str, list[float]] = {name: [] for name in subjects}
    for _round, name in rotated(reps, list(subjects)):
        times[name].append(subjects[name].seconds(batch(subjects[name])))
    return times


def measure_costs(model: Path, how: Measure = Measure()) -> ModelCosts:
    """Measure `model`'s costs on this machine (a whole model of at least three layers)."""
    header = open_header(model)
    facts = read_model_layers(model, header)
    n = facts.block_count
    if not (facts.first and facts.last) or n < 3:
        raise ShardError(f"{model}: measuring costs needs a whole model of at least 3 layers")
    files = {
        "first": cached_shard(model, 0, 1, header=header),
        "middle": cached_shard(model, 1, 2, header=header),
        "last": cached_shard(model, n - 1, n, header=header),
        "whole": model,
    }
    timed = _time_files(files, how, reference="whole")
    layer_bytes, head_bytes = layer_weights(header)
    decode = _solve({k: t.decode / how.decode_rows for k, t in timed.items()}, layer_bytes)
    prefill = _solve({k: t.prefill / how.prefill_rows for k, t in timed.items()}, layer_bytes)
    kv = [2 * (k + v) for k, v in zip(facts.k_widths, facts.v_widths, strict=True)]  # f16 K and V
    return ModelCosts(
        layers=tuple(RowCosts(d, p) for d, p in zip(decode["layers"], prefill["layers"], strict=True)),
        embedding=RowCosts(decode["embedding"], prefill["embedding"]),
        head=RowCosts(decode["head"], prefill["head"]),
        stage=RowCosts(decode["stage"], prefill["stage"]),
        weight_bytes=tuple(layer_bytes),
        kv_bytes_per_cell=tuple(kv),
        head_bytes=head_bytes,
    )


def _solve(t: dict[str, float], b: list[int]) -> dict[str, Any]:
    """The parts' costs from the four timings (see the module's docstring); none below zero."""
    n = len(b)
    # whole - first - last + middle = c * (sum(b) - b0 - b[n-1] + b1)
    span = sum(b) - b[0] - b[n - 1] + b[1]
    per_byte = max((t["whole"] - t["first"] - t["last"] + t["middle"]) / span, 0.0) if span > 0 else 0.0
    stage = max(t["middle"] - per_byte * b[1], 0.0)
    return {
        "layers": [per_byte * x for x in b],
        "stage": stage,
        "embedding": max(t["first"] - stage - per_byte * b[0], 0.0),
        "head": max(t["last"] - stage - per_byte * b[n - 1], 0.0),
    }


def save_costs(costs: ModelCosts, path: Path, about: dict[str, Any] | None = None) -> Path:
    """Write `costs` as JSON (atomically), with `about` (what was measured, how) beside them."""
    payload = {**asdict(costs), "about": about or {}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def load_costs(path: Path) -> ModelCosts:
    """Costs from a JSON file written by `save_costs` (or by hand, in the same form)."""
    try:
        data = json.loads(path.read_text())

        def row(x: Any) -> RowCosts:
            return RowCosts(**x) if isinstance(x, dict) else RowCosts(*x)

        return ModelCosts(
            layers=tuple(row(x) for x in data["layers"]),
            embedding=row(data["embedding"]),
            head=row(data["head"]),
            stage=row(data["stage"]),
            weight_bytes=tuple(int(x) for x in data["weight_bytes"]),
            kv_bytes_per_cell=tuple(int(x) for x in data["kv_bytes_per_cell"]),
            head_bytes=int(data.get("head_bytes", 0)),
        )
    except OSError as exc:
        raise ValueError(f"{path}: cannot read costs ({exc.strerror})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a costs file ({exc})") from None


def costs_cache_path(model: Path, how: Measure) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "neuron-tai" / "costs"
    return cache / f"{model.stem}.{model.stat().st_size}.t{how.threads}-d{how.decode_rows}-p{how.prefill_rows}.json"


def cached_costs(model: Path, how: Measure = Measure(), *, remeasure: bool = False) -> ModelCosts:
    """`model`'s costs on this machine: measured once, then read from the cache (newer than the model)."""
    path = costs_cache_path(model, how)
    if not remeasure and path.exists() and path.stat().st_mtime >= model.stat().st_mtime:
        return load_costs(path)
    start = time.perf_counter()
    costs = measure_costs(model, how)
    about = {"model": model.name, **asdict(how), "seconds": round(time.perf_counter() - start, 1)}
    save_costs(costs, path, about)
    return costs
