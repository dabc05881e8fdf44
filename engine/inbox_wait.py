"""Taking requests from the engine's inbox for a while, before the next call (linger, settle)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")


async def take_while(
    inbox: trio.MemoryReceiveChannel[T],
    take: Callable[[T], None],
    gap_s: Callable[[], float | None],
    limit_s: float,
) -> None:
    """Take requests for at most `limit_s`, while each next one comes within `gap_s()` (asked
    again before each; None: stop waiting)."""
    with trio.move_on_after(limit_s):
        while (gap := gap_s()) is not None:
            got: list[T] = []
            with trio.move_on_after(gap):
                got.append(await inbox.receive())
            if not got:
                return
            take(got[0])
