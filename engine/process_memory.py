"""What this process holds in memory, as the kernel counts it (Linux `/proc/self/status`).

A stage's budgets say what llama.cpp reserved; pages never touched are not resident, and
pages of the mapped model file are resident once read. `VmRSS` is what the process holds
now, `VmHWM` the most it ever held, `RssAnon` its private memory (KV, buffers it wrote,
the interpreter) and `RssFile` the mapped files (the weights llama.cpp read, libraries).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

STATUS = Path("/proc/self/status")
_FIELDS = {"VmRSS": "rss", "VmHWM": "peak", "RssAnon": "anon", "RssFile": "file"}


@dataclass(frozen=True, slots=True)
class ResidentMemory:
    """Bytes; all zero where the kernel does not report them."""

    rss: int = 0
    peak: int = 0
    anon: int = 0
    file: int = 0


def resident_memory(status: Path = STATUS) -> ResidentMemory:
    """This process's resident memory now, and its peak."""
    try:
        text = status.read_text()
    except OSError:
        return ResidentMemory()
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        name = _FIELDS.get(key)
        if name is not None and rest.split():
            values[name] = int(rest.split()[0]) * 1024  # the kernel reports kB
    return ResidentMemory(**values)


_MADV_DONTNEED = 4


def release_mapped_file(path: Path, maps: Path = Path("/proc/self/maps")) -> int:
    """Drop this process's resident pages of `path`'s mappings; returns the bytes of the ranges.

    llama.cpp maps a model file read-only and shared, and reads all of it while loading (weights
    it repacks are copied out and never read again). Pages a stage uses come back from the page
    cache on the next touch, so afterwards the process holds only the weights it computes with:
    not the repacked originals, nor an output head a non-last stage never runs. Nothing is
    lost: a shared read-only mapping has no private changes."""
    target = str(path.resolve())
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return 0
    released = 0
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[5] != target or "w" in fields[1]:  # only read-only mappings of the file
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED) == 0:
            released += end - start
    return released


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the system; False where the C library cannot (not glibc).

    Loading a model and creating its context allocate and free megabytes of temporaries (the
    file's metadata, the vocabulary's construction, the graph reservations). glibc keeps freed
    blocks for the next allocation, and a stage's next allocations may not reuse them: 11 MiB
    of a 1B-shape last stage stayed free after prefill calls in fresh sequences, where one
    prefill and decodes in the same sequences reused it (evidence/tail-memory/).
    `malloc_trim` only returns free pages; it changes no allocation policy of the process."""
    trim = getattr(_libc, "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
