"""Where each layer range goes: an exact dynamic program over measured costs.

A chain runs at the pace of its slowest stage, so a split is as good as the time of its
slowest stage per request. Given what each layer costs per decoded and per prefilled row,
what the embedding lookup (first stage) and the output head (last stage) cost, what each
layer holds in memory, and each host's relative speed and memory budget, `plan` chooses
contiguous layer ranges, one per host in the given order, that minimise the slowest stage's
time under every host's budget; among the splits that reach it, the most even one (least
sum of squared stage times). Both passes are exact: O(stages x layers^2).

Pure: no Trio, no llama.cpp. The costs come from neuron_tai/layer_costs.py or a JSON file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Host",
    "ModelCosts",
    "PlacementError",
    "Plan",
    "RowCosts",
    "StagePlan",
    "Workload",
    "evaluate",
    "plan",
]

_SLACK = 1e-9  # relative: a stage time this close to the optimum counts as reaching it


class PlacementError(ValueError):
    """No split satisfies the request; the message says what does not fit."""


@dataclass(frozen=True, slots=True)
class RowCosts:
    """Seconds per row: in a decode step (one row per session) and in a prefill chunk."""

    decode: float
    prefill: float

    def __post_init__(self) -> None:
        if not (self.decode >= 0 and self.prefill >= 0 and math.isfinite(self.decode + self.prefill)):
            raise ValueError(f"row costs must be finite and non-negative, got {self.decode}, {self.prefill}")


@dataclass(frozen=True, slots=True)
class ModelCosts:
    """What running a model costs, per part, on a reference machine (speed 1).

    `head.prefill` is per prompt token although only a prompt's last row is projected onto
    the vocabulary: it is what the last stage's prefill chunks cost beyond their layers.
    `stage` is what every stage pays per row whatever its layers (the call, the input, the
    output rows). `head_bytes` is the vocabulary projection only the last stage reads.
    """

    layers: tuple[RowCosts, ...]
    embedding: RowCosts
    head: RowCosts
    stage: RowCosts
    weight_bytes: tuple[int, ...]
    kv_bytes_per_cell: tuple[int, ...]
    head_bytes: int = 0

    def __post_init__(self) -> None:
        n = len(self.layers)
        if n == 0 or len(self.weight_bytes) != n or len(self.kv_bytes_per_cell) != n:
            raise ValueError("layers, weight_bytes and kv_bytes_per_cell need one entry per layer (at least one)")


@dataclass(frozen=True, slots=True)
class Host:
    """A machine of the chain: its speed relative to the machine the costs were measured on
    (2.0: twice as fast), and the bytes it can give a stage (None: no limit)."""

    speed: float = 1.0
    memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if not (self.speed > 0 and math.isfinite(self.speed)):
            raise ValueError(f"a host's speed must be a positive number, got {self.speed}")


@dataclass(frozen=True, slots=True)
class Workload:
    """The mix a plan is for: prompt and generated tokens per request, and the KV cells each stage holds."""

    prefill_tokens: float = 16
    decode_tokens: float = 128
    kv_cells: int = 4096

    def __post_init__(self) -> None:
        if self.prefill_tokens < 0 or self.decode_tokens < 0 or self.prefill_tokens + self.decode_tokens <= 0:
            raise ValueError("a workload needs a positive number of tokens (prefill + decode)")
        if self.kv_cells < 0:
            raise ValueError(f"kv_cells must not be negative, got {self.kv_cells}")


@dataclass(frozen=True, slots=True)
class StagePlan:
    layers: tuple[int, int]  # [start, end)
    seconds: float  # predicted time per request on its host
    share: float  # this stage's part of the whole chain's time (the shares sum to 1)
    load: float  # this stage's time over the slowest stage's: how busy it is when the chain is saturated
    memory_bytes: int  # weights + KV (+ the head's projection on the last stage)


@dataclass(frozen=True, slots=True)
class Plan:
    stages: tuple[StagePlan, ...]
    slowest_seconds: float  # the chain's time per request when saturated
    efficiency_bound: float  # total stage time / (stages x slowest stage): the mean load, in (0, 1]

    @property
    def bounds(self) -> list[tuple[int, int]]:
        return [s.layers for s in self.stages]


class _Model:
    """Prefix sums of the costs for one workload, so a range's time and memory are O(1)."""

    def __init__(self, costs: ModelCosts, work: Workload) -> None:
        p, d = work.prefill_tokens, work.decode_tokens

        def per_request(c: RowCosts) -> float:
            return p * c.prefill + d * c.decode

        self.n = len(costs.layers)
        self.time = _prefix([per_request(c) for c in costs.layers])
        held = zip(costs.weight_bytes, costs.kv_bytes_per_cell, strict=True)
        self.bytes = _prefix([w + k * work.kv_cells for w, k in held])
        self.stage, self.embedding, self.head = (per_request(c) for c in (costs.stage, costs.embedding, costs.head))
        self.head_bytes = costs.head_bytes

    def seconds(self, a: int, b: int, host: Host) -> float:
        edge = (self.embedding if a == 0 else 0.0) + (self.head if b == self.n else 0.0)
        return (self.time[b] - self.time[a] + self.stage + edge) / host.speed

    def memory(self, a: int, b: int) -> int:
        return int(self.bytes[b] - self.bytes[a]) + (self.head_bytes if b == self.n else 0)

    def fits(self, a: int, b: int, host: Host) -> bool:
        return host.memory_bytes is None or self.memory(a, b) <= host.memory_bytes


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def plan(costs: ModelCosts, hosts: Sequence[Host], work: Workload) -> Plan:
    """The split of `costs`' layers over `hosts` (one stage each, in order) whose slowest stage is
    fastest under every host's memory budget; PlacementError when no split fits."""
    model = _Model(costs, work)
    if not 1 <= len(hosts) <= model.n:
        raise PlacementError(f"{len(hosts)} stages for {model.n} layers: need 1 <= stages <= layers")
    slowest = _min_slowest(model, hosts)
    if slowest is None:
        raise PlacementError(_no_fit(model, hosts))
    bounds = _most_even(model, hosts, slowest * (1 + _SLACK))
    return evaluate(costs, hosts, work, bounds)


