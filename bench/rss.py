"""Resident memory of the bench's processes, read from /proc/PID/status.

`VmRSS` is what a process holds now; `VmHWM` the most it ever held (the kernel's own peak,
so a spike between two samples is not missed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Memory:
    rss_kib: int
    hwm_kib: int


def read_memory(pid: int) -> Memory | None:
    """VmRSS and VmHWM of `pid`; None once it has exited."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0])  # kB
    if len(values) < 2:
        return None  # a zombie has no memory lines
    return Memory(values["VmRSS"], values["VmHWM"])


@dataclass(slots=True)
class MemoryTrack:
    """One process's memory over a run: samples (seconds, MiB) and the marks the report compares."""

    pid: int
    samples: list[tuple[float, float]] = field(default_factory=list)
    before_mib: float | None = None  # before the attack
    final_mib: float | None = None  # after it, once the clients have left
    peak_mib: float | None = None  # VmHWM at its last reading

    def sample(self, t: float) -> Memory | None:
        memory = read_memory(self.pid)
        if memory is not None:
            self.samples.append((round(t, 2), mib(memory.rss_kib)))
            self.peak_mib = mib(memory.hwm_kib)
        return memory


def mib(kib: int) -> float:
    return round(kib / 1024, 1)
