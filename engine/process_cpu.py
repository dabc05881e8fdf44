"""What the OS says of the node's process and its CPUs: how often it took one away from it.

A stage's OpenMP team holds every core it is given; any other thread that runs meanwhile
(the event loop, ZeroMQ's I/O thread, a client on the same machine) preempts one of the
team, and the rest of the team waits at its next barrier. The count tells a slow call
caused by contention from one slow in itself.
"""

from __future__ import annotations

import resource


def preemptions() -> int:
    """Involuntary context switches of all this process's threads so far (`ru_nivcsw`)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw)
