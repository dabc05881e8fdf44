"""Real node processes for tests: started with the CLI, stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

TINY_FLAGS = [
    "--kv-cells", "1024", "--n-batch", "64", "--n-ubatch", "64", "--threads", "2", "--max-sessions", "4",
    "--kv-type", "f32", "--flash-attn", "off", "--downstream-timeout", "2", "--log-level", "warning",
]  # fmt: skip


class NodeProcess:
    def __init__(self, model: Path, bind: str, extra: Sequence[str] = ()) -> None:
        self.args = [sys.executable, "-m", "neuron_tai.cli", "serve", str(model), "--bind", bind, *TINY_FLAGS, *extra]
        self.proc: subprocess.Popen[str] | None = None
        self.address = bind

    def start(self) -> NodeProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("ready "):
            self.proc.kill()
            raise RuntimeError(f"node did not start: {line!r} {self.proc.stderr.read() if self.proc.stderr else ''}")
        self.address = line.split()[1]
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def reload_keys(self) -> None:
        """SIGHUP: the node rereads its allowed keys."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(20)


@contextmanager
def running(*nodes: NodeProcess) -> Iterator[None]:
    try:
        for node in nodes:
            node.start()
        yield
    finally:
        for node in nodes:
            node.kill()
