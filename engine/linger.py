"""Linger: how long the loop waits for answered sessions' next steps, so they share a call.

Pure policy (no Trio, no llama.cpp); the engine task applies it between iterations.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from engine.scheduler import Session, SessionKey


def linger_limit_s(linger_ms: float, step_ms: float, micro_batches: int) -> float:
    """How long to wait for sessions expected back: at most 10% of a step (`linger_ms` caps it),
    except on a chain's head (more than one micro-batch), whose groups come back from the next
    stage together: there a group is worth up to a step of waiting, since running part of it
    costs a call of its own and leaves the rest out of phase for good. 0: never."""
    if linger_ms <= 0:
        return 0.0
    if micro_batches > 1:
        return step_ms / 1000
    return min(linger_ms, 0.1 * step_ms) / 1000


def lingering(sessions: Mapping[SessionKey, Session[Any]], coming_back: Collection[SessionKey]) -> bool:
    """Whether every group with work still expects some of its members back."""
    expected = {sessions[key].group for key in coming_back if key in sessions}
    ready = {s.group for s in sessions.values() if s.step is not None}
    return bool(expected) and ready <= expected
