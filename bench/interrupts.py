"""Ctrl-C and SIGTERM stop the bench cleanly, however it was started.

Outside Trio they raise KeyboardInterrupt, which unwinds through `open_processes`. Inside
`trio.run` they cancel the run instead: a KeyboardInterrupt raised wherever the main
thread happens to be can land in a ctypes callback (which swallows it) or in the task
that owns a socket other tasks are waiting on. Cancellation lets every task clean up.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import NoReturn, TypeVar

import trio

T = TypeVar("T")


def _terminate_as_interrupt(_signum: int, _frame: FrameType | None) -> None:
    signal.raise_signal(signal.SIGINT)


def interrupt_on_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt, even if the shell started us with SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminate_as_interrupt)


async def run_until_interrupted(fn: Callable[[], Awaitable[T]]) -> T:
    """Await `fn()`; on SIGINT or SIGTERM cancel it, let it clean up, then raise KeyboardInterrupt."""
    result: list[T] = []
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def body() -> None:
                result.append(await fn())
                nursery.cancel_scope.cancel()

            nursery.start_soon(body)
            async for signum in signals:
                print(f"{signal.Signals(signum).name}: cancelling the run ...", file=sys.stderr, flush=True)
                nursery.cancel_scope.cancel()
                break
    if not result:
        raise KeyboardInterrupt
    return result[0]


def run_main(main: Callable[[], int], stopped: str) -> NoReturn:
    """Exit with `main()`'s status; on Ctrl-C or SIGTERM (once everything it started is
    stopped, as `main` guarantees) say what was stopped and exit 130."""
    interrupt_on_signals()
    status = 1
    try:
        status = main()
    except* KeyboardInterrupt:
        print(f"interrupted: {stopped}", file=sys.stderr)
        status = 130
    sys.exit(status)
