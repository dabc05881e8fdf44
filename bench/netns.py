"""Hosts on one machine: a Linux network namespace per host, joined by veth links.

Each host has its own network stack, so the bytes between two of them go through real
TCP over a link, as between machines. `open_topology` creates the namespaces, the veth
pairs and their private /30 addresses (10.77.0.0/24, inside the namespaces only: nothing
is added to the machine's own stack) and removes all of it on the way out, whatever ends
the block. Where namespaces cannot be made (not root, no `ip`), it says so and gives the
same hosts on loopback, each process still pinned to its own core.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from bench.processes import free_ports

SUBNET = ipaddress.IPv4Network("10.77.0.0/24")  # carved into one /30 per link
FIRST_PORT = 20000


class TopologyError(Exception):
    """An `ip` command failed while building the topology."""


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise TopologyError(f"ip {' '.join(args)}: {proc.stderr.strip() or f'exit status {proc.returncode}'}")


@dataclass(slots=True)
class Topology:
    """Named hosts and links between them; commands and addresses for each host."""

    hosts: tuple[str, ...]
    links: tuple[tuple[str, str], ...]
    tag: str
    isolated: bool  # True: a network namespace per host; False: all on loopback
    note: str
    addresses: dict[tuple[str, str], str] = field(default_factory=dict)  # (host, peer) -> host's address on the link
    _next_port: int = FIRST_PORT
    _given: set[int] = field(default_factory=set)

    def namespace(self, host: str) -> str:
        return f"nt-{self.tag}-{host}"

    def veth(self, link: int, end: str) -> str:
        return f"nt{self.tag}-l{link}{end}"  # at most 15 characters, the kernel's limit

    @property
    def namespaces(self) -> list[str]:
        return [self.namespace(h) for h in self.hosts]

    @property
    def veths(self) -> list[str]:
        return [self.veth(i, end) for i in range(len(self.links)) for end in "ab"]

    def address(self, host: str, peer: str) -> str:
        """`host`'s address on its link with `peer`: where `peer` reaches it."""
        return self.addresses.get((host, peer), "127.0.0.1")

    def port(self) -> int:
        """A port no process of this topology uses yet (any port is free in a fresh namespace)."""
        if not self.isolated:
            port = next(p for p in iter(lambda: free_ports(1)[0], None) if p not in self._given)
            self._given.add(port)
            return port
        self._next_port += 1
        return self._next_port

    def command(self, host: str, cmd: Sequence[str], core: int | None = None, nice: int = 0) -> list[str]:
        """`cmd` run on `host` (inside its namespace), pinned to the `core`-th allowed CPU if given,
        at niceness `nice` (below 0: ahead of the machine's other processes; needs root)."""
        out = list(cmd)
        if core is not None and shutil.which("taskset"):
            cpus = sorted(os.sched_getaffinity(0))
            out = ["taskset", "-c", str(cpus[core % len(cpus)]), *out]
        if nice and shutil.which("nice"):
            out = ["nice", "-n", str(nice), *out]
        if self.isolated:
            out = ["ip", "netns", "exec", self.namespace(host), *out]
        return out


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "no `ip` command"
    if os.geteuid() != 0:
        return "not root"
    return None


