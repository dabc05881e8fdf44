"""The failover part's faults: one replica at a time is killed, hung or cut off, then brought back.

Each fault is one of `KINDS`, on the replicas in turn (middle 0, tail 0, middle 1, tail 1):
- `kill`: SIGKILL, down for `down_s`, then the same command started again (a new incarnation,
  named `NAME.2`, `NAME.3`, ...) and waited for until ready;
- `stop`: SIGSTOP for `stopped_s` (a hung machine: its sockets stay open), then SIGCONT;
- `cut`: its namespace's only link taken down for `cut_s`, then up again.
After each, the injector waits until every stage in front of the replica (the head for a
middle replica, both middle replicas for a tail) reports it `up` again, so the next fault,
which may hit the other replica of the same range, never leaves a range without one.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

import trio

from bench.chaos_drivers import node_stats
from bench.netns import Star
from bench.processes import Processes, node_ready
from bench.progress import say
from bench.rss import read_memory

KINDS = ("kill", "stop", "cut")
UP_TIMEOUT_S = 90.0  # a replica not reported up this long after its fault ends the injection
REST_S = 1.0  # at least this long between one fault's end and the next


@dataclass(slots=True)
class Replica:
    """One replica of the middle or the tail range, and the stages that forward to it."""

    base: str  # "mid-0", "tail-1"
    leaf: str  # its namespace in the star
    address: str
    cmd: list[str]
    index: int  # its place among its range's `--next` addresses
    upstreams: list[str] = field(default_factory=list)  # addresses of the stages in front of it
    incarnation: int = 1

    @property
    def name(self) -> str:
        return self.base if self.incarnation == 1 else f"{self.base}.{self.incarnation}"


@dataclass(slots=True)
class Injector:
    procs: Processes
    star: Star
    head: str  # whose recovery counters each fault is read with
    replicas: list[Replica]
    kinds: tuple[str, ...]
    down_s: float
    stopped_s: float
    cut_s: float
    t0: float
    faults: list[dict[str, Any]] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)  # incarnations killed on purpose
    peaks_mib: dict[str, float] = field(default_factory=dict)  # VmHWM of each killed incarnation

    def now(self) -> float:
        return round(trio.current_time() - self.t0, 3)

    async def _kill(self, rep: Replica) -> None:
        proc = self.procs.running.get(rep.name)
        if proc is not None and (memory := read_memory(proc.pid)) is not None:
            self.peaks_mib[rep.name] = round(memory.hwm_kib / 1024, 1)
        self.killed.append(rep.name)
        self.procs.kill(rep.name)
        await trio.sleep(self.down_s)
        rep.incarnation += 1
        self.procs.spawn(rep.name, rep.cmd)
        while (ready := self.procs.poll_ready(rep.name, node_ready, 120.0)) is None:
            await trio.sleep(0.05)
        if not ready:
            raise RuntimeError(f"{rep.name} did not start again")

    async def _stop(self, rep: Replica) -> None:
        self.procs.signal(rep.name, signal.SIGSTOP)
        try:
            await trio.sleep(self.stopped_s)
        finally:
            self.procs.signal(rep.name, signal.SIGCONT)

    async def _cut(self, rep: Replica) -> None:
        self.star.set_link(rep.leaf, up=False)
        try:
            await trio.sleep(self.cut_s)
        finally:
            self.star.set_link(rep.leaf, up=True)

    async def up_everywhere(self, rep: Replica) -> bool:
        """Wait until every stage in front of `rep` reports it `up` (False after UP_TIMEOUT_S)."""
        with trio.move_on_after(UP_TIMEOUT_S):
            while True:
                states = [await node_stats(a) for a in rep.upstreams]
                if all(s is not None and s["downstream"]["replicas"][rep.index]["state"] == "up" for s in states):
                    return True
                await trio.sleep(0.1)
        return False

    async def inject(self, k: int) -> bool:
        """The `k`-th fault; False when its replica did not come back."""
        rep, kind = self.replicas[k % len(self.replicas)], self.kinds[k % len(self.kinds)]
        fault: dict[str, Any] = {"fault": k + 1, "kind": kind, "replica": rep.name, "at_s": self.now()}
        say(f"failover: fault {k + 1}: {kind} {rep.name}")
        await {"kill": self._kill, "stop": self._stop, "cut": self._cut}[kind](rep)
        fault["restored_at_s"] = self.now()
        fault["up_again"] = await self.up_everywhere(rep)
        fault["up_at_s"] = self.now()
        head = await node_stats(self.head)
        fault["head_recoveries_total"] = None if head is None else head["recoveries_total"]
        self.faults.append(fault)
        return bool(fault["up_again"])

    async def run(self, count: int, every_s: float) -> None:
        """`count` faults, one beginning every `every_s` (or as soon as the one before is over)."""
        for k in range(count):
            began = trio.current_time()
            await trio.sleep(every_s / 2 if k == 0 else 0)
            if not await self.inject(k):
                return
            await trio.sleep_until(max(began + every_s, trio.current_time() + REST_S))
