"""Bursts (pure): a stage fed by another learns who comes together, and waits exactly until they have."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.bursts import Bursts

GAP = 0.001


def arrive(bursts: Bursts, groups: list[list[int]], start: float, alive: set[int]) -> float:
    """Each group's steps 0.1 ms apart, groups 10 ms apart; the time after the last."""
    now = start
    for group in groups:
        for key in group:
            bursts.arrived(key, now, alive)
            now += 0.0001
        now += 0.01
    return now


@given(st.lists(st.integers(0, 15), min_size=1, max_size=8, unique=True), st.data())
def test_a_burst_is_whole_exactly_when_all_its_living_members_are_back(group: list[int], data: st.DataObject) -> None:
    alive = set(range(16))
    bursts = Bursts(GAP)
    now = arrive(bursts, [group], 0.0, alive)
    assert bursts.missing(set(group), alive) is None  # the first time nothing is known: the pause decides
    back = data.draw(st.sets(st.sampled_from(group), min_size=1))
    gone = data.draw(st.sets(st.sampled_from(group)))
    arrive(bursts, [sorted(back)], now, alive)  # the next burst starts: the first one is remembered
    living = alive - gone
    assert bursts.missing(back, living) is (not set(group) & living <= back)


@given(st.lists(st.lists(st.integers(0, 63), min_size=1, max_size=20), min_size=1, max_size=20))
def test_only_open_sessions_are_remembered(groups: list[list[int]]) -> None:
    """A flood of steps for sessions that are not open makes nothing grow."""
    alive = set(range(8))
    bursts = Bursts(GAP)
    arrive(bursts, groups, 0.0, alive)
    assert bursts.current <= alive and set(bursts.last) <= alive
    assert all(a | b <= alive for a, b in bursts.last.values())


def test_a_step_nobody_came_with_is_whole_alone_and_unknown_mates_leave_it_to_the_pause() -> None:
    alive = {1, 2, 3}
    bursts = Bursts(GAP)
    now = arrive(bursts, [[1], [2, 3]], 0.0, alive)
    arrive(bursts, [[1]], now, alive)
    assert bursts.missing({1}, alive) is False  # it came alone last time: nobody to wait for
    assert bursts.missing({2}, alive) is True  # 3 came with it and is not back: wait for it
    assert bursts.missing({2, 3}, alive) is False
    assert bursts.missing({2, 3}, {2}) is False  # 3 is gone: nobody waits for it
    assert bursts.missing(set(), alive) is None
    assert Bursts(GAP).missing({1}, alive) is None


def test_one_group_seen_in_two_pieces_still_waits_for_the_whole_group() -> None:
    alive = {1, 2, 3, 4}
    bursts = Bursts(GAP)
    now = arrive(bursts, [[1, 2, 3, 4], [1, 2], [3, 4]], 0.0, alive)  # the second time, in two pieces
    arrive(bursts, [[1, 2]], now, alive)
    assert bursts.missing({1, 2}, alive) is True  # 3 and 4 came with them the time before
    assert bursts.mates(1) == frozenset({1, 2, 3, 4})


def test_two_groups_seen_as_one_are_told_apart_two_bursts_later() -> None:
    alive = set(range(8))
    bursts = Bursts(GAP)
    a, b = [0, 1, 2, 3], [4, 5, 6, 7]
    now = arrive(bursts, [a + b, a, b, a, b], 0.0, alive)
    arrive(bursts, [[0]], now, alive)  # the last `b` is finished
    assert bursts.missing(set(a), alive) is False and bursts.missing(set(b), alive) is False


def test_prompts_make_no_bursts() -> None:
    """The first decodes after the prompts wait for the pause: a prompt came alone."""
    alive = {1, 2}
    bursts = Bursts(GAP)
    bursts.arrived(1, 0.0, alive, decode=False)
    bursts.arrived(2, 0.01, alive, decode=False)
    bursts.arrived(1, 0.02, alive)
    assert bursts.mates(1) is None and bursts.missing({1}, alive) is None
