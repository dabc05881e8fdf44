"""Stage backends of one process driven as a pipeline, the way a chain of nodes would be.

For embedding a whole split model in one program, and for checking that a split
gives the whole model's outputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from engine.backend import Segment, StageBackend
from engine.messages import Output


class LocalChain:
    """Stages in order; one sequence id per stage for each named session."""

    def __init__(self, stages: Sequence[StageBackend]) -> None:
        self.stages = list(stages)
        self.seqs: dict[str, list[int]] = {}
        self.length: dict[str, int] = {}

    def open(self, name: str) -> None:
        self.seqs[name] = [s.open_sequence() for s in self.stages]
        self.length[name] = 0

    def close(self, name: str) -> None:
        for stage, seq in zip(self.stages, self.seqs.pop(name), strict=True):
            stage.close_sequence(seq)

    def step(self, inputs: Mapping[str, Sequence[int]]) -> dict[str, npt.NDArray[np.float32]]:
        """Feed each named session its tokens in one batch per stage; last-row logits back."""
        names = list(inputs)
        carried: list[npt.NDArray[np.float32]] = []
        for i, stage in enumerate(self.stages):
            last = i == len(self.stages) - 1
            out = Output.LOGITS if last else Output.HIDDEN
            segs = []
            for k, name in enumerate(names):
                seq, pos = self.seqs[name][i], self.length[name]
                if i == 0:
                    segs.append(Segment(seq, pos, tokens=np.asarray(inputs[name], np.int32), output=out))
                else:
                    segs.append(Segment(seq, pos, hidden=carried[k], output=out))
            results = stage.decode(segs)
            if last:
                for name in names:
                    self.length[name] += len(inputs[name])
                return {name: r.logits for name, r in zip(names, results, strict=True) if r.logits is not None}
            carried = [r.hidden for r in results if r.hidden is not None]
        raise AssertionError("a pipeline needs at least one stage")

    def greedy(self, prompts: Mapping[str, Sequence[int]], steps: int) -> dict[str, list[npt.NDArray[np.float32]]]:
        """Prefill every prompt in one batch, then decode `steps` greedy tokens per session."""
        for name in prompts:
            self.open(name)
        logits = self.step(prompts)
        trace = {name: [row] for name, row in logits.items()}
        for _ in range(steps):
            logits = self.step({name: [int(np.argmax(trace[name][-1]))] for name in prompts})
            for name, row in logits.items():
                trace[name].append(row)
        return trace
