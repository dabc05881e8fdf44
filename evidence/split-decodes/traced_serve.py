"""`neuron-tai serve` with every split decision of $MIN_ROWS (default 5) or more decode rows written to $DECISIONS:
the rows, the choice, and the costs it was made from. Works on the checkout first on PYTHONPATH,
before 2d74320 (costs by call size: `ms`) and after (by iteration size and choice: `whole`, `halved`)."""

import os
import sys
import time

import engine.call_split as cs

decide = cs.DecodeCallCosts.halves
out = open(os.environ["DECISIONS"], "a", buffering=1)  # noqa: SIM115
least = int(os.environ.get("MIN_ROWS", "5"))


def costs(rule: cs.DecodeCallCosts, rows: int) -> dict[str, list[int]]:
    if hasattr(rule, "ms"):  # before 2d74320: the calls of the size and of its halves
        sizes = {rows, cs.split_at(rows), rows - cs.split_at(rows)}
        return {str(n): [round(x) for x in rule.ms.samples[n]] for n in sorted(sizes) if n in rule.ms}
    return {k: [round(x) for x in getattr(rule, k).samples.get(rows, ())] for k in ("whole", "halved")}


def halves(self: cs.DecodeCallCosts, rows: int) -> bool:
    got = decide(self, rows)
    if rows >= least:
        print(f"{time.monotonic():.3f} decide {rows} -> {got} {costs(self, rows)}", file=out)
    return got


cs.DecodeCallCosts.halves = halves  # type: ignore[method-assign]
from neuron_tai.cli import main  # noqa: E402

sys.exit(main())
