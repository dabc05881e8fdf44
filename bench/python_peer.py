"""What a Python user would pick: llama-cpp-python's high-level `Llama`, one request after another."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import llama_cpp.llama_cpp as lc_api
from llama_cpp import Llama

from bench.latency import Trace
from bench.workload import Request
from engine.kernels import REPACK_BUFFER, KernelPath, Placement, path_of_buffers
from engine.llama_handles import (
    _BuftOverride,
    capture_llama_log,
    ensure_backend,
    extra_buffer_types,
    logged_buffers,
    weight_placement,
)


@dataclass(slots=True)
class PythonPeer:
    """The loaded `Llama` and where llama.cpp put its weights (read from its load log)."""

    llm: Llama
    kernel_path: KernelPath
    weight_buffers: dict[str, int]
    overrides: object  # the buffer-type override table: llama.cpp may read it for the model's lifetime

    def close(self) -> None:
        self.llm.close()


@contextmanager
def _placed_default_params(placement: Placement) -> Iterator[Any]:
    """`llama_model_default_params()` with the node's weight placement, while a `Llama` is constructed.

    `Llama` exposes neither `use_extra_bufts` nor tensor buffer-type overrides; it starts from
    the library's default parameters (llama.py: `llama_cpp.llama_model_default_params()`),
    so those are patched for the duration of the constructor: the peer must run the same
    kernels as the node (never AMX unless asked), or the comparison is not like for like.
    Yields the override table, which must outlive the model.
    """
    default = lc_api.llama_model_default_params
    table = None
    if placement.repack_patterns:
        repack = extra_buffer_types()[REPACK_BUFFER]
        rows = [_BuftOverride(p.encode(), repack) for p in placement.repack_patterns]
        table = (_BuftOverride * (len(rows) + 1))(*rows)  # ends with a zeroed row

    def placed() -> Any:
        params = default()
        params.use_extra_bufts = placement.use_extra_bufts
        if table is not None:
            params.tensor_buft_overrides = ctypes.cast(table, ctypes.c_void_p)
        return params

    with mock.patch.object(lc_api, "llama_model_default_params", placed):
        yield table


def open_llama(model: Path, n_ctx: int, n_threads: int) -> PythonPeer:
    """`Llama` on the node's kernel path ("auto"); the path it really got is read back from llama.cpp's log."""
    ensure_backend()  # llama.cpp's log goes to engine's sink, where the buffer sizes are read
    placement = weight_placement(model, "auto")
    with _placed_default_params(placement) as table, capture_llama_log() as lines:
        # Flash attention on, as the node resolves `auto` on this CPU: the same attention kernel.
        llm = Llama(str(model), n_ctx=n_ctx, n_batch=512, n_threads=n_threads, flash_attn=True, verbose=False)
    buffers = logged_buffers(lines)
    path = path_of_buffers(buffers)
    if path is KernelPath.AMX:
        llm.close()
        raise RuntimeError(
            f"Llama peer: llama.cpp put weights in the AMX buffer ({buffers}) although auto was asked for"
        )
    return PythonPeer(llm, path, buffers, table)


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
