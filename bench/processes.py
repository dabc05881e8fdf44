"""Every process the bench starts, and the guarantee that each one is stopped.

Children run in their own session (a terminal's Ctrl-C reaches only the bench, which then
stops them in order) and get SIGTERM from the kernel if the bench itself dies. Their
output goes to log files under the work directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Processes:
    """Start children, wait for them to be ready, stop them all (SIGTERM, then SIGKILL)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.ended: dict[str, tuple[int, int]] = {}  # name -> (pid, exit status) once stopped

    def start(self, name: str, cmd: list[str], ready: Callable[[Path], bool], timeout_s: float = 120.0) -> Path:
        """Start `cmd`; returns its log once `ready(log)` holds. Raises if it exits or times out first."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        with log.open("wb") as out:
            out.write(f"$ {' '.join(cmd)}\n".encode())
            out.flush()
            # The bench starts its children before it starts any thread: preexec_fn is safe here.
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509
            )
        self.running[name] = proc
        print(f"{name}: pid {proc.pid}, log {log}", flush=True)
        deadline = time.monotonic() + timeout_s
        while not ready(log):
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} before it was ready; see {log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} was not ready within {timeout_s:.0f} s; see {log}")
            time.sleep(0.05)
        return log

    def stop(self, name: str) -> int | None:
        proc = self.running.pop(name, None)
        if proc is None:
            return None
        if proc.poll() is None:
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


def node_ready(log: Path) -> bool:
    """`neuron-tai serve` prints `ready ADDRESS` once it accepts requests."""
    return any(line.startswith("ready ") for line in log.read_text(errors="replace").splitlines())
