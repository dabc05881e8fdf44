"""Every process the bench starts, the guarantee that each one is stopped, and what crashed.

Children run in their own session (a terminal's Ctrl-C reaches only the bench, which then
stops them in order) and get SIGTERM from the kernel if the bench itself dies. Their
output goes to log files under the work directory.

A child that exits on its own (a segfault in llama.cpp's kernels, an assertion, a model it
cannot load), before it is ready or while the bench runs, is a `Crash`: recorded with the
last lines of its log so the report can name it, and never a reason to stop the bench.
`while_alive` runs one part of the bench only as long as the processes it needs are up.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import trio

from bench.common import shown

PR_SET_PDEATHSIG = 1
LOG_TAIL_LINES = 30
T = TypeVar("T")


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True, slots=True)
class Crash:
    """A child that stopped without being asked to."""

    name: str
    exit_status: int | None  # negative: killed by that signal; None: still running but never ready
    reason: str
    log: str  # relative to the repository
    log_tail: list[str]


def describe_status(status: int) -> str:
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-status).name}"
        return f"killed by signal {-status}"
    return f"exited with status {status}"


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last `lines` lines of a child's log, absolute paths of this machine shortened."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [shown(line) for line in text.splitlines()[-lines:]]


class Processes:
    """Start children, wait for them to be ready, notice crashes, stop them all (SIGTERM, then SIGKILL)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.ended: dict[str, tuple[int, int | None]] = {}  # name -> (pid, exit status) once stopped or crashed
        self.crashed: dict[str, Crash] = {}
        self.started_at: dict[str, float] = {}  # time.monotonic() each child was started
        # Spawned and not yet found ready or failed: `poll_ready` records their crash, not `check`.
        self.starting: set[str] = set()

    def log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start(self, name: str, cmd: list[str], ready: Callable[[Path], bool], timeout_s: float = 120.0) -> bool:
        """Start `cmd`, wait until `ready(log)` holds; False (a recorded crash) if it exits or times out first."""
        self.spawn(name, cmd)
        while (outcome := self.poll_ready(name, ready, timeout_s)) is None:
            time.sleep(0.05)
        return outcome

    def spawn(self, name: str, cmd: list[str]) -> None:
        """Start `cmd` without waiting for it. Call it from the main thread: a child gets SIGTERM when
        the thread that started it ends (PR_SET_PDEATHSIG follows the thread, not the process)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log(name)
        with log.open("wb") as out:
            out.write(f"$ {' '.join(cmd)}\n".encode())
            out.flush()
            # Forked where no other thread holds a lock: before the bench starts threads, or from its
            # event loop, whose worker threads only wait for work.
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509
            )
        self.running[name] = proc
        self.started_at[name] = time.monotonic()
        self.starting.add(name)
        print(f"{name}: pid {proc.pid}, log {shown(log)}", flush=True)

    def poll_ready(self, name: str, ready: Callable[[Path], bool], timeout_s: float) -> bool | None:
        """True once `ready(log)` holds; False (a recorded crash) if it has exited or `timeout_s` has
        passed since it was started; None while it is still starting."""
        log, proc = self.log(name), self.running[name]
        if ready(log):
            self.starting.discard(name)
            return True
        if proc.poll() is not None:
            self._crashed(name, "before it was ready")
            return False
        if time.monotonic() - self.started_at[name] > timeout_s:
            self.stop(name)
            self.crashed[name] = Crash(name, None, f"was not ready within {timeout_s:.0f} s", shown(log), log_tail(log))
            print(f"CRASHED: {name} was not ready within {timeout_s:.0f} s", file=sys.stderr, flush=True)
            return False
        return None

    def check(self, during: str) -> None:
        """Record every child that has exited on its own since the last look (but those still
        starting: their `poll_ready` records that)."""
        for name, proc in list(self.running.items()):
            if name not in self.starting and proc.poll() is not None:
                self._crashed(name, f"during {during}")

    def alive(self, names: Sequence[str]) -> bool:
        return not any(n in self.crashed for n in names)

    def signal(self, name: str, signum: signal.Signals) -> None:
        if (proc := self.running.get(name)) is not None:
            proc.send_signal(signum)

    def _remove(self, name: str) -> subprocess.Popen[bytes] | None:
        self.starting.discard(name)
        return self.running.pop(name, None)

    def _crashed(self, name: str, when: str) -> None:
        proc = self._remove(name)
        assert proc is not None
        status = proc.wait()
        self.ended[name] = (proc.pid, status)
        reason = f"{describe_status(status)} {when}"
        log = self.log(name)
        self.crashed[name] = Crash(name, status, reason, shown(log), log_tail(log))
        print(f"CRASHED: {name} {reason}; log {shown(log)}", file=sys.stderr, flush=True)

    def kill(self, name: str) -> int | None:
        """SIGKILL on purpose: the process ends without a say and is not counted as a crash."""
        if (proc := self.running.get(name)) is not None:
            proc.kill()
            proc.wait()
        return self.stop(name)

    def stop(self, name: str) -> int | None:
        proc = self._remove(name)
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a process stopped on purpose (SIGSTOP) must run to see SIGTERM
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.ended[name] = (proc.pid, proc.returncode)
        return proc.returncode

    def stop_all(self) -> None:
        for name in reversed(list(self.running)):
            self.stop(name)


@contextlib.contextmanager
def open_processes(log_dir: Path) -> Iterator[Processes]:
    """Processes that are all stopped on leaving, whether by return, error or KeyboardInterrupt."""
    procs = Processes(log_dir)
    try:
        yield procs
    finally:
        if procs.running:
            print(f"stopping {', '.join(procs.running)} ...", file=sys.stderr, flush=True)
        procs.stop_all()


CRASH_GRACE_S = 5.0  # how long a failed request waits to see whether its server is on the way down


async def while_alive(procs: Processes, needs: Sequence[str], during: str, fn: Callable[[], Awaitable[T]]) -> T | None:
    """`await fn()` while every process in `needs` runs; None once one has crashed (before or meanwhile).

    A request to a dead node would wait out its timeout, so a watcher cancels `fn` as soon
    as a needed process exits (`fn` must open its clients inside, so cancelling stops them).
    An error from `fn` counts as the crash when a needed process turns out to have died
    with it; otherwise it propagates.
    """
    procs.check(during)
    if not procs.alive(needs):
        return None
    result: list[T] = []
    failure: list[Exception] = []
    async with trio.open_nursery() as nursery:

        async def body() -> None:
            try:
                result.append(await fn())
            except Exception as exc:  # judged below, once it is known whether a process died
                failure.append(exc)
            nursery.cancel_scope.cancel()

        async def watch() -> None:
            while True:
                procs.check(during)
                if not procs.alive(needs):
                    nursery.cancel_scope.cancel()
                    return
                await trio.sleep(0.1)

        nursery.start_soon(body)
        nursery.start_soon(watch)
    if failure:
        deadline = trio.current_time() + CRASH_GRACE_S
        while procs.alive(needs) and trio.current_time() < deadline:
            await trio.sleep(0.1)
            procs.check(during)
        if procs.alive(needs):
            raise failure[0]
    return result[0] if result else None


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports that were free a moment ago (held together while chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


# The node flags the sweeps share: 8 sessions, 4096 cells, 512-row batches, 64 prefill rows.
SWEEP_SERVE = [
    "--max-sessions",
    "8",
    "--kv-cells",
    "4096",
    "--n-batch",
    "512",
    "--max-prefill",
    "64",
    "--log-level",
    "warning",
]


def serve_command(model: Path, address: str, *, threads: int, flags: Sequence[str] = ()) -> list[str]:
    """The command line of every node the bench starts: `neuron-tai serve MODEL --bind ADDRESS --threads N FLAGS`."""
    return [
        sys.executable,
        "-m",
        "neuron_tai.cli",
        "serve",
        str(model),
        "--bind",
        address,
        "--threads",
        str(threads),
        "--log-level",
        "warning",
        *flags,
    ]


def node_ready(log: Path) -> bool:
    """`neuron-tai serve` prints `ready ADDRESS` once it accepts requests."""
    return any(line.startswith("ready ") for line in log.read_text(errors="replace").splitlines())
