"""Progress lines with the time since the bench started, flushed at once."""

from __future__ import annotations

import time


class Progress:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {text}", flush=True)


say = Progress()
