"""Memory budgets of a stage: weights, KV cache, scratch, queued payloads.

Pure arithmetic. The KV figure follows llama.cpp's own sizing (llama-context.cpp,
llama-kv-cache-iswa.cpp, 0.3.36): the context is padded to a multiple of 256
cells; sliding-window layers get a cache of their own of
pad256(min(n_ctx, n_swa * n_seq_max + n_ubatch)) cells (unified cache, `swa_full`
off). Each cell holds one K and one V row per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

CELL_PAD = 256


def pad_cells(n: int) -> int:
    return -(-n // CELL_PAD) * CELL_PAD


@dataclass(frozen=True, slots=True)
class KvShape:
    """Per-layer K/V row widths and which layers use the sliding window."""

    k_widths: tuple[int, ...]
    v_widths: tuple[int, ...]
    swa: tuple[bool, ...]
    n_swa: int

    def bytes_per_cell(self, element_bytes: int, *, window_layers: bool) -> int:
        rows = zip(self.k_widths, self.v_widths, self.swa, strict=True)
        return element_bytes * sum(k + v for k, v, is_swa in rows if is_swa == window_layers)


@dataclass(frozen=True, slots=True)
class KvLayout:
    cells: int  # cells of the full-attention cache (what sessions reserve from)
    window_cells: int  # cells of the sliding-window cache (0 without window layers)
    bytes: int


def kv_layout(
    shape: KvShape, n_ctx: int, n_seq_max: int, n_ubatch: int, element_bytes: int, swa_full: bool = False
) -> KvLayout:
    cells = pad_cells(n_ctx)
    has_window = any(shape.swa)
    window = 0
    if has_window:
        window = cells if swa_full else pad_cells(min(cells, shape.n_swa * n_seq_max + n_ubatch))
    full = shape.bytes_per_cell(element_bytes, window_layers=False)
    swa = shape.bytes_per_cell(element_bytes, window_layers=True)
    return KvLayout(cells, window, cells * full + window * swa)


@dataclass(frozen=True, slots=True)
class Limits:
    """Operator limits in bytes; None means unlimited."""

    weights: int | None = None
    kv: int | None = None
    scratch: int | None = None


@dataclass(frozen=True, slots=True)
class Budgets:
    """What the stage needs, reported in `stats` and checked against `Limits`."""

    weights_bytes: int
    kv_bytes: int
    scratch_bytes: int

    def violations(self, limits: Limits) -> list[str]:
        """One message per budget that does not fit, naming it and the numbers."""
        out = []
        for name, need, limit in (
            ("weights", self.weights_bytes, limits.weights),
            ("kv", self.kv_bytes, limits.kv),
            ("scratch", self.scratch_bytes, limits.scratch),
        ):
            if limit is not None and need > limit:
                out.append(f"{name} budget: need {_mib(need)}, limit {_mib(limit)}")
        return out


class BudgetError(Exception):
    """The configuration cannot fit; the message names each budget and its numbers."""


def _mib(n: int) -> str:
    return f"{n} bytes ({n / 2**20:.2f} MiB)"
