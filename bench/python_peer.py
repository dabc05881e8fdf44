"""What a Python user would pick: llama-cpp-python's high-level `Llama`, one request after another."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from llama_cpp import Llama

from bench.latency import Trace
from bench.workload import Request


def open_llama(model: Path, n_ctx: int, n_threads: int) -> Llama:
    # Flash attention on, as the node resolves `auto` on this CPU: the same attention kernel.
    return Llama(str(model), n_ctx=n_ctx, n_batch=512, n_threads=n_threads, flash_attn=True, verbose=False)


def run_serial(llm: Llama, requests: Sequence[Request]) -> tuple[list[Trace], float]:
    """Greedy generation of `max_new` tokens per request; every request starts from an empty cache."""
    traces = []
    start = time.perf_counter()
    for req in requests:
        trace = Trace(req.rid)
        llm.reset()  # type: ignore[no-untyped-call] # no prefix reuse between requests: every system prefills every prompt
        for token in llm.generate(list(req.prompt), top_k=1, temp=0.0, reset=True):
            trace.add(token)
            if len(trace.tokens) == req.max_new:
                break
        traces.append(trace)
    return traces, time.perf_counter() - start
