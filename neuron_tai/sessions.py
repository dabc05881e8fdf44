"""Opening and closing sessions: in the engine, and on a chain's next stage.

An `open` is admitted by the engine first, then (with a next stage) opened there; if
the next stage does not open it, nothing stays open anywhere. A `close` is never
refused and never a task: with nothing to close (or its close already under way) it
is answered `existed: false` at once; otherwise the engine's cleanup path closes it
(after its run, if it is generating, has answered `done`) and then it is answered. At
most one close per session waits, so a flood of closes holds no more than the
sessions do.
"""

from __future__ import annotations

from engine.engine import Engine
from engine.messages import CloseRequest, Opened, OpenRequest
from neuron_tai.forwarding import Forwarder
from neuron_tai.generate_run import Generations
from neuron_tai.outbox import Outbox
from protocol.errors import Fault
from protocol.stage import Stage
from transport import wire

Key = tuple[bytes, str]

MAX_REPEATED_CLOSES = 16  # closes of a generating session that wait for its close; more are answered at once


class SessionDesk:
    def __init__(
        self,
        engine: Engine,
        outbox: Outbox,
        generations: Generations,
        forwarder: Forwarder | None,
        *,
        stage: Stage,
        lease_ms: int,
    ) -> None:
        self.engine = engine
        self.outbox = outbox
        self.generations = generations
        self.forwarder = forwarder
        self.lease_ms = lease_ms
        self.stage = stage  # what this stage serves, its shard's fingerprint included
        # Sessions whose close is under way: the rids of the closes that wait for it, the first
        # the one that closes it (a repeat during a `generate` is answered with it, after the
        # run's `done`; any other repeat at once).
        self.closing: dict[Key, list[int]] = {}

    async def open(self, peer: bytes, req: wire.Open) -> None:
        request = OpenRequest(peer, req.session, req.max_tokens, req.sampling, req.wait_ms)
        opened = await self.engine.request(request)
        if isinstance(opened, Fault):
            self.outbox.relay(peer, req.rid, opened)
            return
        assert isinstance(opened, Opened)
        stage = self.stage
        if self.forwarder is not None:
            chained = await self.forwarder.open(peer, req, stage)
            if isinstance(chained, Fault):
                await self.engine.cleanup(CloseRequest(peer, req.session))  # nothing is opened anywhere
                self.outbox.relay(peer, req.rid, chained)
                return
            if self.engine.open_sessions.max_tokens_of(peer, req.session) is None:  # freed meanwhile: free it there too
                self.forwarder.session_freed(peer, req.session)
            stage = chained
        reply = wire.Opened(req.rid, req.session, opened.kv_reserved, stage, self.lease_ms)
        self.outbox.deliver(peer, req.session, wire.encode_reply(reply))

    def close(self, peer: bytes, req: wire.Close) -> None:
        key = (peer, req.session)
        run = self.generations.runs.get(key)
        waiting = self.closing.get(key)
        if waiting is not None and run is not None and len(waiting) < MAX_REPEATED_CLOSES:
            waiting.append(req.rid)  # answered after the run's `done`, as the first one is
            return
        if waiting is not None or (run is None and self.engine.open_sessions.max_tokens_of(peer, req.session) is None):
            self._closed(peer, req.rid, req.session, existed=False)
            return
        self.closing[key] = [req.rid]
        if run is None:
            self._close_in_engine(key)
        else:
            run.then_close = lambda: self._close_in_engine(key)
            run.cancel.set()

    def _close_in_engine(self, key: Key) -> None:
        self.engine.cleanup_nowait(CloseRequest(*key))  # answered on its `CloseAnswered` (`answered`)

    def answered(self, key: Key, existed: bool) -> None:
        """The engine ran a close of this session: answer the `close` that waits for it, if any.
        Its `SessionEnded` came first, so its close on the next stage is queued by then."""
        rids = self.closing.pop(key, [])
        for i, rid in enumerate(rids):
            self._closed(key[0], rid, key[1], existed and i == 0)  # one close closed it

    def _closed(self, peer: bytes, rid: int, session: str, existed: bool) -> None:
        self.outbox.send(peer, wire.encode_reply(wire.Closed(rid, session, existed)))
