"""The ceiling inside the bench's process: a plain Python loop over llama_decode, llama.cpp's own batch and sampler.

`run_waves` serves the workload in lockstep waves: each takes the next `concurrency` requests,
prefills all their prompts together (chunks of n_batch rows), then runs one decode row per
sequence per llama_decode call. No scheduling, no transport, no per-session bookkeeping:
what llama.cpp alone does.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import llama_cpp as lc
import numpy as np

from bench.latency import Trace
from bench.node_driver import LogitsSink
from bench.workload import Request
from engine.backend import ContextConfig, context_params
from engine.llama_handles import LlamaModel, ensure_backend


class BareLoop:
    """The ceiling: a plain Python loop over llama_decode with llama.cpp's own batch and samplers."""

    def __init__(self, model: Path, config: ContextConfig) -> None:
        ensure_backend()
        self.model = LlamaModel(model, config.kernels)
        self.ctx = lc.llama_init_from_model(self.model.ptr, context_params(config))
        self.n_batch = config.n_batch
        self.batch = lc.llama_batch_init(config.n_batch, 0, 1)
        self.sampler = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        lc.llama_sampler_chain_add(self.sampler, lc.llama_sampler_init_greedy())
        # What `decode` did, counted as a node's engine counts it (`stats`).
        self.counters: dict[str, float] = dict.fromkeys(
            ("batches", "decode_batches", "decode_rows", "prefill_tokens", "llama_decode_s"), 0
        )

    def decode(self, *, prefill: bool) -> None:
        """llama_decode of the filled batch, counted and timed."""
        n = self.batch.n_tokens
        start = time.perf_counter()
        rc = lc.llama_decode(self.ctx, self.batch)
        self.counters["llama_decode_s"] += time.perf_counter() - start
        assert rc == 0, f"llama_decode returned {rc}"
        self.counters["batches"] += 1
        self.counters["prefill_tokens" if prefill else "decode_rows"] += n
        self.counters["decode_batches"] += 0 if prefill else 1

    def fill(self, rows: Sequence[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        b.n_tokens = len(rows)
        for i, (seq, pos, tok, out) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq

    def decode_rate(
        self, prompts: Sequence[Sequence[int]], steps: int, *, time_prefill: bool = False
    ) -> tuple[float, list[list[int]]]:
        """Prefill all prompts in one batch, then `steps` greedy decode steps of all sequences.

        Returns tokens per second (decode steps only, or with `time_prefill` every generated
        token over the whole run) and the tokens.
        """
        mem = lc.llama_get_memory(self.ctx)
        lc.llama_memory_clear(mem, True)
        run_start = time.perf_counter()
        rows = [(s, p, t, p == len(pr) - 1) for s, pr in enumerate(prompts) for p, t in enumerate(pr)]
        self.fill(rows)
        assert lc.llama_decode(self.ctx, self.batch) == 0
        out_rows = [i for i, r in enumerate(rows) if r[3]]
        last = [lc.llama_sampler_sample(self.sampler, self.ctx, i) for i in out_rows]
        pos = [len(p) for p in prompts]
        tokens = [[t] for t in last]
        start = time.perf_counter()
        for _ in range(steps):
            self.fill([(s, pos[s], last[s], True) for s in range(len(prompts))])
            assert lc.llama_decode(self.ctx, self.batch) == 0
            last = [lc.llama_sampler_sample(self.sampler, self.ctx, i) for i in range(len(prompts))]
            for s in range(len(prompts)):
                pos[s] += 1
                tokens[s].append(last[s])
        end = time.perf_counter()
        if time_prefill:
            return len(prompts) * (steps + 1) / (end - run_start), tokens
        return len(prompts) * steps / (end - start), tokens

    def close(self) -> None:
        lc.llama_sampler_free(self.sampler)
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        self.model.close()


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
