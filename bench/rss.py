"""The bench's processes as /proc/PID/status tells them: resident memory, and how often the
kernel took a core from their threads.

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


def status_values(status: Path, keys: tuple[str, ...]) -> dict[str, int] | None:
    """The first number of each of `keys`' lines in a /proc status file; None once it is gone."""
    try:
        text = status.read_text()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in keys:
            values[key] = int(rest.split()[0])
    return values


def read_memory(pid: int) -> Memory | None:
    """VmRSS and VmHWM of `pid` (kB); None once it has exited."""
    values = status_values(Path(f"/proc/{pid}/status"), ("VmRSS", "VmHWM"))
    if values is None or len(values) < 2:
        return None  # gone, or a zombie, which has no memory lines
    return Memory(values["VmRSS"], values["VmHWM"])


def preemptions_of(pid: int, proc: Path = Path("/proc")) -> int:
    """Involuntary context switches of another process's threads alive now (/proc/PID/task/*/status)."""
    key = "nonvoluntary_ctxt_switches"
    counts = (status_values(status, (key,)) for status in (proc / str(pid) / "task").glob("*/status"))
    return sum(found.get(key, 0) for found in counts if found is not None)  # None: the thread ended meanwhile


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
