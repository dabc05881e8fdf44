"""Whether a process id names a process this one can see (signal 0 delivers nothing)."""

from __future__ import annotations

import os


def process_exists(pid: int) -> bool:
    """True while a process with this pid exists, a zombie until it is reaped, and another
    user's (we may not signal it, but it is there); False once it is gone. A process in another
    PID namespace is not seen."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
