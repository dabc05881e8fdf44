"""What the engine is asked and what it answers: plain frozen data, no transport, no Trio.

A leaf: it imports neither llama.cpp nor the backend, so the node, the scheduler's
tests and any client of the engine can use these types without loading a model
library. The backend takes `Output` and `Refused` from here.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from protocol.errors import Fault
from protocol.sampling import GREEDY, Sampling

Owner = Hashable  # the connection a session belongs to


class Output(enum.Enum):
    """What a step (or one segment of a batch) wants back."""

    NONE = "none"  # a prefill chunk that is not the last of its step
    HIDDEN = "hidden"  # every row's hidden state (non-last stages)
    LOGITS = "logits"  # the last row's logits (last stage)
    TOKEN = "token"  # a token sampled from the last row (last stage)
    PAD = "pad"  # padding rows: computed as outputs (fixed batch shape), nothing returned


Refused = Fault  # a request refused before llama.cpp saw it; nothing changed


@dataclass(frozen=True, slots=True)
class OpenRequest:
    owner: Owner
    session: str
    max_tokens: int
    sampling: Sampling = GREEDY
    wait_ms: int = 0


@dataclass(frozen=True, slots=True)
class StepRequest:
    owner: Owner
    session: str
    pos: int
    out: Output
    tokens: npt.NDArray[np.int32] | None = None
    hidden: npt.NDArray[np.float32] | None = None

    @property
    def n(self) -> int:
        data = self.tokens if self.tokens is not None else self.hidden
        return 0 if data is None else len(data)

    @property
    def nbytes(self) -> int:
        data = self.tokens if self.tokens is not None else self.hidden
        return 0 if data is None else int(data.nbytes)


@dataclass(frozen=True, slots=True)
class CloseRequest:
    owner: Owner
    session: str


@dataclass(frozen=True, slots=True)
class Rollback:
    """Undo a completed step whose result could not be delivered downstream: back to `pos`."""

    owner: Owner
    session: str
    pos: int


@dataclass(frozen=True, slots=True)
class DropOwner:
    """The owner's connection is gone: free all its sessions."""

    owner: Owner


Request = OpenRequest | StepRequest | CloseRequest | Rollback | DropOwner


@dataclass(frozen=True, slots=True)
class Opened:
    session: str
    kv_reserved: int


@dataclass(frozen=True, slots=True)
class StepDone:
    session: str
    pos: int
    n: int
    out: Output
    hidden: npt.NDArray[np.float32] | None = None
    logits: npt.NDArray[np.float32] | None = None
    token: int | None = None
    length: int = 0  # the session's length after the step
    max_tokens: int = 0  # the session's `max_tokens`


@dataclass(frozen=True, slots=True)
class Closed:
    session: str
    existed: bool


Failure = Fault  # what a request is answered with instead of a result


Result = Opened | StepDone | Closed | Failure

# Requests that only free what exists: the engine takes them even when its inbox is full
# or it is draining (Engine.cleanup), so an undo the requester was promised always happens.
Cleanup = CloseRequest | Rollback | DropOwner
