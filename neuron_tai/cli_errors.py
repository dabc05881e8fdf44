"""The edge of the `neuron-tai` command: a user's mistake is one line, a bug is a traceback.

A mistake (a bad option, a missing file, a port in use, a node that refuses or does not
answer) is printed as one line naming what to change, and the command exits non-zero:
2 when it cannot run as given, 1 when the node it asked said no or did not answer.
Anything else is a bug in neuron-tai: its traceback is printed, then a line asking for a
report. Errors raised inside Trio nurseries arrive in exception groups: each leaf counts.
"""

from __future__ import annotations

import errno
import socket
import sys
import traceback
from collections.abc import Iterator

from engine.budgets import BudgetError
from neuron_tai import __version__
from neuron_tai.client import NodeError
from neuron_tai.shard import ShardError

CANNOT_RUN = 2  # the command cannot run as given: fix the command line, the config or the files
FAILED = 1  # the node said no, or nothing answered
BUG = 70  # EX_SOFTWARE: neuron-tai itself failed


class UsageError(Exception):
    """A command that cannot run as given; the message says what to change."""


class BindError(UsageError):
    """An address a server cannot listen on (in use, or not this host's)."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"cannot listen on {address}: {reason}")


def leaves(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions an exception group holds, however deep; an exception itself otherwise."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from leaves(inner)
    else:
        yield exc


def exit_code(exc: BaseException) -> int | None:
    """The exit code of a user's mistake; None for a bug."""
    if isinstance(exc, NodeError | TimeoutError | ConnectionError):
        return FAILED
    if isinstance(exc, UsageError | ShardError | BudgetError | ValueError | OSError):
        return CANNOT_RUN
    return None


def message(exc: BaseException) -> str:
    if isinstance(exc, NodeError):
        return f"the node refused: {exc}"
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc) or type(exc).__name__


def report(exc: BaseException, command: str) -> int:
    """Print what went wrong; the exit code."""
    found = list(leaves(exc))
    codes = [exit_code(leaf) for leaf in found]
    if any(code is None for code in codes):
        traceback.print_exception(exc)
        print(
            f"neuron-tai {__version__}: this is a bug in neuron-tai, not a mistake of yours: please report this "
            "as a bug on the project's issue tracker, with the command and the lines above",
            file=sys.stderr,
        )
        return BUG
    for line in dict.fromkeys(message(leaf) for leaf in found):  # each message once, in order
        print(f"neuron-tai {command}: error: {line}", file=sys.stderr)
    return max(c for c in codes if c is not None)


def check_port_free(host: str, port: int, shown: str) -> None:
    """BindError now, before a model loads for seconds, if nothing may listen on host:port.

    Servers set SO_REUSEADDR, and so does this check: a port only in TIME_WAIT passes, as it
    would for them. A host this check cannot resolve is left to the server to judge.
    """
    if port == 0:
        return
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return
    family, kind, proto, _, where = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(where)
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                raise BindError(shown, _reason(exc)) from None


def _reason(exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return "the port is in use (by another node or server?)"
    if exc.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges)"
    return "that address is not one of this host's"


def check_endpoint_free(address: str) -> None:
    """`check_port_free` for a ZeroMQ endpoint a node binds (tcp only; port * is any)."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme == "tcp" and port.isdigit():
        check_port_free("" if host == "*" else host, int(port), address)


def bind_failure(exc: BaseException, address: str) -> BindError | None:
    """The BindError a server's own failed bind means, if it is one (ZeroMQ's or the OS's)."""
    number = getattr(exc, "errno", None)
    if number in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
        return BindError(address, _reason(OSError(number, "")))
    return None
