"""The replica book's placement and backoff, as properties over random histories (no sockets)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_tai.replica_book import ReplicaBook, ReplicaState

Event = tuple[str, int, float, bool]  # (what, replica, time step, connected flip)

events = st.lists(
    st.tuples(
        st.sampled_from(["place", "release", "fail", "succeed", "flip", "mismatch"]),
        st.integers(0, 3),
        st.floats(0.0, 3.0),
        st.booleans(),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), events)
def test_a_session_goes_only_to_an_up_replica_and_to_the_least_loaded(count: int, history: list[Event]) -> None:
    book = ReplicaBook(count)
    now, connected = 0.0, [True] * count
    for what, raw, dt, flip in history:
        i, now = raw % count, now + dt
        if what == "place":
            chosen = book.choose(now, connected)
            states = [book.state(j, now, connected[j]) for j in range(count)]
            if chosen is None:
                assert not any(connected[j] and states[j] is not ReplicaState.MISMATCH for j in range(count))
                continue
            assert connected[chosen] and states[chosen] is not ReplicaState.MISMATCH
            if ReplicaState.UP in states:  # a replica in backoff is chosen only when none is up
                assert states[chosen] is ReplicaState.UP
                loads = [book.records[j].sessions for j in range(count) if states[j] is ReplicaState.UP]
                assert book.records[chosen].sessions == min(loads)
            book.place(chosen)
        elif what == "release":
            book.release(i)
        elif what == "fail":
            backoff = book.failed(i, now)
            assert book.state(i, now, connected[i]) is not ReplicaState.UP
            assert (
                book.state(i, now + backoff, connected[i]) is ReplicaState.UP
                or not connected[i]
                or (book.records[i].mismatch)
            )
        elif what == "succeed":
            book.succeeded(i)
        elif what == "flip":
            connected[i] = flip
        else:
            book.mismatched(i)
        assert all(r.sessions >= 0 for r in book.records)
        assert book.choose(now, connected, exclude=frozenset(range(count))) is None


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(0, 200))
def test_load_spreads_evenly_over_up_replicas(count: int, sessions: int) -> None:
    book = ReplicaBook(count)
    for _ in range(sessions):
        chosen = book.choose(0.0, [True] * count)
        assert chosen is not None
        book.place(chosen)
    loads = [r.sessions for r in book.records]
    assert max(loads) - min(loads) <= 1


@given(st.integers(1, 12))
def test_backoff_doubles_in_a_row_up_to_its_cap_and_resets_on_success(failures: int) -> None:
    book = ReplicaBook(1, base_backoff_s=0.5, max_backoff_s=15.0)
    backoffs = [book.failed(0, 100.0 * k) for k in range(failures)]  # each after the last has passed
    assert backoffs == [min(15.0, 0.5 * 2**k) for k in range(failures)]
    book.succeeded(0)
    assert book.failed(0, 10_000.0) == 0.5
    assert book.records[0].failures == failures + 1


def test_a_mismatched_replica_is_never_chosen() -> None:
    book = ReplicaBook(2)
    book.mismatched(0)
    assert [book.choose(0.0, [True, True]) for _ in range(3)] == [1, 1, 1]
    book.mismatched(1)
    assert book.choose(0.0, [True, True]) is None
    assert book.state(0, 0.0, True) is ReplicaState.MISMATCH


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=80))
def test_with_every_replica_up_sessions_spread_evenly(count: int, history: list[tuple[bool, int]]) -> None:
    """With every replica up, `placed` counts every placement, and when sessions only arrive
    the replicas' placements differ by at most one."""
    book = ReplicaBook(count)
    connected = [True] * count
    placed = [0] * count
    for opening, raw in history:
        if opening:
            chosen = book.choose(0.0, connected)
            assert chosen is not None
            book.place(chosen)
            placed[chosen] += 1
        elif book.records[raw % count].sessions:
            book.release(raw % count)
    assert [r.placed for r in book.records] == placed
    if all(opening for opening, _ in history):
        assert max(placed) - min(placed) <= 1
