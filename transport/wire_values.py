"""Reading one value of a parsed header: present, of its type, in its range; `Fault` otherwise."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from protocol.errors import ErrorCode, Fault
from transport.wire_header import is_int


def read_int(
    h: dict[str, Any],
    key: str,
    rid: int | None,
    *,
    lo: int | None = None,
    default: Any = ...,
    code: ErrorCode = ErrorCode.BAD_REQUEST,
) -> int:
    if key not in h:
        if default is ...:
            raise Fault(code, f"missing key {key!r}", rid=rid)
        return int(default)
    v = h[key]
    if not is_int(v):
        raise Fault(code, f"{key!r} must be an integer", rid=rid)
    if lo is not None and v < lo:
        raise Fault(code, f"{key!r} must be >= {lo}", rid=rid)
    return int(v)


def read_str(
    h: dict[str, Any],
    key: str,
    rid: int | None,
    choices: tuple[str, ...] = (),
    default: Any = ...,
    code: ErrorCode = ErrorCode.BAD_REQUEST,
) -> str:
    if key not in h:
        if default is ...:
            raise Fault(code, f"missing key {key!r}", rid=rid)
        return str(default)
    v = h[key]
    if not isinstance(v, str):
        raise Fault(code, f"{key!r} must be a string", rid=rid)
    if choices and v not in choices:
        raise Fault(code, f"{key!r} must be one of {', '.join(choices)}", rid=rid)
    return v


def read_bool(
    h: dict[str, Any], key: str, rid: int | None, default: bool, code: ErrorCode = ErrorCode.BAD_REQUEST
) -> bool:
    v = h.get(key, default)
    if not isinstance(v, bool):
        raise Fault(code, f"{key!r} must be a boolean", rid=rid)
    return v


def one_frame(payload: list[bytes], rid: int | None, code: ErrorCode = ErrorCode.BAD_REQUEST) -> bytes:
    if len(payload) != 1:
        raise Fault(code, f"expected exactly one payload frame, got {len(payload)}", rid=rid)
    return payload[0]


def int32_frame(
    frame: bytes, n: int | None, rid: int | None, code: ErrorCode = ErrorCode.BAD_REQUEST
) -> npt.NDArray[np.int32]:
    """`int32[n]` (any length when `n` is None) from a little-endian payload frame."""
    if len(frame) % 4 or (n is not None and len(frame) != 4 * n):
        want = "a multiple of 4" if n is None else f"{4 * n} (int32[{n}])"
        raise Fault(code, f"payload is {len(frame)} bytes, expected {want}", rid=rid)
    return np.frombuffer(frame, dtype="<i4").astype(np.int32)


def int32_bytes(values: Any) -> bytes:
    """A little-endian `int32[n]` payload frame."""
    return np.asarray(values, dtype="<i4").tobytes()
