"""A hostile peer of the chaos run (or its ping prober): a process of its own that prints one JSON line.

    python -m bench.chaos_peer garbage --targets TARGETS.json --seconds 90 --quota 60000 --seed 1

Roles (the message builders are in bench/hostile.py):
- `garbage`: random bytes, deep and wide msgpack, to every target;
- `fields`: out-of-range fields (sampling, positions, sessions, the envelope), the steps on
  a session the peer opened for them;
- `flood`: pings, stats, closes of sessions that never existed, opens (each closed once opened);
- `huge`: texts and strings at and past the limits, frames of MiBs, frames over the message limit;
- `never_read`: connections that open two sessions, then send `stats` and never read a reply;
- `vanish`: connections that open sessions (some prefill, some start a `generate`) and disappear;
- `probe`: one ping at a time to every target, every 20 ms, each timed, until SIGTERM.

Each connection carries one class to one target, so every reply is counted under its class.
Messages are paced over `--seconds` (each class's quota spread evenly) and each connection
keeps a bounded number unanswered (one for the big ones): the attack lasts the whole run and
the peer never holds much. A reply that does not come within 10 s is counted unanswered.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import zmq

from bench import hostile
from bench.hostile import Frames, Stop, Target, header, int32

REPLY_LOST_S = 10.0  # a reply later than this is counted unanswered
DRAIN_S = 10.0  # after the last message, how long replies are awaited
PROBE_PERIOD_S = 0.02
PROBE_LOST_S = 5.0

Ctx = zmq.Context[zmq.Socket[bytes]]


def reply_kind(frames: list[bytes]) -> tuple[str, dict[str, Any]]:
    """`op`, or `error:CODE`, of a node's reply, and its header."""
    try:
        head = msgpack.unpackb(frames[0], strict_map_key=False)
    except Exception:
        return "unreadable", {}
    if not isinstance(head, dict):
        return "unreadable", {}
    op = head.get("op")
    return (f"error:{head.get('code')}" if op == "error" else str(op)), head


@dataclass(slots=True)
class Tally:
    sent: int = 0
    answered: int = 0
    unanswered: int = 0
    replies: Counter[str] = field(default_factory=Counter)

    def add(self, other: Tally) -> None:
        self.sent += other.sent
        self.answered += other.answered
        self.unanswered += other.unanswered
        self.replies.update(other.replies)

    def ask(self, sock: zmq.Socket[bytes], frames: Frames) -> tuple[str, dict[str, Any]] | None:
        """`request`, counted: sent, and its reply (if one came) by kind."""
        self.sent += 1
        got = request(sock, frames)
        if got is not None:
            self.answered += 1
            self.replies[got[0]] += 1
        return got


def dealer(ctx: Ctx, address: str, **options: int) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(address)
    return sock


