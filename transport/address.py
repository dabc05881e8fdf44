"""ZeroMQ endpoint addresses a user types: checked before ZeroMQ sees them.

ZeroMQ answers a malformed endpoint with a bare `Invalid argument`; an operator who typed
`127.0.0.1:5555` deserves to be told what form it takes. Only the transports a node
serves are accepted: `tcp://HOST:PORT` (when binding, a port of 0 or `*` lets the system choose)
and `ipc://PATH`.
"""

from __future__ import annotations

FORMS = "tcp://HOST:PORT or ipc://PATH"


class AddressError(ValueError):
    """An address a node or client cannot use; the message says what form it takes."""


def check_address(address: str, *, bind: bool = False) -> str:
    """`address` itself when it is a usable endpoint, else `AddressError` saying why."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        hint = f" (did you mean tcp://{address}?)" if ":" in address else ""
        raise AddressError(f"{address!r} is not an address: use {FORMS}{hint}")
    if scheme == "ipc":
        if not rest:
            raise AddressError(f"{address!r} names no path: use ipc://PATH")
        return address
    if scheme != "tcp":
        raise AddressError(f"{address!r}: the transport {scheme!r} is not served; use {FORMS}")
    host, colon, port = rest.rpartition(":")
    if bind and port == "*":  # ZeroMQ picks a free port
        return address
    if not colon or not host or not port.isdigit():
        raise AddressError(f"{address!r} needs a host and a port: tcp://HOST:PORT")
    if not 0 <= int(port) <= 65535 or (int(port) == 0 and not bind):
        raise AddressError(f"{address!r}: the port must be 1-65535")
    return address
