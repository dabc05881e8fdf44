"""Incremental detokenization equals detokenizing the whole sequence, on the tiny models' real vocabulary.

The tiny vocabulary is SentencePiece-style with byte fallback (`testkit.models`), so
multi-byte characters arrive one byte token at a time, and pieces carry the leading-space
marker that a first token loses.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.backend import StageBackend
from neuron_tai.text_stream import CONTEXT, WINDOW, TextStream
from testkit.models import vocabulary
from tests.conftest import CONFIG

TOKENS = vocabulary()[0]
N_VOCAB = len(TOKENS)
BYTE0 = TOKENS.index("<0x00>")
TOKENS_OF = {t: [i] for i, t in enumerate(TOKENS)}
PIECES = [i for i, t in enumerate(TOKENS) if t.startswith("\u2581") or (len(t) < 4 and not t.startswith("<"))]


def byte_tokens(text: str) -> list[int]:
    return [BYTE0 + b for b in text.encode()]


# Runs of token ids: any id, the byte tokens of text with multi-byte characters (split
# across tokens), pieces with and without the leading-space marker, and cut characters.
runs = st.one_of(
    st.lists(st.integers(0, N_VOCAB - 1), max_size=6),
    st.text(st.characters(codec="utf-8"), max_size=8).map(byte_tokens),
    st.lists(st.sampled_from(PIECES), max_size=6),
    st.text(st.characters(min_codepoint=0x80, codec="utf-8"), min_size=1, max_size=3).map(
        lambda s: byte_tokens(s)[:-1]  # a character with its last byte missing
    ),
)
sequences = st.lists(runs, max_size=40).map(lambda rs: [t for r in rs for t in r])


@pytest.fixture(scope="module", params=["tiny_model", "tiny_gemma"])
def backend(request: pytest.FixtureRequest) -> Iterator[StageBackend]:
    path: Path = request.getfixturevalue(request.param)
    opened = StageBackend(path, CONFIG)
    yield opened
    opened.close()


def stream_text(backend: StageBackend, tokens: list[int], cuts: list[int]) -> tuple[str, list[int]]:
    """The text a TextStream makes of `tokens` pushed in pieces cut at `cuts`, and the size of each detokenize."""
    sizes: list[int] = []

    async def detokenize(ids: list[int]) -> str:
        sizes.append(len(ids))
        return backend.detokenize(ids)

    async def run() -> str:
        stream = TextStream(detokenize)
        bounds = [0, *sorted(c % (len(tokens) + 1) for c in cuts), len(tokens)]
        pieces = [await stream.push(tokens[a:b]) for a, b in pairwise(bounds)]
        return "".join(pieces) + stream.flush()

    return trio.run(run), sizes


@settings(max_examples=300, deadline=None)
@given(tokens=sequences, cuts=st.lists(st.integers(0, 10_000), max_size=30))
def test_streamed_text_equals_the_whole_sequence_detokenized(
    backend: StageBackend, tokens: list[int], cuts: list[int]
) -> None:
    text, sizes = stream_text(backend, tokens, cuts)
    assert text == backend.detokenize(tokens)
    assert max(sizes, default=0) <= WINDOW + max(len(tokens), 1)


def test_a_character_split_across_tokens_is_held_until_complete(backend: StageBackend) -> None:
    async def detokenize(ids: list[int]) -> str:
        return backend.detokenize(ids)

    async def run() -> list[str]:
        stream = TextStream(detokenize)
        euro = byte_tokens("€")
        return [await stream.push(TOKENS_OF["\u2581the"]), *[await stream.push([t]) for t in euro]]

    assert trio.run(run) == ["the", "", "", "€"]


def test_a_long_stream_costs_token_sized_detokenizes(backend: StageBackend) -> None:
    """2,000 tokens pushed one at a time: 2,000 detokenizes plus one per window slide, none longer
    than the window, instead of 2,000 growing prefixes (about 2 million tokens)."""
    tokens = (byte_tokens("naïve café, ") + TOKENS_OF["\u2581the"] + byte_tokens("日本 🙂 ")) * 100
    tokens = tokens[:2000]
    text, sizes = stream_text(backend, tokens, list(range(2000)))
    assert text == backend.detokenize(tokens)
    assert len(sizes) <= 2000 + 2000 // (WINDOW - CONTEXT)
    assert max(sizes) <= WINDOW + 1
    assert sum(sizes) < 2000 * (WINDOW + 1)
