"""Prompt-lookup drafting and the per-session draft policy: pure, checked by properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from neuron_tai.drafting import DraftPolicy, PromptLookup, window_room

histories = st.lists(st.integers(0, 5), max_size=60)  # a small alphabet: many repeats


def is_a_copy(history: list[int], proposal: list[int], lookup: PromptLookup) -> bool:
    """Some n-gram ending the history occurs earlier, and the proposal is what followed it
    (continuing through what it proposed once past the history's end)."""
    extended = history + proposal
    for n in range(lookup.min_ngram, lookup.max_ngram + 1):
        tail = history[len(history) - n :]
        for i in range(len(history) - n):
            if history[i : i + n] == tail and extended[i + n : i + n + len(proposal)] == proposal:
                return True
    return False


@given(histories, st.integers(0, 8))
def test_a_proposal_is_a_copy_of_what_followed_the_tail_earlier(history: list[int], k: int) -> None:
    lookup = PromptLookup()
    proposal = lookup.propose(history, k)
    assert len(proposal) <= k
    if proposal:
        assert len(proposal) == k  # a match always proposes in full (it copies on)
        assert is_a_copy(history, proposal, lookup)


@given(histories, st.integers(1, 8))
def test_nothing_is_proposed_only_when_the_last_token_never_occurred_before(history: list[int], k: int) -> None:
    proposal = PromptLookup().propose(history, k)
    repeated_last = len(history) >= 2 and history[-1] in history[:-1]
    assert bool(proposal) == repeated_last


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=12, unique=True), st.integers(2, 5), st.integers(1, 8))
def test_a_periodic_history_is_continued_exactly(period: list[int], repeats: int, k: int) -> None:
    history = period * repeats + period[:1]
    expected = (period * (repeats + 2 + k))[len(history) : len(history) + k]
    assert PromptLookup().propose(history, k) == expected


@given(histories, st.integers(2, 12), st.integers(1, 8))
def test_a_lookup_reads_only_its_window_of_the_history(history: list[int], window: int, k: int) -> None:
    """What a long session's pass costs is bounded: only the last `window` tokens are searched."""
    proposal = PromptLookup(window=window).propose(history, k)
    recent = history[-window:]
    assert proposal == PromptLookup(window=len(history) + 2).propose(recent, k)
    if proposal:
        assert is_a_copy(recent, proposal, PromptLookup())


def test_the_longest_matching_ngram_wins_over_a_later_shorter_one() -> None:
    # "1 2 3" occurs at 0 followed by 9; "3" alone occurs later followed by 7.
    history = [1, 2, 3, 9, 5, 3, 7, 1, 2, 3]
    assert PromptLookup().propose(history, 1) == [9]
    assert PromptLookup(max_ngram=1).propose(history, 1) == [7]


def test_lookup_sizes_are_checked() -> None:
    with pytest.raises(ValueError):
        PromptLookup(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError):
        PromptLookup(window=1)
    with pytest.raises(ValueError):
        DraftPolicy(max_draft=-1)


outcomes = st.lists(st.tuples(st.integers(0, 8), st.floats(0, 1)), max_size=200)


@given(st.integers(0, 8), outcomes)
def test_the_budget_stays_within_bounds(max_draft: int, passes: list[tuple[int, float]]) -> None:
    policy = DraftPolicy(max_draft)
    for offered, share in passes:
        budget = policy.budget()
        assert 0 <= budget <= max_draft
        drafted = min(budget, offered)
        policy.passed(drafted, int(drafted * share))


@given(st.integers(1, 8))
def test_full_acceptance_keeps_drafting_at_the_most(max_draft: int) -> None:
    policy = DraftPolicy(max_draft)
    for _ in range(50):
        assert policy.budget() == max_draft
        policy.passed(max_draft, max_draft)


@given(st.integers(1, 8), st.integers(100, 2000))
def test_drafts_that_never_pay_are_rare_and_short(max_draft: int, passes: int) -> None:
    """A session whose drafts are always wrong drafts on few passes, one token at a time once
    it has learnt, and still tries again now and then."""
    policy = DraftPolicy(max_draft)
    drafted_passes, drafted_tokens, last_try = 0, 0, 0
    for i in range(passes):
        budget = policy.budget()
        if budget:
            drafted_passes, drafted_tokens, last_try = drafted_passes + 1, drafted_tokens + budget, i
        policy.passed(budget, 0)
    assert drafted_passes <= 2 * max_draft.bit_length() + 2 * (passes // policy.max_pause + 6)
    assert drafted_tokens <= drafted_passes + 2 * max_draft
    assert passes - last_try <= policy.max_pause + 1  # it retries


def test_one_accepted_draft_ends_the_pause_doubling() -> None:
    policy = DraftPolicy(4, patience=1, first_pause=2, max_pause=16)
    for _ in range(3):  # three failed retries: pauses of 2, 4, 8
        while not policy.budget():
            policy.passed(0, 0)
        policy.passed(policy.budget(), 0)
    assert policy.pause == 8
    while not policy.budget():
        policy.passed(0, 0)
    policy.passed(1, 1)
    policy.passed(policy.budget(), 0)
    assert policy.pause == 2  # back to the first pause


@given(st.integers(0, 64), st.integers(0, 4096), st.integers(0, 1024))
def test_drafts_never_reach_a_position_a_sliding_window_has_left(room: int, pos: int, window: int) -> None:
    d = window_room(room, pos, window)
    assert 0 <= d <= room
    if window == 0:
        assert d == room
    else:
        assert d == 0 or pos + d + 1 - window < 0  # no real position can be handed away mid-pass
        assert d == room or pos + d + 2 - window >= 0  # and no fewer drafts than that allows
