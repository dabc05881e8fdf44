"""CurveZMQ on a node's links: key files, the allow list, and the sockets that use them.

ZeroMQ does the cryptography and the handshake (its CURVE mechanism); during each
handshake libzmq asks a ZAP handler whether the peer's public key may connect. The
handler is pyzmq's `ThreadAuthenticator`, which answers in a thread of its own, so the
allow list it consults and the count of its denials sit behind a lock: Trio tasks
reload the list (SIGHUP) and read the count (`stats`). A peer that fails the handshake,
for whatever reason, never reaches the node's socket.

Key files are ZeroMQ certificates as `zmq.auth.create_certificates` writes them:
NAME.key holds a public key, NAME.key_secret the key pair.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("neuron_tai.security")


class KeyFileError(ValueError):
    """A key file that is missing, unreadable or not of the expected kind."""


def create_key_pair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write NAME.key and NAME.key_secret into `directory`; never overwrites a key."""
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise KeyFileError(f"{path} exists: remove it first (keys are never overwritten)")
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    old = os.umask(0o077)  # the secret file is readable by its owner only, from its first byte
    try:
        made = zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    os.chmod(made[0], 0o644)  # the public half is meant to be handed out
    return Path(made[0]), Path(made[1])


def load_public_key(path: Path) -> bytes:
    """The public key (z85) in a .key or .key_secret file."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot read a key from {path}: {exc}") from None
    if not public:
        raise KeyFileError(f"{path} holds no public key")
    return public


def load_key_pair(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) from a .key_secret file."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot read a key pair from {path}: {exc}") from None
    if not public or not secret:
        raise KeyFileError(f"{path} holds no secret key: give the .key_secret file")
    return public, secret


def read_allowed_keys(source: Path) -> frozenset[bytes]:
    """The public keys of every .key file in a directory, or of one key file."""
    if source.is_dir():
        return frozenset(load_public_key(p) for p in sorted(source.glob("*.key")))
    return frozenset({load_public_key(source)})


class AllowList:
    """The public keys a node admits, and how many handshakes it refused.

    `admits` runs in the authenticator's thread; `reload` and the counters are used from
    Trio tasks. Everything shared goes through the lock.
    """

    def __init__(self, source: Path) -> None:
        self.source = source
        self._lock = threading.Lock()
        self._keys = read_allowed_keys(source)
        self._failures = 0
        if not self._keys:
            raise KeyFileError(f"no .key files in {source}: the node would admit nobody")

    def reload(self) -> int:
        """Read the keys again (an operator added or removed some); the old list stays on error."""
        try:
            keys = read_allowed_keys(self.source)
        except (OSError, KeyFileError) as exc:
            log.error("keeping the current %d allowed keys: %s", len(self), exc)
            return len(self)
        with self._lock:
            self._keys = keys
        log.warning("allowed keys reloaded from %s: %d", self.source, len(keys))
        return len(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: may this z85 public key connect?"""
        with self._lock:
            allowed = key in self._keys
            if not allowed:
                self._failures += 1
        if not allowed:
            log.info("refused a CURVE handshake from key %s", key.decode(errors="replace"))
        return allowed

    @property
    def failures(self) -> int:
        with self._lock:
            return self._failures

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)


@dataclass(frozen=True, slots=True)
class ServerCurve:
    """A node that requires CURVE: its key pair, the keys it admits, and the next stage's key."""

    secret: Path  # the node's .key_secret file; it also authenticates the node to its next stage
    allow: Path  # a directory of .key files, or one .key file
    next_key: Path | None = None  # the next stage's public key: its link uses CURVE too


@dataclass(frozen=True, slots=True)
class ClientCurve:
    """A peer's side of CURVE: its own key pair and the public key of the node it talks to."""

    key: Path  # this peer's .key_secret file
    server_key: Path  # the node's .key (or .key_secret) file

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        """Make `sock` a CURVE client; call before connect."""
        public, secret = load_key_pair(self.key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, load_public_key(self.server_key))


def client_curve(key: Path | str | None, server_key: Path | str | None) -> ClientCurve | None:
    """Both files or neither (a plain link)."""
    if key is None and server_key is None:
        return None
    if key is None or server_key is None:
        raise ValueError("CURVE needs both the server's public key and this peer's key pair")
    return ClientCurve(Path(key), Path(server_key))


def make_curve_server(sock: zmq.Socket[bytes], secret: Path) -> None:
    """Make `sock` require CURVE with this key pair; call before bind."""
    public, secret_key = load_key_pair(secret)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret_key)


@contextmanager
def open_zmq_context(curve: ServerCurve | None) -> Iterator[tuple[zmq.Context[zmq.Socket[bytes]], AllowList | None]]:
    """A context for one node, with its ZAP handler running when it requires CURVE.

    The handler must be up before the node binds: without one, libzmq lets every CURVE
    client that knows the node's public key in.
    """
    allow = AllowList(curve.allow) if curve is not None else None
    if curve is not None:
        load_key_pair(curve.secret)  # fail before anything starts
        if curve.next_key is not None:
            load_public_key(curve.next_key)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        if allow is None:
            yield ctx, None
            return
        auth = ThreadAuthenticator(ctx, log=logging.getLogger("neuron_tai.zap"))
        auth.configure_curve_callback("*", credentials_provider=allow)  # set before its thread reads it
        auth.start()
        try:
            yield ctx, allow
        finally:
            auth.stop()
    finally:
        ctx.term()


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ endpoint is reachable from this host only."""
    parts = urlsplit(address)
    if parts.scheme in ("ipc", "inproc"):
        return True
    host = (parts.hostname or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # `*`, an interface name or a host name: possibly reachable from elsewhere
