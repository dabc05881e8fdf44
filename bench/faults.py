"""Crashes on purpose, to test that the bench survives a process that dies: `NEURON_TAI_BENCH_CRASH`.

A comma-separated list of `PROCESS@start` (the process's command is replaced by one that
segfaults while "loading") and `PROCESS@c=N` (the bench sends it SIGSEGV as the sweep
reaches concurrency N). PROCESS is a name from the bench's process list (`single`,
`chain2-tail`, `llama-server`, ...). Unset, it changes nothing.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field

ENV = "NEURON_TAI_BENCH_CRASH"
SIGNAL = signal.SIGSEGV
_SEGFAULT = f"import os, signal; print('loading the model ...', flush=True); os.kill(os.getpid(), signal.{SIGNAL.name})"


@dataclass(frozen=True, slots=True)
class Faults:
    at_start: frozenset[str] = frozenset()
    at_concurrency: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> Faults:
        at_start: set[str] = set()
        at_concurrency: dict[str, int] = {}
        for item in filter(None, (s.strip() for s in os.environ.get(ENV, "").split(","))):
            name, _, when = item.partition("@")
            if when == "start":
                at_start.add(name)
            elif when.startswith("c=") and when[2:].isdigit():
                at_concurrency[name] = int(when[2:])
            else:
                raise SystemExit(f"{ENV}: {item!r} is neither PROCESS@start nor PROCESS@c=N")
        return cls(frozenset(at_start), at_concurrency)

    def command(self, name: str, cmd: list[str]) -> list[str]:
        return [sys.executable, "-c", _SEGFAULT] if name in self.at_start else cmd

    def due(self, concurrency: int) -> list[str]:
        return [name for name, c in self.at_concurrency.items() if c == concurrency]
