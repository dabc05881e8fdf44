"""Seeing what the node does while its batch loop is busy: hold it inside llama_decode, and
wait (polling) for what other tasks should have done meanwhile."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

from engine.engine import Engine


@contextmanager
def held_decodes(engine: Engine) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Every llama_decode waits for `release` (after setting `entered`): the loop stays mid-step
    and takes nothing from its inbox meanwhile. Released (and restored) on the way out."""
    entered, release = threading.Event(), threading.Event()
    original = engine.backend.decode

    def held(segments: Any) -> Any:  # runs on the compute thread
        entered.set()
        release.wait(60)
        return original(segments)

    engine.backend.decode = held  # type: ignore[method-assign]
    try:
        yield entered, release
    finally:
        release.set()
        engine.backend.decode = original  # type: ignore[method-assign]


async def wait_until(condition: Callable[[], object]) -> None:
    """Poll `condition` every 5 ms for up to 10 s."""
    for _ in range(2000):
        if condition():
            return
        await trio.sleep(0.005)
    raise AssertionError("condition never held")
