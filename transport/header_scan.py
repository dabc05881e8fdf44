"""Find a request's `rid` in a header that is refused unread (PROTOCOL.md, Framing).

A header too large or too complex to parse is still answered with its `rid`, so the
requester is not left waiting for its timeout. The scan reads the top-level map's string
keys and steps over every value (and every key of another kind, which no parser takes) by
its msgpack length prefix, never building one: a megabyte string costs one step. Nested
arrays and maps are stepped over item by item, at most `max_items` items in all, so the
work is bounded whatever the bytes. It never raises and
never reads past the frame; a frame that is not a map, or breaks off, yields what was found
before the break (or None).
"""

from __future__ import annotations

from typing import NamedTuple

MAX_RID = 2**63
MAX_SCAN_ITEMS = 4096

# Item kinds: what the scanner needs to know of a msgpack value.
INT, STR, OPAQUE, ARRAY, MAP = range(5)


class Item(NamedTuple):
    kind: int
    number: int  # INT: the value; ARRAY: items; MAP: keys and values; STR: length
    start: int  # where the item's data starts (after its type byte and prefix)
    end: int  # where the next item starts (ARRAY, MAP: where their first item starts)


def _uint(buf: bytes, at: int, size: int) -> int | None:
    return int.from_bytes(buf[at : at + size], "big") if at + size <= len(buf) else None


def _sint(buf: bytes, at: int, size: int) -> int | None:
    return int.from_bytes(buf[at : at + size], "big", signed=True) if at + size <= len(buf) else None


# Type byte -> (kind, size of the prefix that follows it, what that prefix is).
_SIZED = {
    0xD9: (STR, 1),
    0xDA: (STR, 2),
    0xDB: (STR, 4),
    0xC4: (OPAQUE, 1),
    0xC5: (OPAQUE, 2),
    0xC6: (OPAQUE, 4),
    0xDC: (ARRAY, 2),
    0xDD: (ARRAY, 4),
    0xDE: (MAP, 2),
    0xDF: (MAP, 4),
}
_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
_EXT = {0xC7: 1, 0xC8: 2, 0xC9: 4}  # length prefix, then a type byte, then the data
_UINTS = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
_SINTS = {0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}


def read_item(buf: bytes, at: int) -> Item | None:
    """The msgpack item whose type byte is at `at`; None if it is malformed or runs past the end."""
    if at >= len(buf):
        return None
    tag, body = buf[at], at + 1
    item: Item | None
    if tag <= 0x7F or tag >= 0xE0:
        item = Item(INT, tag if tag <= 0x7F else tag - 0x100, body, body)
    elif tag <= 0x8F:
        item = Item(MAP, 2 * (tag & 0x0F), body, body)
    elif tag <= 0x9F:
        item = Item(ARRAY, tag & 0x0F, body, body)
    elif tag <= 0xBF:
        item = Item(STR, tag & 0x1F, body, body + (tag & 0x1F))
    else:
        item = _read_prefixed(buf, tag, body)
    return item if item is not None and item.end <= len(buf) else None


def _read_prefixed(buf: bytes, tag: int, body: int) -> Item | None:
    if tag in _SIZED:
        kind, size = _SIZED[tag]
        length = _uint(buf, body, size)
        if length is None:
            return None
        start = body + size
        if kind in (ARRAY, MAP):
            return Item(kind, length * (2 if kind == MAP else 1), start, start)
        return Item(kind, length, start, start + length)
    if tag in _FIXED:
        return Item(OPAQUE, 0, body, body + _FIXED[tag])
    if tag in _EXT:
        ext_length = _uint(buf, body, _EXT[tag])
        return None if ext_length is None else Item(OPAQUE, 0, body, body + _EXT[tag] + 1 + ext_length)
    int_size = _UINTS.get(tag) or _SINTS.get(tag)
    if int_size is None:  # 0xC1: never used
        return None
    value = _uint(buf, body, int_size) if tag in _UINTS else _sint(buf, body, int_size)
    return None if value is None else Item(INT, value, body, body + int_size)


def skip_value(buf: bytes, at: int, budget: int) -> tuple[int, int] | None:
    """Where the value at `at` ends, and the budget of items left; None when it is malformed,
    runs past the end, or needs more than `budget` items."""
    pending = 1
    while pending:
        item = read_item(buf, at)
        budget -= 1
        if item is None or budget < 0:
            return None
        pending += item.number - 1 if item.kind in (ARRAY, MAP) else -1
        at = item.end
    return at, budget


def scan_rid(frame: bytes, max_items: int = MAX_SCAN_ITEMS) -> int | None:
    """The `rid` of the top-level map in `frame` when one is found (the last, like a parser's
    dict) and is a valid request id; None otherwise."""
    top = read_item(frame, 0)
    if top is None or top.kind != MAP:
        return None
    rid: int | None = None
    at, budget = top.end, max_items
    for _ in range(top.number // 2):
        key = read_item(frame, at)
        if key is None:
            return rid
        if key.kind == STR:
            at = key.end
        else:  # a key no parser takes: stepped over like a value, and the scan goes on
            skipped = skip_value(frame, at, budget)
            if skipped is None:
                return rid
            at, budget = skipped
        if key.kind == STR and frame[key.start : key.end] == b"rid":
            value = read_item(frame, at)
            rid = value.number if value is not None and value.kind == INT and 0 <= value.number < MAX_RID else None
        skipped = skip_value(frame, at, budget)
        if skipped is None:
            return rid
        at, budget = skipped
    return rid
