"""The ceiling: the bare llama_decode loop serving the workload in lockstep waves.

Each wave takes the next `concurrency` requests, prefills all their prompts together
(chunks of n_batch rows), then runs one decode row per sequence per llama_decode call.
No scheduling, no transport, no per-session bookkeeping: what llama.cpp alone does.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import llama_cpp as lc
import numpy as np

from bench.common import BareLoop
from bench.latency import Trace
from bench.node_driver import LogitsSink
from bench.workload import Request


def run_waves(bare: BareLoop, requests: Sequence[Request], concurrency: int) -> tuple[list[Trace], float]:
    traces: list[Trace] = []
    start = time.perf_counter()
    for first in range(0, len(requests), concurrency):
        traces += _wave(bare, requests[first : first + concurrency])
    return traces, time.perf_counter() - start


def forced_logits(
    bare: BareLoop, wave: Sequence[Request], forced: Mapping[int, Sequence[int]], on_logits: LogitsSink
) -> None:
    """One wave fed `forced` tokens (teacher forcing); every output row's logits go to `on_logits`."""
    _wave(bare, wave, forced=forced, on_logits=on_logits)


def _wave(
    bare: BareLoop,
    wave: Sequence[Request],
    *,
    forced: Mapping[int, Sequence[int]] | None = None,
    on_logits: LogitsSink | None = None,
) -> list[Trace]:
    lc.llama_memory_clear(lc.llama_get_memory(bare.ctx), True)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(bare.model.ptr))
    traces = [Trace(r.rid) for r in wave]

    def take(s: int, row: int) -> None:
        if on_logits is not None:
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(bare.ctx, row), shape=(n_vocab,)).copy()
            on_logits(wave[s].rid, len(traces[s].tokens), logits)
        traces[s].add(lc.llama_sampler_sample(bare.sampler, bare.ctx, row))

    def feed(s: int) -> int:
        return forced[wave[s].rid][len(traces[s].tokens) - 1] if forced is not None else traces[s].tokens[-1]

    rows = [(s, p, t, p == len(r.prompt) - 1) for s, r in enumerate(wave) for p, t in enumerate(r.prompt)]
    for first in range(0, len(rows), bare.n_batch):
        chunk = rows[first : first + bare.n_batch]
        bare.fill(chunk)
        bare.decode(prefill=True)
        for i, (s, _p, _t, out) in enumerate(chunk):
            if out:
                take(s, i)
    pos = [len(r.prompt) for r in wave]
    for _ in range(max(r.max_new for r in wave) - 1):
        live = [s for s, r in enumerate(wave) if len(traces[s].tokens) < r.max_new]
        bare.fill([(s, pos[s], feed(s), True) for s in live])
        bare.decode(prefill=False)
        for i, s in enumerate(live):
            take(s, i)
            pos[s] += 1
    return traces
