"""Speculative generation: `out: "tokens"`, verification through the chain, exactness.

Real llama.cpp on the tiny models the suite writes. Greedy identity is checked bit for bit
in batch-invariant mode (DESIGN.md: a verification step rounds like padded decode steps
there); the sampled distribution is checked statistically with fixed seeds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.backend import Segment, StageBackend
from engine.messages import Output
from neuron_tai.client import open_client
from protocol.sampling import Sampling
from tests.conftest import OpenBackend
from tests.test_generate import chain
from tests.test_node import node_and_client, prompt

IDS = prompt(3, 12)
DRAFTS = [7, 19, 7, 101, 55]


def one_by_one(backend: StageBackend, seq: int, pos: int, tokens: list[int]) -> list[int]:
    """What `Output.TOKEN` steps of one row each sample, fed `tokens` in turn from `pos`."""
    out = []
    for i, t in enumerate(tokens):
        seg = Segment(seq, pos + i, tokens=np.array([t], np.int32), output=Output.TOKEN)
        result = backend.decode([seg])[0]
        assert result.token is not None
        out.append(result.token)
    return out


def test_every_rows_token_is_what_a_one_row_step_would_sample(tiny_model: Path, open_backend: OpenBackend) -> None:
    backend = open_backend(tiny_model)
    for sampling in (Sampling(), Sampling(temperature=1.5, top_k=40, top_p=0.9, seed=11)):
        many, single = backend.open_sequence(sampling), backend.open_sequence(sampling)
        for seq in (many, single):
            backend.decode([Segment(seq, 0, tokens=np.array(IDS, np.int32))])
        seg = Segment(many, len(IDS), tokens=np.array(DRAFTS, np.int32), output=Output.TOKENS)
        rows = backend.decode([seg])[0].tokens
        assert rows is not None and rows.dtype == np.int32
        assert rows.tolist() == one_by_one(backend, single, len(IDS), DRAFTS)
        # A rewind drops what it drops: the sampler keeps nothing of the dropped rows.
        backend.rewind(many, len(IDS) + 2)
        again = Segment(many, len(IDS) + 2, tokens=np.array(DRAFTS[2:], np.int32), output=Output.TOKENS)
        assert backend.decode([again])[0].tokens.tolist() == rows[2:].tolist()  # type: ignore[union-attr]
        backend.close_sequence(many)
        backend.close_sequence(single)


def test_sampled_rows_differ_from_greedy_rows(tiny_model: Path, open_backend: OpenBackend) -> None:
    """The sampled path really samples (else the test above could not tell the two apart)."""
    backend = open_backend(tiny_model)
    got = []
    for sampling in (Sampling(), Sampling(temperature=3.0, seed=5)):
        seq = backend.open_sequence(sampling)
        tokens = np.array(IDS + DRAFTS * 3, np.int32)
        got.append(backend.decode([Segment(seq, 0, tokens=tokens, output=Output.TOKENS)])[0].tokens.tolist())  # type: ignore[union-attr]
        backend.close_sequence(seq)
    assert got[0] != got[1]


async def test_a_tokens_step_on_a_node_and_through_a_chain(tiny_model: Path, tiny_shards2: list[Path]) -> None:
    async with node_and_client(tiny_model) as (_node, one):
        await one.open("s", 64)
        r = await one.step("s", 0, tokens=IDS + DRAFTS, out="tokens")
        assert r.tokens is not None and len(r.tokens) == len(IDS) + len(DRAFTS)
        last = await one.step("s", 0, tokens=IDS + DRAFTS, out="token")  # a retry: rewinds to 0
        assert last.token == r.tokens[-1]
        expected = r.tokens
    async with chain(tiny_shards2) as (head, _tail), open_client(head.address, timeout_s=10) as c:
        await c.open("s", 64)
        assert (await c.step("s", 0, tokens=IDS + DRAFTS, out="tokens")).tokens == expected
