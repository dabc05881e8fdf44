"""KV compaction on the real llama.cpp: closed sessions' cells freed, live sessions bit-exact.

Batch-invariant mode holds a closed session's cells (a hole below a live session's cells
would take its next token ahead of its earlier ones, and flash attention sums cells in
cell order); a compaction copies every live sequence out and back, packed, each in its
own order. These tests drive the backend directly, one sequence per call (so batch
shapes match the solo runs), and compare logits bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from engine.backend import ContextConfig, DecodeFailed, DecodeOutcome, Segment, StageBackend
from engine.llama_handles import SeqState
from engine.messages import Output
from tests.conftest import OpenBackend
from tests.test_engine import prompt

# Flash attention on: below 64 query rows its CPU kernel walks a row's visible cells one by one.
FA = ContextConfig(n_seq_max=6, n_ctx=256, n_batch=64, n_ubatch=16, kv_type="f32", flash_attn=True)


class Driver:
    """Feeds sequences of one backend, each call carrying one sequence, and records its logits."""

    def __init__(self, backend: StageBackend) -> None:
        self.backend = backend
        self.seqs: dict[str, int] = {}
        self.last: dict[str, np.ndarray] = {}
        self.trace: dict[str, list[np.ndarray]] = {}

    def open(self, name: str) -> int:
        self.seqs[name] = self.backend.open_sequence()
        self.trace[name] = []
        return self.seqs[name]

    def feed(self, name: str, tokens: list[int]) -> None:
        seq = self.seqs[name]
        for start in range(0, len(tokens), 16):
            chunk = np.array(tokens[start : start + 16], np.int32)
            out = Output.LOGITS if start + 16 >= len(tokens) else Output.NONE
            [result] = self.backend.decode([Segment(seq, self.backend.length(seq), chunk, output=out)])
        assert result.logits is not None
        self.last[name] = result.logits
        self.trace[name].append(result.logits)

    def greedy(self, name: str, steps: int) -> None:
        for _ in range(steps):
            self.feed(name, [int(np.argmax(self.last[name]))])


Between = Callable[[StageBackend, int, int], None]  # what happens to the held cells: (backend, closed, graveyard)


def layout(backend: StageBackend, between: Between) -> dict[str, list[np.ndarray]]:
    """A and C interleave with B; B closes (its cells held under a graveyard), `between` runs,
    then A and C go on."""
    d = Driver(backend)
    for name in "abc":
        d.open(name)
    graveyard = backend.open_sequence()
    d.feed("a", prompt(1, 10))
    d.feed("b", prompt(2, 12))
    d.greedy("a", 3)
    d.feed("c", prompt(3, 8))
    d.greedy("a", 3)
    d.greedy("c", 2)
    backend.retire_sequence(d.seqs["b"], graveyard)
    between(backend, d.seqs["b"], graveyard)
    for _ in range(10):
        d.greedy("a", 1)
        d.greedy("c", 1)
    return {name: d.trace[name] for name in ("a", "c")}


def layout_solo(backend: StageBackend, name: str) -> list[np.ndarray]:
    """`layout`'s A or C alone."""
    d = Driver(backend)
    d.open(name)
    d.feed(name, prompt(1, 10) if name == "a" else prompt(3, 8))
    d.greedy(name, 16 if name == "a" else 12)
    return d.trace[name]


def held(backend: StageBackend, closed: int, graveyard: int) -> None:
    """What batch-invariant mode did before compaction: keep the cells until nobody is open."""


def compacted(backend: StageBackend, closed: int, graveyard: int) -> None:
    result = backend.compact(graveyard)
    assert result.failure is None and not result.lost
    assert result.cells == 16 + 10  # A's 16 positions and C's 10 moved, B's 12 freed


def freed(backend: StageBackend, closed: int, graveyard: int) -> None:
    """The hazard: free B's cells in place, leaving a hole below A's and C's later cells."""
    backend.release_graveyard(graveyard)


Traces = Callable[[Path, Between | None], dict[str, list[np.ndarray]]]


@pytest.fixture
def traces(open_backend: OpenBackend) -> Iterator[Traces]:
    """`layout` on a fresh backend; with None, A and C alone, each on a backend of its own."""

    def run(path: Path, between: Between | None) -> dict[str, list[np.ndarray]]:
        if between is None:
            return {name: layout_solo(open_backend(path, FA), name) for name in "ac"}
        return layout(open_backend(path, FA), between)

    yield run


