"""A lean GGUF (v2/v3, little-endian) header reader.

The `gguf` package decodes every metadata value, which for a 262k-entry vocabulary
takes seconds. This reader decodes only scalars and numeric arrays, skips string
arrays by their lengths, and keeps each entry's raw bytes, so a shard can copy
metadata it does not change verbatim. Tensor data is located, never read.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

MAGIC = 0x46554747  # "GGUF" read as a little-endian uint32
_SCALARS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_DTYPES = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
STRING, ARRAY = 8, 9


class HeaderError(ValueError):
    """Not a GGUF file this reader understands."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One metadata key: its decoded value (None for string arrays) and its raw bytes."""

    key: str
    vtype: int
    value: Any
    raw: bytes  # the whole entry as written: key, type, value
    elem_type: int | None = None  # arrays only
    count: int = 0  # arrays only


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order (fastest-varying first)
    ggml_type: int
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True, slots=True)
class Header:
    version: int
    entries: dict[str, Entry]
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int  # where tensor data starts in the file

    def get(self, key: str, default: Any = None) -> Any:
        entry = self.entries.get(key)
        return default if entry is None else entry.value


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return bytes(raw).decode("utf-8", "replace")

    def value(self, vtype: int) -> tuple[Any, int | None, int]:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype]), None, 0
        if vtype == STRING:
            return self.string(), None, 0
        if vtype != ARRAY:
            raise HeaderError(f"unknown metadata value type {vtype}")
        elem, count = self.unpack("<I"), self.unpack("<Q")
        if elem in _DTYPES:
            size = np.dtype(_DTYPES[elem]).itemsize
            data = np.frombuffer(self.buf, _DTYPES[elem], count, self.pos).copy()
            self.pos += size * count
            return [v.item() for v in data] if count <= 4096 else data, elem, count
        if elem == STRING:
            for _ in range(count):  # skipped, not decoded: vocabularies are large
                self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
            return None, elem, count
        raise HeaderError(f"unsupported array element type {elem}")


def tensor_nbytes(dims: tuple[int, ...], ggml_type: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    n = int(np.prod(dims)) if dims else 1
    return n // block * size


def read_header(path: Path) -> Header:
    """Parse a GGUF file's metadata and tensor directory; raises HeaderError."""
    with path.open("rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # empty file
            raise HeaderError(f"{path}: not a GGUF file (empty)") from exc
    try:
        return _parse(buf, path)
    except (struct.error, IndexError, ValueError, KeyError) as exc:
        if isinstance(exc, HeaderError):
            raise
        raise HeaderError(f"{path}: not a readable GGUF file ({exc})") from exc
    finally:
        buf.close()


def _parse(buf: mmap.mmap, path: Path) -> Header:
    c = _Cursor(buf)
    if len(buf) < 24 or c.unpack("<I") != MAGIC:
        raise HeaderError(f"{path}: not a GGUF file")
    version = c.unpack("<I")
    if version not in (2, 3):
        raise HeaderError(f"{path}: GGUF version {version} is not supported (2 or 3, little-endian)")
    n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
    entries: dict[str, Entry] = {}
    for _ in range(n_kv):
        start = c.pos
        key = c.string()
        vtype = c.unpack("<I")
        value, elem, count = c.value(vtype)
        entries[key] = Entry(key, vtype, value, bytes(buf[start : c.pos]), elem, count)
    tensors = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.unpack("<I")
        dims = tuple(c.unpack("<Q") for _ in range(n_dims))
        ggml_type, offset = c.unpack("<I"), c.unpack("<Q")
        tensors.append(TensorInfo(name, dims, ggml_type, offset, tensor_nbytes(dims, ggml_type)))
    alignment = int(entries["general.alignment"].value) if "general.alignment" in entries else 32
    data_offset = -(-c.pos // alignment) * alignment
    return Header(version, entries, tensors, alignment, data_offset)


# -- writing ---------------------------------------------------------------------------------


def encode_string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def encode_entry(key: str, value: Any, vtype: int, elem_type: int | None = None) -> bytes:
    """A metadata entry's bytes: scalars, strings, and numeric or bool arrays."""
    head = encode_string(key) + struct.pack("<I", vtype)
    if vtype in _SCALARS:
        return head + struct.pack(_SCALARS[vtype], value)
    if vtype == STRING:
        return head + encode_string(value)
    assert vtype == ARRAY and elem_type in _DTYPES
    data = np.asarray(value, dtype=_DTYPES[elem_type])
    return head + struct.pack("<IQ", elem_type, len(data)) + data.tobytes()
