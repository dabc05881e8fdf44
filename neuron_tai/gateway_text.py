"""Where the gateway turns text into token ids and back.

Given the model file, the gateway reads its vocabulary (no weights) and does both in
process: a streamed request then costs the node only its `open`, its `generate` and its
`close`, nothing per token beyond the stream. The text is the node's own: both call the
same llama.cpp functions on the same vocabulary (engine/vocab_text.py), and at start the
gateway checks that against the node; a node that disagrees (another model) is asked
instead. Without a model file the node's `tokenize` and `detokenize` are used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Protocol

import trio

from engine.llama_handles import Vocabulary
from neuron_tai.client import Client, ClientClosed, NodeError

INLINE_CHARS = 4096  # longer texts are tokenized on a worker thread, off the event loop
PROBE = "The gateway's vocabulary check: naïve café, 1234 ✓"
CHECK_TIMEOUT_S = 3.0
log = logging.getLogger("neuron_tai.gateway")


class GatewayText(Protocol):
    async def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...

    async def detokenize(self, tokens: list[int]) -> str: ...


class NodeText:
    """The node tokenizes and detokenizes: a round trip each; `count(op)` counts them."""

    def __init__(self, client: Client, count: Callable[[str], None]) -> None:
        self.client = client
        self.count = count

    async def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        self.count("tokenize")
        return await self.client.tokenize(text, add_special)

    async def detokenize(self, tokens: list[int]) -> str:
        self.count("detokenize")
        return await self.client.detokenize(tokens)


class LocalText:
    """The model's vocabulary in this process: no round trip."""

    def __init__(self, vocabulary: Vocabulary) -> None:
        self.vocabulary = vocabulary

    async def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        if len(text) > INLINE_CHARS:
            return await trio.to_thread.run_sync(self.vocabulary.tokenize, text, add_special)
        return self.vocabulary.tokenize(text, add_special)

    async def detokenize(self, tokens: list[int]) -> str:
        return self.vocabulary.detokenize(tokens)


async def gateway_text(model: Path | None, client: Client, count: Callable[[str], None]) -> GatewayText:
    """The model file's vocabulary when there is one and the node agrees with it, else the node."""
    node = NodeText(client, count)
    if model is None:
        return node
    try:
        local = LocalText(Vocabulary(model))
    except ValueError as exc:
        log.warning("%s; the node tokenizes and detokenizes", exc)
        return node
    agree = await _agrees(local, node)
    if agree is False:
        log.warning("%s does not tokenize as the node does; the node tokenizes and detokenizes", model)
        return node
    return local


async def _agrees(local: LocalText, node: NodeText) -> bool | None:
    """Whether the node gives the same ids and text for the probe; None when it does not answer."""
    with trio.move_on_after(CHECK_TIMEOUT_S), suppress(NodeError, ClientClosed, TimeoutError):
        ids = await node.tokenize(PROBE)
        if ids != await local.tokenize(PROBE):
            return False
        return await node.detokenize(ids) == await local.detokenize(ids)
    return None
