"""Whether an iteration's decodes run as one llama_decode call or as two halves: measured.

Pure (no Trio, no ctypes). A call's cost is not a smooth function of its rows: llama.cpp
picks its matmul kernels by the batch's rows, and some shapes cost more than two calls of
half the rows. Measured on an AMD EPYC (AVX2) with the Llama-3.2-1B shape, decode-only
calls: 7 rows 168 ms, 8 rows 231 ms, two calls of 4 rows 199 ms (ggml-cpu's tiled K-quant
matmul takes over at 8 rows, where it is unprofitable on that CPU for the Q6_K output head);
16 rows 316 ms against 479 ms for two calls of 8. On other CPUs and models the halves cost
more at every size, and then nothing is split.

The policy: keep, for each size of decode-only iteration, the cost of each choice measured as
that choice: the whole call's compute, and a halved iteration from its first call's start to its
second's end, with the hand-over between them (a second call costs the node that too). Not
the halves' sizes measured elsewhere: a 4-row call measured while four sessions decoded, a run
before, is no price for the halves of 8 rows now (the host's speed drifts, contexts grow; on an
AMD EPYC (Zen 4) 4-row calls measured 85-90 ms at the end of such a run kept 8 rows (169 ms)
whole for 32 iterations, and then, at 80-87 ms beside whole calls of 171-180, left the choice
within the margin, where it went back and forth; a halved iteration of 8 rows measured as one
cost 143-147 ms beside whole calls of 162-165). A size's choices
are measured `PROBES` times each, alternating (the whole call first), before they are
compared. A choice's cost is the lower median of its last `RECENT` measurements, not a
running average: one iteration stretched by the machine (the host stalls, the process is
stopped) must not flip a choice. With a running average one 20 s stall made the whole
16-row call look dearer than its halves for thousands of iterations, since the dearer shape
is only measured again at rechecks. The halves are taken when they cost less than `MARGIN` x
the whole call. After that a size's decisions now and then take the other choice, so
a cost that drifted (longer contexts, another process on the cores) is seen again: first
after `RECHECK_EVERY` decisions, then after twice as many each time a recheck leaves the
choice as it was (up to `MAX_RECHECK_EVERY`), and after `RECHECK_EVERY` again once it
changes. A recheck drops the other choice's measurements and runs it `PROBES` times, as
probing does, before the two are compared again: its old costs may come from a bad moment,
and one fresh call among them is outvoted. (A gemma-3-270m node at two sessions took two
whole 2-row calls of 39 and 45 ms, against 24-31 before, right after a recheck; the halves at
27-30 ms then looked cheaper, and later rechecks, adding one fresh 27 ms call each, left the
lower median at 39: it split for most of the run, evidence/split-two-rows/.) A recheck runs
the dearer shape: where a call's cost is mostly a fixed part (reading the weights), two halves
cost nearly two calls, so a recheck every 32 decisions adds about 2/32 to that size's decode
time, and one every 512 about 2/512.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.step_costs import DecodeStepCosts

RECENT = 3  # calls per size whose lower median is its cost: one stall is never the cost
PROBES = 2  # measurements of each choice before a size's choices are compared: one stall is never a cost
RECHECK_EVERY = 32  # decisions before a size first takes the other choice again
MAX_RECHECK_EVERY = 512


def recent_costs() -> DecodeStepCosts:
    """Costs by rows for choosing a call's shape: a size's last `RECENT` calls."""
    return DecodeStepCosts(keep=RECENT)


def rechecked(rechecks: dict[int, Recheck], rows: int, cheaper: bool) -> bool:
    """`cheaper`, the measured choice for `rows`, except at that size's recheck: then the other."""
    recheck = rechecks.setdefault(rows, Recheck(cheaper, RECHECK_EVERY, MAX_RECHECK_EVERY))
    return cheaper != recheck.due(cheaper)


@dataclass(slots=True)
class DecodeCallCosts:
    """Cost (ms) of decode-only iterations by rows, run whole or halved, and the split decision they give."""

    whole: DecodeStepCosts = field(default_factory=recent_costs)  # iterations run as one call
    halved: DecodeStepCosts = field(default_factory=recent_costs)  # iterations run as two calls: both together
    rechecks: dict[int, Recheck] = field(default_factory=dict)  # per size, once both choices are measured

    MIN_ROWS = 2  # fewer rows cannot be split
    MARGIN = 0.95  # split only for a clear gain: the halves within 95% of the whole call

    def observe(self, rows: int, ms: float) -> None:
        """Record one decode-only iteration of `rows` rows (every row one session's next token)
        run as one call."""
        self.whole.observe(rows, ms)

    def observe_halved(self, rows: int, ms: float) -> None:
        """Record one decode-only iteration of `rows` rows run as two calls (`ms`: from the first
        call's start to the second's end)."""
        self.halved.observe(rows, ms)

    def halves(self, rows: int) -> bool:
        """Whether an iteration of `rows` decode rows should run as two calls (of `split_at(rows)`
        rows, then the rest)."""
        if rows < self.MIN_ROWS:
            return False  # nothing to split
        whole, halved = self.whole.count(rows), self.halved.count(rows)
        if min(whole, halved) < PROBES:
            return halved < whole  # probing: the choice measured fewer times, the whole call first
        cheaper = self.halved.cost(rows) < self.MARGIN * self.whole.cost(rows)
        taken = rechecked(self.rechecks, rows, cheaper)
        if taken != cheaper:  # a recheck: the other choice is measured afresh, PROBES times
            (self.halved if taken else self.whole).forget(rows)
        return taken


@dataclass(slots=True)
class Recheck:
    """When one size next takes the other choice: every `every` decisions, from `shortest`,
    twice as long apart (up to `longest`) each time the choice stays the same."""

    choice: bool  # the measured choice at the last decision
    shortest: int
    longest: int
    every: int = field(init=False)  # decisions from one recheck to the next
    since: int = 0  # decisions since the last recheck

    def __post_init__(self) -> None:
        self.every = self.shortest

    def due(self, choice: bool) -> bool:
        """Count one decision whose measured choice is `choice`; whether it is a recheck."""
        if choice != self.choice:
            self.every, self.since = self.shortest, 0  # the costs moved: look again soon
        self.choice = choice
        self.since += 1
        if self.since < self.every:
            return False
        self.every, self.since = min(2 * self.every, self.longest), 0
        return True


def split_at(rows: int) -> int:
    """The first call's rows when `rows` are split: the larger half."""
    return (rows + 1) // 2
