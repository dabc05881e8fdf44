"""Window pins: a step on a sliding-window model can be undone whatever other sequences do meanwhile."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.backend import ContextConfig, Segment, StageBackend
from engine.messages import Output
from engine.window_pins import LLAMA_MAX_SEQ, context_sequences, pin_range
from protocol.errors import ErrorCode, Fault
from tests.conftest import OpenBackend
from tests.test_backend import prompts


@given(st.integers(0, 5000), st.integers(1, 600), st.integers(1, 1024))
def test_the_pin_holds_exactly_what_undoing_the_step_needs_and_the_window_let_go(pos: int, n: int, window: int) -> None:
    # llama.cpp may reuse a cell of position p once p <= pos_max + 1 - window (is_masked_swa).
    released_by_step = set(range(max(0, pos + 1 - window), max(0, pos + n + 1 - window)))
    needed_after_undo = set()
    for r in range(pos, pos + n + 1):  # undo back to any position of the step
        needed_after_undo |= set(range(max(0, r + 1 - window), r))
    span = pin_range(pos, n, window)
    pinned = set(range(*span)) if span else set()
    assert pinned == released_by_step & needed_after_undo
    assert len(pinned) <= n


def test_a_pin_sequence_each_only_on_sliding_window_models_and_within_llama_cpps_ids() -> None:
    assert context_sequences(8, 512) == 16
    assert context_sequences(8, 0) == 8
    assert context_sequences(LLAMA_MAX_SEQ // 2 + 1, 512) == LLAMA_MAX_SEQ // 2 + 1  # no room: no pins


# The window cache holds pad256(n_swa * n_seq_max + n_ubatch) = 256 cells: after 300 tokens of
# sequence a, every cell is taken, most by positions a's window has left, and the 272 tokens
# of sequence b that follow reuse them in order, up to the ones a's last step pushed out.
CONFIG = ContextConfig(n_seq_max=2, n_ctx=1024, n_batch=16, n_ubatch=16, kv_type="f32", flash_attn=False)
TOKENS = np.array(prompts(21, [320])["s0"], np.int32)
OTHER = np.array(prompts(22, [272])["s0"], np.int32)


def fill(backend: StageBackend, seq: int, tokens: np.ndarray, start: int = 0) -> None:
    for at in range(0, len(tokens), 16):
        backend.decode([Segment(seq, start + at, tokens=tokens[at : at + 16])])


def undo_a_draft_step_after_another_sequence_ran(backend: StageBackend) -> np.ndarray:
    """Sequence a steps 6 rows at 300 (a token and 5 drafts), b runs 272 tokens, a goes back to 301."""
    a = backend.open_sequence()
    fill(backend, a, TOKENS[:300])
    backend.decode([Segment(a, 300, tokens=TOKENS[300:306])])
    b = backend.open_sequence()
    fill(backend, b, OTHER)
    backend.rewind(a, 301)
    logits = backend.decode([Segment(a, 301, tokens=TOKENS[301:302], output=Output.LOGITS)])[0].logits
    assert logits is not None
    return logits


def test_a_multi_row_step_can_be_undone_after_other_sequences_took_the_window_cells(
    tiny_gemma: Path, open_backend: OpenBackend
) -> None:
    unpinned = open_backend(tiny_gemma, CONFIG)
    assert unpinned.info.n_swa == 4 and unpinned.pins is not None
    unpinned.pins = None  # as llama.cpp would do it alone: the scenario really takes the cells
    with pytest.raises(Fault) as refused:
        undo_a_draft_step_after_another_sequence_ran(unpinned)
    assert refused.value.code is ErrorCode.POSITION and "sliding-window" in str(refused.value)

    pinned = open_backend(tiny_gemma, CONFIG)
    after_undo = undo_a_draft_step_after_another_sequence_ran(pinned)
    reference = open_backend(tiny_gemma, CONFIG)
    seq = reference.open_sequence()
    fill(reference, seq, TOKENS[:301])
    expected = reference.decode([Segment(seq, 301, tokens=TOKENS[301:302], output=Output.LOGITS)])[0].logits
    assert expected is not None
    np.testing.assert_allclose(after_undo, expected, rtol=1e-5, atol=1e-5)


def test_a_step_split_over_two_calls_can_be_undone_into_its_first_part(
    tiny_gemma: Path, open_backend: OpenBackend
) -> None:
    """A verification the scheduler cut in two (a prefill budget, batch-invariant chunk bounds): its
    second part keeps the first part's pin, so going back into the first part still works."""
    backend = open_backend(tiny_gemma, CONFIG)
    a = backend.open_sequence()
    fill(backend, a, TOKENS[:300])
    backend.decode([Segment(a, 300, tokens=TOKENS[300:302])])
    backend.decode([Segment(a, 302, tokens=TOKENS[302:306], continues=True)])
    fill(backend, backend.open_sequence(), OTHER)
    backend.rewind(a, 301)
    after_undo = backend.decode([Segment(a, 301, tokens=TOKENS[301:302], output=Output.LOGITS)])[0].logits
    reference = open_backend(tiny_gemma, CONFIG)
    seq = reference.open_sequence()
    fill(reference, seq, TOKENS[:301])
    expected = reference.decode([Segment(seq, 301, tokens=TOKENS[301:302], output=Output.LOGITS)])[0].logits
    assert after_undo is not None and expected is not None
    np.testing.assert_allclose(after_undo, expected, rtol=1e-5, atol=1e-5)


def test_pins_go_with_their_step_so_they_never_accumulate(tiny_gemma: Path, open_backend: OpenBackend) -> None:
    backend = open_backend(tiny_gemma, CONFIG)
    assert backend.pins is not None
    a = backend.open_sequence()
    fill(backend, a, TOKENS[:64])
    pin = backend.pins.base + a
    # The last step, 16 rows at 48, pushed positions 45..60 out of the window: all held.
    assert (backend.ctx.seq_pos_min(pin), backend.ctx.seq_pos_max(pin)) == (45, 60)
    backend.decode([Segment(a, 64, tokens=TOKENS[64:65])])
    assert backend.ctx.seq_pos_min(pin) == 61 and backend.ctx.seq_pos_max(pin) == 61  # one row: one position
    backend.rewind(a, 60)
    assert backend.ctx.seq_pos_max(pin) == -1  # back inside the window: nothing to hold
    backend.decode([Segment(a, 60, tokens=TOKENS[60:62])])
    backend.close_sequence(a)
    assert backend.ctx.seq_pos_max(pin) == -1 and backend.pins.pinned == set()
