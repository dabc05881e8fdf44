"""What this process holds in memory, as the kernel counts it (Linux `/proc/self/status`).

A stage's budgets say what llama.cpp reserved; pages never touched are not resident, and
pages of the mapped model file are resident once read. `VmRSS` is what the process holds
now, `VmHWM` the most it ever held, `RssAnon` its private memory (KV, buffers it wrote,
the interpreter) and `RssFile` the mapped files (the weights llama.cpp read, libraries).
"""

from __future__ import annotations

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