def _min_slowest(model: _Model, hosts: Sequence[Host]) -> float | None:
    """best[k][b]: the least slowest-stage time putting layers [0, b) on the first k hosts."""
    n, inf = model.n, math.inf
    best = [0.0] + [inf] * n
    for k, host in enumerate(hosts, start=1):
        nxt = [inf] * (n + 1)
        for b in range(k, n - (len(hosts) - k) + 1):
            for a in range(k - 1, b):
                if best[a] < inf and model.fits(a, b, host):
                    nxt[b] = min(nxt[b], max(best[a], model.seconds(a, b, host)))
        best = nxt
    return None if best[n] == inf else best[n]


def _most_even(model: _Model, hosts: Sequence[Host], cap: float) -> list[tuple[int, int]]:
    """Among the splits whose every stage takes at most `cap`, the one with the least sum of
    squared stage times (exact: a sum is additive over stages, unlike a maximum)."""
    n, inf = model.n, math.inf
    best = [[inf] * (n + 1) for _ in range(len(hosts) + 1)]
    cut = [[0] * (n + 1) for _ in range(len(hosts) + 1)]
    best[0][0] = 0.0
    for k, host in enumerate(hosts, start=1):
        for b in range(k, n - (len(hosts) - k) + 1):
            for a in range(k - 1, b):
                t = model.seconds(a, b, host)
                if best[k - 1][a] < inf and t <= cap and model.fits(a, b, host):
                    score = best[k - 1][a] + t * t
                    if score < best[k][b]:
                        best[k][b], cut[k][b] = score, a
    bounds, b = [], n
    for k in range(len(hosts), 0, -1):
        bounds.append((cut[k][b], b))
        b = cut[k][b]
    return bounds[::-1]


def _no_fit(model: _Model, hosts: Sequence[Host]) -> str:
    need = model.memory(0, model.n)
    budgets = [h.memory_bytes for h in hosts]
    held = "no limit" if None in budgets else f"{sum(b or 0 for b in budgets) / 2**20:.0f} MiB"
    return (
        f"no split of {model.n} layers over {len(hosts)} hosts fits their memory: the layers, their KV and the "
        f"output head need {need / 2**20:.0f} MiB in all, the hosts hold {held} "
        f"({', '.join('-' if b is None else f'{b / 2**20:.0f} MiB' for b in budgets)}), and every stage needs "
        "at least one layer: give more memory, fewer KV cells or more hosts"
    )


def evaluate(costs: ModelCosts, hosts: Sequence[Host], work: Workload, bounds: Sequence[tuple[int, int]]) -> Plan:
    """The predicted times of any split (the plan's, an even one, a weight-balanced one) on `hosts`."""
    model = _Model(costs, work)
    if len(bounds) != len(hosts) or [b[0] for b in bounds[1:]] != [b[1] for b in bounds[:-1]]:
        raise PlacementError(f"{list(bounds)} is not a split into {len(hosts)} contiguous ranges")
    if not bounds or bounds[0][0] != 0 or bounds[-1][1] != model.n or any(a >= b for a, b in bounds):
        raise PlacementError(f"{list(bounds)} does not cover layers 0..{model.n} with non-empty ranges")
    times = [model.seconds(a, b, h) for (a, b), h in zip(bounds, hosts, strict=True)]
    slowest, total = max(times), sum(times)
    stages = tuple(
        StagePlan(
            (a, b), t, t / total if total else 1 / len(times), t / slowest if slowest else 1.0, model.memory(a, b)
        )
        for (a, b), t in zip(bounds, times, strict=True)
    )
    bound = total / (len(times) * slowest) if slowest else 1.0
    return Plan(stages, slowest, min(bound, 1.0))
