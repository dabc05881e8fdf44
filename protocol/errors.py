"""PROTOCOL.md's error codes: the one vocabulary for every refusal, from scheduler to wire.

This lives in a package of its own because both sides of the dependency rule need it:
`engine` (scheduler, backend, engine) decides most refusals and `transport` (wire)
decides the rest, yet `engine` never imports `transport` and `transport` never imports
`engine`. A leaf package that imports nothing but the standard library keeps that rule
without a second copy of the codes to drift apart.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """An `error` reply's `code`; a StrEnum, so it encodes as the plain string."""

    BAD_REQUEST = "bad_request"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_SESSION = "unknown_session"
    SESSION_EXISTS = "session_exists"
    POSITION = "position"
    TOO_LARGE = "too_large"
    WRONG_STAGE = "wrong_stage"
    BUSY = "busy"
    KV_BUDGET = "kv_budget"
    SESSION_LIMIT = "session_limit"
    DOWNSTREAM = "downstream"
    INTERNAL = "internal"
    SHUTTING_DOWN = "shutting_down"

    @property
    def retryable(self) -> bool:
        """Codes whose reply carries `retry_after_ms`."""
        return self in _RETRYABLE

    @classmethod
    def parse(cls, value: object) -> ErrorCode:
        """The code a peer sent; one this node does not know is `downstream` (the peer failed)."""
        try:
            return cls(str(value))
        except ValueError:
            return cls.DOWNSTREAM


_RETRYABLE = frozenset({ErrorCode.BUSY, ErrorCode.KV_BUDGET, ErrorCode.SESSION_LIMIT})


class Fault(Exception):
    """The one error carrier, from the scheduler to the wire: raised where a request cannot
    go on, or returned as a value where a caller expects an outcome. It becomes an `error`
    reply at the edge. `rid` is set only where the wire decided it (the request id it read);
    `retry_after_ms` only for retryable codes."""

    __slots__ = ("code", "message", "retry_after_ms", "rid", "session")

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        retry_after_ms: int | None = None,
        *,
        rid: int | None = None,
        session: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms if code.retryable else None
        self.rid = rid
        self.session = session  # where the wire read it, for a `generate`: all its replies carry it

    def __repr__(self) -> str:
        return f"Fault({self.code!s}, {self.message!r}, retry_after_ms={self.retry_after_ms})"
