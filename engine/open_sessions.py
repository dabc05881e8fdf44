"""Read-only questions other tasks ask about a stage's open sessions.

The scheduler owns the sessions; the node's tasks (steps, `generate` runs, recovery, the
session gate) only ask whether a session is open and how far it has come, between the
engine loop's iterations, on the same thread.
"""

from __future__ import annotations

from typing import Any

from engine.sessions import EngineScheduler


class OpenSessions:
    """Answers about one engine's open sessions, keyed by (owner, session id)."""

    def __init__(self, scheduler: EngineScheduler) -> None:
        self._scheduler = scheduler

    def max_tokens_of(self, owner: Any, session: str) -> int | None:
        """An open session's `max_tokens`; None when there is no such session."""
        found = self._scheduler.sessions.get((owner, session))
        return None if found is None else found.max_tokens

    def opening_of(self, owner: Any, session: str) -> int | None:
        """Which admission an open session is (a session opened again under its name has
        another); None when there is no such session."""
        found = self._scheduler.sessions.get((owner, session))
        return None if found is None else found.opening

    def length_of(self, owner: Any, session: str) -> int | None:
        """An open session's length (positions its KV holds); None when there is no such session."""
        found = self._scheduler.sessions.get((owner, session))
        return None if found is None else found.length

    def count_of(self, owner: Any) -> int:
        """How many open sessions `owner` holds."""
        return sum(1 for key in self._scheduler.sessions if key[0] == owner)