@pytest.mark.parametrize("model", ["tiny_model", "tiny_quant", "tiny_gemma"])
def test_compaction_keeps_live_sequences_bit_exact(model: str, traces: Traces, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(model)
    solo = traces(path, None)
    for between in (held, compacted):
        got = traces(path, between)
        for name in solo:
            assert len(got[name]) == len(solo[name])
            for step, (x, y) in enumerate(zip(got[name], solo[name], strict=True)):
                assert np.array_equal(x, y), f"{between.__name__}: {name} step {step} differs by {np.abs(x - y).max()}"


@pytest.mark.parametrize("model", ["tiny_model", "tiny_quant", "tiny_gemma"])
def test_freeing_held_cells_in_place_changes_live_outputs(
    model: str, traces: Traces, request: pytest.FixtureRequest
) -> None:
    """The hazard compaction avoids: a hole below a live sequence's cells takes its next tokens."""
    path: Path = request.getfixturevalue(model)
    solo, got = traces(path, None), traces(path, freed)
    assert any(not np.array_equal(x, y) for name in solo for x, y in zip(got[name], solo[name], strict=True))


@pytest.mark.parametrize("model", ["tiny_model", "tiny_gemma"])
def test_compaction_frees_the_held_cells(model: str, open_backend: OpenBackend, request: pytest.FixtureRequest) -> None:
    """256 cells: A holds 60, closed B's 150 are held; a 60-row call finds no slot until compacted."""
    backend = open_backend(request.getfixturevalue(model), FA)
    d = Driver(backend)
    for name in ("a", "b", "new"):
        d.open(name)
    graveyard = backend.open_sequence()
    d.feed("a", prompt(1, 60))
    d.feed("b", prompt(2, 150))
    backend.retire_sequence(d.seqs["b"], graveyard)
    rows = Segment(d.seqs["new"], 0, np.array(prompt(3, 60), np.int32))
    with pytest.raises(DecodeFailed) as failed:
        backend.decode([rows])
    assert failed.value.outcome is DecodeOutcome.NO_KV_SLOT and backend.length(d.seqs["new"]) == 0
    result = backend.compact(graveyard)
    assert result.failure is None and result.kept == (d.seqs["a"],) and result.cells == 60
    backend.decode([rows])
    assert backend.length(d.seqs["new"]) == 60


def test_a_copy_that_cannot_be_taken_changes_nothing(
    tiny_model: Path, open_backend: OpenBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = open_backend(tiny_model, FA)
    d = Driver(backend)
    d.open("a")
    graveyard = backend.open_sequence()
    d.feed("a", prompt(1, 20))
    taken = backend.ctx.seq_state
    monkeypatch.setattr(backend.ctx, "seq_state", lambda seq, **kw: (SeqState.SHORT, taken(seq, **kw)[1]))
    result = backend.compact(graveyard)
    assert result.failure is not None and "short" in result.failure and not result.kept
    assert backend.ctx.seq_pos_max(d.seqs["a"]) == 19 and backend.length(d.seqs["a"]) == 20


@pytest.mark.parametrize("model", ["tiny_model", "tiny_gemma"])
def test_a_copy_llama_cpp_refuses_loses_only_its_sequence(
    model: str, open_backend: OpenBackend, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """A truncated copy: llama.cpp claims cells for it, then fails reading its rows. The others
    are put back packed from an empty cache again, bit-exact; the refused one is empty."""
    path: Path = request.getfixturevalue(model)
    solo = {name: layout_solo(open_backend(path, FA), name) for name in "ac"}
    backend = open_backend(path, FA)
    put = backend.ctx.set_seq_state
    victim = 1  # B's sequence id in `layout`: open second, closed, so reopen it as the victim below

    def truncated(seq: int, blob: np.ndarray, **kw: bool) -> SeqState:
        return put(seq, blob[:-1] if seq == victim else blob, **kw)

    def compact_losing_victim(backend: StageBackend, closed: int, graveyard: int) -> None:
        d = Driver(backend)
        assert d.open("v") == victim == closed  # the freed id, reused
        d.feed("v", prompt(4, 9))
        monkeypatch.setattr(backend.ctx, "set_seq_state", truncated)
        result = backend.compact(graveyard)
        assert result.failure is None and result.lost == (victim,) and victim not in result.kept
        assert backend.length(victim) == 0 and backend.ctx.seq_pos_max(victim) == -1

    got = layout(backend, compact_losing_victim)
    for name, logits in solo.items():
        assert all(np.array_equal(x, y) for x, y in zip(got[name], logits, strict=True)), name


def test_a_sliding_window_sequence_keeps_its_window_and_a_one_token_retry(
    tiny_gemma: Path, open_backend: OpenBackend
) -> None:
    """llama.cpp copies only the window's cells (the last n_swa = 4 positions): after a
    compaction the last token can still be computed again, bit for bit, and no further back."""
    backend = open_backend(tiny_gemma, FA)
    d = Driver(backend)
    seq = d.open("a")
    graveyard = backend.open_sequence()
    d.feed("a", prompt(1, 12))
    d.greedy("a", 8)  # 20 positions
    token = int(np.argmax(d.trace["a"][-2]))  # the token fed at position 19
    assert backend.compact(graveyard).kept == (seq,)
    assert backend.ctx.seq_pos_min(seq) == 16 and backend.length(seq) == 20
    assert not backend.can_rewind(seq, 18) and backend.can_rewind(seq, 19)
    backend.rewind(seq, 19)
    d.feed("a", [token])
    assert np.array_equal(d.trace["a"][-1], d.trace["a"][-2])
