"""What a header may cost, and the one place a header frame is parsed (PROTOCOL.md, Framing).

A header is bounded before and while it is parsed (`HeaderLimits`): its size, the length of
every string, array and map, how many arrays and maps it holds and how deeply they nest.
Every refusal is a `Fault`; error messages show at most a short prefix of what a peer sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

import msgpack
import numpy as np

from protocol.errors import ErrorCode, Fault

VERSION = 1
MAX_RID = 2**63
DTYPES: dict[str, type[np.floating[Any]]] = {"f32": np.float32, "f16": np.float16}


@dataclass(frozen=True, slots=True)
class HeaderLimits:
    """What one header may cost to parse; beyond any limit it is refused unparsed or mid-parse."""

    max_header_bytes: int
    max_str_bytes: int
    max_container_len: int  # entries of one array or map
    max_containers: int  # arrays and maps in one header
    max_depth: int  # nesting of arrays and maps (the header map itself is depth 1)
    max_bin_bytes: int = 2**10
    max_text_bytes: int = 0  # UTF-8 bytes of a tokenize's text


# A tokenize's text is the only large value a request header carries: the header may
# hold that much text plus 64 KiB of everything else.
MAX_TEXT_BYTES = 2**20
MAX_TEXT_TOKENS = 2**18
REQUEST_HEADER_EXTRA = 2**16


def request_limits(max_text_bytes: int = MAX_TEXT_BYTES) -> HeaderLimits:
    size = max_text_bytes + REQUEST_HEADER_EXTRA
    return HeaderLimits(size, size, 64, 64, 4, max_text_bytes=max_text_bytes)


# Replies: `stats` maps and a detokenized text are larger, but they too are bounded.
REPLY_LIMITS = HeaderLimits(64 * 2**20, 64 * 2**20, 4096, 4096, 8)
# What a next stage answers a node (opened, result, closed, error) is small: request-sized.
NEXT_STAGE_REPLY_LIMITS = HeaderLimits(REQUEST_HEADER_EXTRA, REQUEST_HEADER_EXTRA, 64, 64, 4)


def show(value: Any, width: int = 40) -> str:
    """A value a peer sent, for an error message: a short prefix of scalars, only the type of the rest."""
    if value is None or isinstance(value, bool | int | float):
        text = repr(value)
    elif isinstance(value, str | bytes):
        text = repr(value[:width])
    else:
        return type(value).__name__
    return text if len(text) <= width else text[:width] + "..."


def is_int(value: Any) -> TypeGuard[int]:
    """A msgpack integer (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


class _TooComplex(Exception):
    pass


def _depth_within(value: Any, max_depth: int) -> bool:
    """Whether arrays and maps nest at most `max_depth` deep (iterative: any depth is safe)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > max_depth:
            return False
        stack.extend((c, depth + 1) for c in children)
    return True


def parse_header(frame: bytes, limits: HeaderLimits, rid: int | None = None) -> dict[str, Any]:
    """The header map, parsed within `limits`; Fault (`too_large`, `bad_request`) otherwise."""
    if len(frame) > limits.max_header_bytes:
        raise Fault(
            ErrorCode.TOO_LARGE, f"header is {len(frame)} bytes, the limit is {limits.max_header_bytes}", rid=rid
        )
    containers = 0

    def count(container: Any) -> Any:  # called by msgpack once per array and map it builds
        nonlocal containers
        containers += 1
        if containers > limits.max_containers:
            raise _TooComplex
        return container

    try:
        header = msgpack.unpackb(
            frame, raw=False, strict_map_key=True, list_hook=count, object_hook=count,
            max_str_len=limits.max_str_bytes, max_bin_len=limits.max_bin_bytes, max_ext_len=0,
            max_array_len=limits.max_container_len, max_map_len=limits.max_container_len,
        )  # fmt: skip
    except _TooComplex:
        raise Fault(
            ErrorCode.BAD_REQUEST, f"header holds more than {limits.max_containers} arrays and maps", rid=rid
        ) from None
    except Exception as exc:  # msgpack raises many types for bad or over-limit bytes
        raise Fault(
            ErrorCode.BAD_REQUEST, f"header is not msgpack within limits: {type(exc).__name__}", rid=rid
        ) from None
    if not isinstance(header, dict) or not all(isinstance(k, str) for k in header):
        raise Fault(ErrorCode.BAD_REQUEST, "header must be a msgpack map with string keys", rid=rid)
    if not _depth_within(header, limits.max_depth):
        raise Fault(ErrorCode.BAD_REQUEST, f"header nests deeper than {limits.max_depth} levels", rid=rid)
    return header


def pack_header(header: dict[str, Any]) -> bytes:
    """The header frame of a message this side sends: `v` first, then `header`."""
    return bytes(msgpack.packb({"v": VERSION, **header}, use_bin_type=True))