def _build(topo: Topology, undo: list[list[str]]) -> None:
    """Namespaces (lo up), then each link: a veth pair, one end in each host, /30 addresses, up."""
    for ns in topo.namespaces:
        _ip("netns", "add", ns)
        undo.append(["netns", "del", ns])
        _ip("-n", ns, "link", "set", "lo", "up")
    subnets = SUBNET.subnets(new_prefix=30)
    for i, (a, b) in enumerate(topo.links):
        end_a, end_b = topo.veth(i, "a"), topo.veth(i, "b")
        _ip("link", "add", end_a, "type", "veth", "peer", "name", end_b)
        undo.append(["link", "del", end_a])  # until both ends have left the machine's own namespace
        net = next(subnets)
        first, second = (str(h) for h in net.hosts())
        for host, end, addr in ((a, end_a, first), (b, end_b, second)):
            ns = topo.namespace(host)
            _ip("link", "set", end, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", end)
            _ip("-n", ns, "link", "set", end, "up")
        topo.addresses[(a, b)] = first
        topo.addresses[(b, a)] = second


def _teardown(undo: list[list[str]]) -> list[str]:
    """Undo in reverse; deleting a namespace deletes the veth ends inside it. Returns what failed."""
    errors = []
    for args in reversed(undo):
        if args[:2] == ["link", "del"]:
            probe = subprocess.run(["ip", "link", "show", args[2]], capture_output=True, check=False)
            if probe.returncode != 0:
                continue  # already moved into a namespace (and gone with it)
        try:
            _ip(*args)
        except TopologyError as exc:
            errors.append(str(exc))
    return errors


@contextlib.contextmanager
def open_topology(
    hosts: Sequence[str], links: Sequence[tuple[str, str]], tag: str, *, loopback: bool = False
) -> Iterator[Topology]:
    """The hosts as namespaces joined by `links`, removed on leaving; on loopback where that cannot be done.

    Stop every process started in a namespace before leaving: a namespace with a process
    still in it outlives `ip netns del`, and so do its links.
    """
    topo = Topology(tuple(hosts), tuple(links), tag, isolated=True, note="")
    why = "loopback asked for" if loopback else namespaces_unavailable()
    undo: list[list[str]] = []
    if why is None:
        try:
            _build(topo, undo)
        except TopologyError as exc:
            why = str(exc)
            _teardown(undo)
            undo.clear()
    if why is not None:
        topo.isolated = False
        topo.addresses.clear()
        topo.note = f"network namespaces unavailable ({why}): the same hosts on loopback"
        print(f"multihost: {topo.note}", file=sys.stderr, flush=True)
    else:
        pairs = ", ".join(f"{a} {topo.address(a, b)} <-> {b} {topo.address(b, a)}" for a, b in links)
        topo.note = f"network namespaces {', '.join(topo.namespaces)}; veth links {pairs}"
    try:
        yield topo
    finally:
        for error in _teardown(undo):
            print(f"multihost: teardown: {error}", file=sys.stderr, flush=True)


CLONE_NEWNET = 0x40000000
STAR_SUBNET = ipaddress.IPv4Network("10.78.0.0/24")  # the hub is .1, leaf i is .(10 + i)


def _enter(path: str) -> None:
    """Move the calling thread (the main thread, before any other starts) into the namespace at `path`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise TopologyError(f"setns {path}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


@dataclass(slots=True)
class Star:
    """A hub namespace (the caller's own while the block runs) and leaf namespaces, each on one veth
    into the hub's bridge: a leaf's link can be taken down and up alone, as a machine's cable."""

    leaves: tuple[str, ...]
    tag: str
    isolated: bool
    note: str

    def namespace(self, leaf: str) -> str:
        return f"nt-{self.tag}-{leaf}"

    @property
    def hub(self) -> str:
        return f"nt-{self.tag}-hub"

    def veth(self, leaf: str) -> str:
        return f"nt{self.tag}{self.leaves.index(leaf)}"  # at most 15 characters, the kernel's limit

    def address(self, leaf: str | None) -> str:
        """Where `leaf` (None: the hub, where the caller is) listens."""
        if not self.isolated:
            return "127.0.0.1"
        return str(STAR_SUBNET[1 if leaf is None else 10 + self.leaves.index(leaf)])

    def command(self, leaf: str | None, cmd: Sequence[str]) -> list[str]:
        if not self.isolated or leaf is None:
            return list(cmd)
        return ["ip", "netns", "exec", self.namespace(leaf), *cmd]

    def set_link(self, leaf: str, up: bool) -> None:
        """Take `leaf`'s only link down (its end inside the leaf) or up again."""
        _ip("-n", self.namespace(leaf), "link", "set", self.veth(leaf), "up" if up else "down")


def _build_star(star: Star, undo: list[list[str]]) -> None:
    """The hub with a bridge, then each leaf: a veth pair made in the hub, one end moved into the leaf."""
    _ip("netns", "add", star.hub)
    undo.append(["netns", "del", star.hub])
    hub = ["-n", star.hub]
    _ip(*hub, "link", "set", "lo", "up")
    _ip(*hub, "link", "add", "br0", "type", "bridge")
    _ip(*hub, "addr", "add", f"{star.address(None)}/{STAR_SUBNET.prefixlen}", "dev", "br0")
    _ip(*hub, "link", "set", "br0", "up")
    for leaf in star.leaves:
        ns, end = star.namespace(leaf), star.veth(leaf)
        _ip("netns", "add", ns)
        undo.append(["netns", "del", ns])
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip(*hub, "link", "add", f"{end}h", "type", "veth", "peer", "name", end)
        _ip(*hub, "link", "set", end, "netns", ns)
        _ip(*hub, "link", "set", f"{end}h", "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{star.address(leaf)}/{STAR_SUBNET.prefixlen}", "dev", end)
        _ip("-n", ns, "link", "set", end, "up")


@contextlib.contextmanager
def open_star(leaves: Sequence[str], tag: str) -> Iterator[Star]:
    """A star of namespaces with this process inside the hub for the block (call it from the main
    thread before any other thread starts); every namespace removed on leaving, whatever ends the
    block. Where namespaces cannot be made, the same leaves on loopback (`isolated` False).

    Stop every process started in a leaf before leaving: a namespace with a process still in
    it outlives `ip netns del`."""
    star = Star(tuple(leaves), tag, isolated=True, note="")
    why = namespaces_unavailable()
    undo: list[list[str]] = []
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    entered = False
    try:
        if why is None:
            try:
                _build_star(star, undo)
                _enter(f"/run/netns/{star.hub}")
                entered = True
            except TopologyError as exc:
                why = str(exc)
        if why is not None:
            star.isolated = False
            star.note = f"network namespaces unavailable ({why}): every node on loopback, no link cut"
            print(f"chaos: {star.note}", file=sys.stderr, flush=True)
        else:
            star.note = f"hub {star.hub} (bridge br0, {star.address(None)}); leaves " + ", ".join(
                f"{star.namespace(leaf)} {star.address(leaf)}" for leaf in leaves
            )
        yield star
    finally:
        if entered:
            _enter(f"/proc/self/fd/{home}")
        os.close(home)
        for error in _teardown(undo):
            print(f"chaos: teardown: {error}", file=sys.stderr, flush=True)
