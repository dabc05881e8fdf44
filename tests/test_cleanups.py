"""Cleanup merging (engine/cleanups.py): what waits is bounded by what exists, and nothing asked is lost."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given
from hypothesis import strategies as st

from engine.cleanups import CleanupQueue, cleanup_key, tell
from engine.messages import Cleanup, CloseRequest, DropOwner, Rollback

OWNERS = ("a", "b")
SESSIONS = ("s", "t")

cleanups = st.one_of(
    st.builds(CloseRequest, st.sampled_from(OWNERS), st.sampled_from(SESSIONS)),
    st.builds(Rollback, st.sampled_from(OWNERS), st.sampled_from(SESSIONS), st.integers(0, 20)),
    st.builds(DropOwner, st.sampled_from(OWNERS)),
)


@given(st.lists(cleanups, max_size=30))
def test_merged_cleanups_are_one_per_key_and_cover_everything_asked(asked: list[Cleanup]) -> None:
    queue = CleanupQueue()
    for request in asked:
        queue.add(request, None)
    keys = list(dict.fromkeys(cleanup_key(r) for r in asked))  # first-arrival order
    assert len(queue) == len(keys) <= len(OWNERS) * (len(SESSIONS) + 1)
    taken = list(queue.take_all())
    assert [cleanup_key(p.request) for p in taken] == keys and len(queue) == 0
    for pending in taken:
        mine = [r for r in asked if cleanup_key(r) == cleanup_key(pending.request)]
        closes = [r for r in mine if isinstance(r, CloseRequest)]
        assert pending.closes == len(closes)  # every close is answered once
        if closes:  # a close covers any rollback of its session
            assert pending.request == closes[0]
        elif isinstance(pending.request, Rollback):  # of rollbacks, the one going back furthest
            assert pending.request.pos == min(r.pos for r in mine if isinstance(r, Rollback))
        else:
            assert pending.request == mine[0]


@given(st.lists(cleanups, min_size=1, max_size=10))
def test_listeners_of_merged_closes_are_told_once_that_the_session_existed(asked: list[Cleanup]) -> None:
    queue = CleanupQueue()
    told: list[tuple[int, bool]] = []

    def listener(i: int) -> Callable[[bool], None]:
        return lambda existed: told.append((i, existed))

    for i, request in enumerate(asked):
        queue.add(request, listener(i))
    for pending in queue.take_all():
        tell(pending.listeners, True)
    assert sorted(i for i, _ in told) == list(range(len(asked)))
    assert sum(existed for _, existed in told) == len({cleanup_key(r) for r in asked})


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 3)), min_size=1, max_size=12))
def test_of_rollbacks_of_one_session_the_newest_opening_wins(undone: list[tuple[int, int]]) -> None:
    """A step of a session closed and opened again since is not undone in the session of now:
    merged, the rollbacks of the newest opening stand, the one going back furthest of them."""
    queue = CleanupQueue()
    for pos, opening in undone:
        queue.add(Rollback("a", "s", pos, opening), None)
    (pending,) = queue.take_all()
    newest = max(opening for _, opening in undone)
    assert isinstance(pending.request, Rollback) and pending.request.opening == newest
    assert pending.request.pos == min(pos for pos, opening in undone if opening == newest)