class Channel:
    """One connection to one target for one class: paced sends, a window of unanswered ones, every reply tallied."""

    def __init__(
        self,
        ctx: Ctx,
        target: Target,
        cls: str,
        quota: int,
        window: int,
        build: Callable[[int], Frames],
        *,
        answered: bool = True,
    ) -> None:
        self.sock = dealer(ctx, target.address)
        self.target = target
        self.cls = cls
        self.quota = quota
        self.window = window
        self.build = build
        self.answered = answered  # False: nothing is answered (frames over the message limit)
        self.tally = Tally()
        self.made = 0  # messages of the class built so far (follow-ups such as closes not counted)
        self.outstanding = 0
        self.last_progress = time.monotonic()
        self.on_reply_hook: Callable[[Channel, str, dict[str, Any]], None] | None = None
        self.waiting: Frames | None = None  # built, not sent yet (ZeroMQ would have blocked)

    def send(self, frames: Frames) -> bool:
        """Queue one message; False when ZeroMQ would block (no connection yet, or a full pipe)."""
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        self.tally.sent += 1
        if self.answered:
            self.outstanding += 1
        return True

    def send_due(self, progress: float) -> None:
        while self.made < int(self.quota * progress) and self.outstanding < self.window:
            if self.waiting is None:
                self.waiting = self.build(self.made)
            if not self.send(self.waiting):
                return  # tried again on the next round
            self.waiting = None
            self.made += 1

    def receive(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind, head = reply_kind(frames)
            self.tally.replies[kind] += 1
            self.tally.answered += 1
            self.outstanding = max(0, self.outstanding - 1)
            self.last_progress = time.monotonic()
            if self.on_reply_hook is not None:
                self.on_reply_hook(self, kind, head)

    def give_up_if_stalled(self, now: float) -> None:
        if self.outstanding and now - self.last_progress > REPLY_LOST_S:
            self.tally.unanswered += self.outstanding
            self.outstanding = 0
            self.last_progress = now

    @property
    def finished(self) -> bool:
        return self.made >= self.quota and self.outstanding == 0


def pump(channels: list[Channel], seconds: float) -> None:
    """Send every channel's quota paced over `seconds`, then wait for the last replies (bounded)."""
    poller = zmq.Poller()
    by_sock = {}
    for ch in channels:
        poller.register(ch.sock, zmq.POLLIN)
        by_sock[ch.sock] = ch
    start = time.monotonic()
    while not Stop.requested:
        now = time.monotonic()
        progress = min(1.0, (now - start) / seconds) if seconds > 0 else 1.0
        for ch in channels:
            ch.send_due(progress)
        for sock, _ in poller.poll(2):
            by_sock[sock].receive()
        for ch in channels:
            ch.give_up_if_stalled(now)
        if progress >= 1.0 and all(ch.finished for ch in channels):
            break
        if now - start > seconds + DRAIN_S:
            break
    for ch in channels:
        ch.tally.unanswered += ch.outstanding
        ch.outstanding = 0


def request(sock: zmq.Socket[bytes], frames: Frames, timeout_s: float = 10.0) -> tuple[str, dict[str, Any]] | None:
    """Send and wait for one reply (None: none came)."""
    sock.send_multipart(frames)
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return reply_kind(sock.recv_multipart())


def _send_soon(sock: zmq.Socket[bytes], frames: Frames, within_s: float = 5.0) -> bool:
    """Send without blocking for longer than `within_s` (the node may have stopped reading us)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            time.sleep(0.001)
    return False


def split(quota: int, shares: dict[str, float], targets: list[Target]) -> dict[tuple[str, Target], int]:
    """A role's quota over its classes (by share) and its targets (evenly)."""
    out = {}
    for cls, share in shares.items():
        per = quota * share / len(targets)
        for j, t in enumerate(targets):
            out[(cls, t)] = int(per) + (1 if j < round((per - int(per)) * len(targets)) else 0)
    return out


def summary(channels: list[Channel], extra: dict[str, Tally] | None = None) -> dict[str, Any]:
    classes: dict[str, Tally] = {}
    per_target: Counter[str] = Counter()
    for ch in channels:
        classes.setdefault(ch.cls, Tally()).add(ch.tally)
        per_target[f"{ch.cls}@{ch.target.name}"] += ch.tally.sent
    for cls, tally in (extra or {}).items():
        classes.setdefault(cls, Tally()).add(tally)
    return {
        "classes": {c: {**asdict(t), "replies": dict(t.replies)} for c, t in classes.items()},
        "sent_per_target": dict(per_target),
    }


# -- roles -------------------------------------------------------------------------------


def _built(build: hostile.Builder, rng: random.Random, t: Target) -> Callable[[int], Frames]:
    """The class's `i`-th message to `t`."""
    return lambda i: build(rng, i, t)


def _always(frames: Frames) -> Callable[[int], Frames]:
    return lambda _i: frames


def _builder_channels(
    ctx: Ctx, targets: list[Target], shares: dict[str, float], quota: int, window: int, rng: random.Random
) -> list[Channel]:
    """A channel per class (a `hostile.BUILDERS` name) and target, the quota split by `shares`."""
    return [
        Channel(ctx, t, cls, q, window, _built(hostile.BUILDERS[cls], rng, t))
        for (cls, t), q in split(quota, shares, targets).items()
    ]


def role_garbage(ctx: Ctx, targets: list[Target], seconds: float, quota: int, rng: random.Random) -> dict[str, Any]:
    shares = {"random_bytes": 0.5, "deep_msgpack": 0.25, "wide_msgpack": 0.25}
    channels = _builder_channels(ctx, targets, shares, quota, 32, rng)
    pump(channels, seconds)
    return summary(channels)


def role_fields(ctx: Ctx, targets: list[Target], seconds: float, quota: int, rng: random.Random) -> dict[str, Any]:
    channels = []
    for (cls, t), q in split(quota, {"out_of_range": 1.0}, targets).items():
        ch = Channel(ctx, t, cls, q, 16, _built(partial(hostile.out_of_range, session="oor"), rng, t))
        ch.tally.ask(ch.sock, [header("open", 0, session="oor", max_tokens=64)])  # the session its steps use
        channels.append(ch)
    pump(channels, seconds)
    for ch in channels:  # leave as a client should (the lease would free it otherwise)
        ch.tally.ask(ch.sock, [header("close", 1, session="oor")])
    return summary(channels)


FLOOD_SHARES = {"ping": 0.4, "stats": 0.1, "close": 0.25, "open": 0.25}
FLOOD_WINDOWS = {"ping": 32, "stats": 4, "close": 32, "open": 8}


def _close_when_opened(ch: Channel, kind: str, head: dict[str, Any]) -> None:
    if kind == "opened" and isinstance(head.get("session"), str):
        ch.send([header("close", 0, session=head["session"])])


def role_flood(ctx: Ctx, targets: list[Target], seconds: float, quota: int, _rng: random.Random) -> dict[str, Any]:
    channels = []
    for (kind, t), q in split(quota, FLOOD_SHARES, targets).items():
        ch = Channel(ctx, t, f"flood_{kind}", q, FLOOD_WINDOWS[kind], partial(hostile.flood, kind))
        if kind == "open":
            ch.on_reply_hook = _close_when_opened
        channels.append(ch)
    pump(channels, seconds)
    return summary(channels)


def role_huge(
    ctx: Ctx, targets: list[Target], seconds: float, quota: int, rng: random.Random, oversize: int
) -> dict[str, Any]:
    channels = _builder_channels(ctx, targets, {"huge_strings": 0.6, "huge_frames": 0.4}, quota, 1, rng)
    big = {t.max_message_bytes: hostile.oversize_frame(t) for t in targets}  # one buffer per size, reused
    for t in targets:
        channels.append(Channel(ctx, t, "huge_frames", oversize, 1, _always(big[t.max_message_bytes]), answered=False))
    pump(channels, seconds)
    return summary(channels)


def paced(n: int, seconds: float, targets: list[Target]) -> Iterator[tuple[int, Target]]:
    """`n` connections spread evenly over `seconds`, the targets in turn, until a stop is asked for."""
    start = time.monotonic()
    for k in range(n):
        if Stop.requested:
            return
        time.sleep(max(0.0, start + k * seconds / n - time.monotonic()))
        yield k, targets[k % len(targets)]


def role_never_read(
    ctx: Ctx, targets: list[Target], seconds: float, quota: int, _rng: random.Random, per_connection: int
) -> dict[str, Any]:
    """Connections that open two sessions, then send `stats` without ever reading: the node parks
    their replies and, past its limit, treats them as gone and frees their sessions."""
    tally = Tally()
    for k, t in paced(max(len(targets), quota // per_connection), seconds, targets):
        sock = dealer(ctx, t.address, RCVHWM=1, RCVBUF=4096)
        for j in range(2):
            tally.ask(sock, [header("open", j, session=f"nr-{k}-{j}", max_tokens=32)])
        for i in range(per_connection - 2):
            if not _send_soon(sock, [header("stats", 10 + i)]):
                break
            tally.sent += 1
        time.sleep(1.0)
        sock.close(linger=0)
    return summary([], {"never_read": tally})


def role_vanish(ctx: Ctx, targets: list[Target], seconds: float, quota: int, rng: random.Random) -> dict[str, Any]:
    """Connections that open sessions and disappear without closing them, four ways in turn."""
    tally = Tally()
    opened = 0
    for k, t in paced(max(len(targets), quota // 3), seconds, targets):
        sock = dealer(ctx, t.address)
        prompt = int32([1, *(rng.randrange(3, t.n_vocab) for _ in range(7))])
        way = (k // len(targets)) % 4  # every target sees every way
        if way == 3:  # gone before the open is even answered (the linger only lets it leave)
            tally.sent += 1
            sock.send_multipart([header("open", 1, session=f"v{k}", max_tokens=64, wait_ms=2000)])
            sock.close(linger=200)
            continue
        got = tally.ask(sock, [header("open", 1, session=f"v{k}", max_tokens=64)])
        if got is not None and got[0] == "opened":
            opened += 1
            if way == 1:  # prefilled: the session holds KV
                step = header("step", 2, session=f"v{k}", pos=0, n=8, input="tokens", out="token")
                tally.ask(sock, [step, prompt])
            elif way == 2:  # gone while the node generates for it
                gen = header("generate", 2, session=f"v{k}", pos=0, n=8, max_new=48, ignore_eog=True)
                tally.ask(sock, [gen, prompt])
        sock.close(linger=0)
    out = summary([], {"vanish": tally})
    out["sessions_abandoned"] = opened
    return out


def role_probe(ctx: Ctx, targets: list[Target], seconds: float) -> dict[str, Any]:
    """A ping to each target every 20 ms (one in flight per target), until SIGTERM or `seconds`."""
    socks = {t.name: dealer(ctx, t.address) for t in targets}
    by_sock = {s: name for name, s in socks.items()}
    poller = zmq.Poller()
    for s in socks.values():
        poller.register(s, zmq.POLLIN)
    samples: dict[str, list[list[float | None]]] = {t.name: [] for t in targets}
    in_flight: dict[str, tuple[int, float, float]] = {}  # name -> (rid, wall time sent, perf time sent)
    due = dict.fromkeys(socks, time.perf_counter())
    rid = 0
    end = time.monotonic() + seconds
    while not Stop.requested and time.monotonic() < end:
        now = time.perf_counter()
        for name, s in socks.items():
            if name not in in_flight and now >= due[name]:
                rid += 1
                s.send_multipart([header("ping", rid)])
                in_flight[name] = (rid, time.time(), now)
                due[name] = now + PROBE_PERIOD_S
            elif name in in_flight and now - in_flight[name][2] > PROBE_LOST_S:
                samples[name].append([round(in_flight.pop(name)[1], 3), None])  # lost
        for sock, _ in poller.poll(1):
            name = by_sock[sock]
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                _, head = reply_kind(frames)
                sent = in_flight.get(name)
                if sent is not None and head.get("rid") == sent[0]:
                    del in_flight[name]
                    samples[name].append([round(sent[1], 3), round((time.perf_counter() - sent[2]) * 1e3, 3)])
    return {"samples": samples}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=["garbage", "fields", "flood", "huge", "never_read", "vanish", "probe"])
    parser.add_argument("--targets", type=Path, required=True, help="a JSON list of bench.hostile.Target fields")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--quota", type=int, default=0, help="messages to send over the whole run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--oversize", type=int, default=2, help="huge: frames over the message limit per target")
    parser.add_argument("--per-connection", type=int, default=2000, help="never_read: messages per connection")
    args = parser.parse_args()
    Stop.on_signals()
    targets = [Target(**t) for t in json.loads(args.targets.read_text())]
    rng = random.Random(args.seed)
    ctx: Ctx = zmq.Context()
    started = time.monotonic()
    try:
        if args.role == "probe":
            out = role_probe(ctx, targets, args.seconds)
        elif args.role == "huge":
            out = role_huge(ctx, targets, args.seconds, args.quota, rng, args.oversize)
        elif args.role == "never_read":
            out = role_never_read(ctx, targets, args.seconds, args.quota, rng, args.per_connection)
        else:
            roles = {"garbage": role_garbage, "fields": role_fields, "flood": role_flood, "vanish": role_vanish}
            out = roles[args.role](ctx, targets, args.seconds, args.quota, rng)
    finally:
        ctx.destroy(linger=0)
    out.update(role=args.role, seconds=round(time.monotonic() - started, 2), interrupted=Stop.requested)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
