"""What a stage serves (PROTOCOL.md `opened.stage`): one type for the engine, the node and the wire."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Stage:
    """What a stage serves (PROTOCOL.md `opened.stage`)."""

    first: bool
    last: bool
    layers: tuple[int, int]
    n_embd: int
    n_vocab: int
    model: str
    max_step_tokens: int
    eog_tokens: tuple[int, ...]  # end-of-generation token ids (at most 16)
    # What replicas of one layer range compare (neuron_tai.shard_fingerprint); "" when not told.
    fingerprint: str = ""
