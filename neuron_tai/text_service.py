"""`tokenize` and `detokenize`: one tokenizer call at a time, on a worker thread.

Their work grows with their input, so they never run on the event loop. The
vocabulary is read-only in llama.cpp (tokenize and detokenize are const), so a call
may overlap a decode. What waits for the tokenizer is bounded in bytes: beyond
`max_pending_bytes` a request is `busy` at once (one is always taken).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import trio

from engine.engine import Engine
from neuron_tai.handler_pool import HandlerPool, Held
from neuron_tai.outbox import Outbox
from protocol.errors import ErrorCode, Fault
from transport import wire


class TextService:
    def __init__(
        self, engine: Engine, pool: HandlerPool, outbox: Outbox, *, max_tokens: int, max_pending_bytes: int
    ) -> None:
        self.engine = engine
        self.pool = pool
        self.outbox = outbox
        self.max_tokens = max_tokens
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self.limiter = trio.CapacityLimiter(1)

    def start(self, peer: bytes, req: wire.Tokenize | wire.Detokenize) -> None:
        """A tokenizer request becomes a task unless too much text already waits."""
        size = len(req.text) if isinstance(req, wire.Tokenize) else req.tokens.nbytes
        if self.pending_bytes and self.pending_bytes + size > self.max_pending_bytes:
            self.outbox.busy(peer, req.rid, "too much text is waiting for the tokenizer")
            return

        def done() -> None:
            self.pending_bytes -= size

        async def work() -> None:
            await (self._tokenize(peer, req) if isinstance(req, wire.Tokenize) else self._detokenize(peer, req))

        if self.pool.spawn(peer, req.rid, work, held=Held(size), on_exit=done):
            self.pending_bytes += size

    async def _tokenize(self, peer: bytes, req: wire.Tokenize) -> None:
        def tokenize() -> npt.NDArray[np.int32]:
            return np.array(self.engine.tokenize(req.text, req.add_special), "<i4")

        ids = await trio.to_thread.run_sync(tokenize, limiter=self.limiter)
        if len(ids) > self.max_tokens:
            message = f"the text is {len(ids)} tokens, the limit is {self.max_tokens}"
            self.outbox.error(peer, req.rid, Fault(ErrorCode.TOO_LARGE, message))
            return
        self.outbox.send(peer, wire.encode({"op": "tokens", "rid": req.rid, "n": len(ids)}, ids.tobytes()))

    async def _detokenize(self, peer: bytes, req: wire.Detokenize) -> None:
        def detokenize() -> str:
            return self.engine.detokenize(req.tokens.tolist())

        try:
            text = await trio.to_thread.run_sync(detokenize, limiter=self.limiter)
        except Fault as fault:
            self.outbox.error(peer, req.rid, fault)
            return
        self.outbox.send(peer, wire.encode({"op": "text", "rid": req.rid, "text": text}))
