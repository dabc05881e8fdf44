"""One long-lived thread for all llama.cpp compute.

libggml-cpu runs its graph with OpenMP, and an OpenMP thread team belongs to the
thread that calls in. Trio's worker-thread cache may use a different thread for
each call, leaving several teams spin-waiting on the same cores: measured here,
a decode took 20 ms from the main thread and 23-35 ms from rotating worker
threads. A single dedicated thread keeps a single team.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")


class ComputeThread:
    """Runs submitted functions one at a time, in order, on one thread."""

    def __init__(self, name: str = "llama-compute") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the compute thread. Not abandoned on cancellation: a call
        into llama.cpp cannot be interrupted, so the caller waits for it (as
        `trio.to_thread.run_sync` does by default)."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        result: list[outcome.Outcome[T]] = []

        def job() -> None:
            result.append(outcome.capture(fn, *args))
            token.run_sync_soon(done.set)

        self._jobs.put(job)
        with trio.CancelScope(shield=True):
            await done.wait()
        return result[0].unwrap()

    def close(self) -> None:
        """Stop after queued jobs; safe to call twice."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
