"""What one KV compaction costs on gemma-3-270m Q4_K_M, and that it changes no output.

A backend configured as batch-invariant mode configures it (4096 cells, f16 cache, flash
attention, prefill calls of 63 rows, decode calls padded to 8 rows): 8 sequences are
filled to `live` cells in all, in turns with 4 more that are then closed, their `live`/4
cells held under a graveyard. The compaction that frees them is timed, then two more on
the packed cache (a compaction copies every live cell, holes or not). For the first size
the 8 sequences then decode greedily after the compaction, and in a twin that kept the
held cells instead; their logits are compared bit for bit. Writes evidence/kv_compaction.json.

    python -m bench.kv_compaction [--live 512,1024,2048,3072] [--model PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import bench_model, shown, write_evidence
from engine.backend import ContextConfig, Segment, StageBackend
from engine.kernels import INVARIANT_PAD_ROWS
from engine.messages import Output
from engine.scheduler import INVARIANT_MAX_ROWS  # batch-invariant calls stay below flash attention's 64-row tile

CONFIG = ContextConfig(n_seq_max=14, n_ctx=4096, n_batch=64, n_ubatch=64, kv_type="f16", flash_attn=True)


def fill(backend: StageBackend, seq: int, n: int, rng: np.random.Generator) -> None:
    for start in range(0, n, INVARIANT_MAX_ROWS):
        rows = rng.integers(10, 20_000, min(INVARIANT_MAX_ROWS, n - start)).astype(np.int32)
        backend.decode([Segment(seq, backend.length(seq), rows)])


def layout(backend: StageBackend, live: int) -> tuple[list[int], int, int]:
    """8 live sequences of live/8 cells, filled in turns with 4 closed ones of live/16."""
    rng = np.random.default_rng(live)
    seqs = [backend.open_sequence() for _ in range(12)]
    graveyard, pad = backend.open_sequence(), backend.open_sequence()
    for _ in range(2):
        for i, seq in enumerate(seqs):
            fill(backend, seq, (live // 16) if i < 8 else (live // 32), rng)
    for seq in seqs[8:]:
        backend.retire_sequence(seq, graveyard)
    return seqs[:8], graveyard, pad


def decode_after(backend: StageBackend, seqs: list[int], pad: int, steps: int) -> list[bytes]:
    """Each sequence alone, one greedy token per call padded to 8 rows as batch-invariant mode
    pads it (a one-row call takes other kernels): the logits' bytes."""
    out: list[bytes] = []
    for seq in seqs:
        token = 2
        for _ in range(steps):
            row = Segment(seq, backend.length(seq), np.array([token], np.int32), output=Output.LOGITS)
            padding = np.zeros(INVARIANT_PAD_ROWS[backend.model.kernel_path.value] - 1, np.int32)
            r, _ = backend.decode([row, Segment(pad, 0, padding, output=Output.PAD)])
            backend.rewind(pad, 0)
            assert r.logits is not None
            out.append(r.logits.tobytes())
            token = int(np.argmax(r.logits))
    return out


def measure(model: Path, live: int, check: bool) -> dict[str, Any]:
    with StageBackend(model, CONFIG) as backend:
        seqs, graveyard, pad = layout(backend, live)
        seconds = []
        for _ in range(3):
            started = time.perf_counter()
            result = backend.compact(graveyard)
            seconds.append(time.perf_counter() - started)
            assert result.failure is None and not result.lost and result.cells == live
        compacted = decode_after(backend, seqs, pad, 8) if check else []
    row: dict[str, Any] = {
        "live_cells": live,
        "held_cells": live // 4,
        "copied_bytes": result.bytes,
        "seconds": [round(s, 5) for s in seconds],
    }
    if check:
        with StageBackend(model, CONFIG) as twin:
            twin_seqs, _, twin_pad = layout(twin, live)
            held = decode_after(twin, twin_seqs, twin_pad, 8)
        row["bit_exact_vs_held"] = compacted == held
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", default="512,1024,2048,3072")
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or bench_model(quick=False)
    sizes = [int(x) for x in args.live.split(",")]
    rows = []
    for i, live in enumerate(sizes):
        row = measure(model, live, check=i == 0)
        rows.append(row)
        exact = f", bit-exact vs held: {row['bit_exact_vs_held']}" if "bit_exact_vs_held" in row else ""
        mib = row["copied_bytes"] / 2**20
        print(f"{live:5d} live cells ({mib:.1f} MiB), {live // 4} held: {row['seconds']} s{exact}", flush=True)
    path = write_evidence("kv_compaction.json", {"model": shown(model), "config": repr(CONFIG), "runs": rows})
    print(f"wrote {shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
