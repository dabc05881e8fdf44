"""Taking requests from the engine's inbox for a while, before the next call (linger, settle)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")


async def take_while(
    inbox: trio.MemoryReceiveChannel[T],
    take: Callable[[T], None],
    waiting: Callable[[], bool],
    limit_s: float,
    gap_s: Callable[[], float],
) -> None:
    """Take requests while `waiting()`, for at most `limit_s`, and while each next one comes
    within `gap_s()` (asked again before each)."""
    with trio.move_on_after(limit_s):
        while waiting():
            got: list[T] = []
            with trio.move_on_after(gap_s()):
                got.append(await inbox.receive())
            if not got:
                return
            take(got[0])
