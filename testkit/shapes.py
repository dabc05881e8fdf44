"""Real models' geometry with random weights: what a pipeline costs on the models people split, without a download.

Each shape copies a named model's layers, hidden size, feed-forward size, heads, KV heads,
vocabulary, RoPE base and output-head tying (from the models' published config.json), so
compute, memory and activation sizes are real; the outputs are meaningless. The tokenizer
is the tiny SPM vocabulary (byte fallback: it tokenizes and detokenizes any text) padded
with unused tokens to the real vocabulary size, so the output head has its real size.
Llama 3's RoPE frequency scaling is left out: it changes no shape or cost.

    python -m testkit.shapes llama-3.2-1b     # prints the cached path, writing it first if needed
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from testkit.models import TinySpec, write_tiny_model

SHAPES: dict[str, TinySpec] = {
    # meta-llama/Llama-3.2-1B: 16 layers, 2048 hidden, 8192 FFN, 32 heads, 8 KV heads, 128256 vocabulary, tied head.
    "llama-3.2-1b": TinySpec(name="Llama-3.2-1B shape (random weights)", n_layer=16, n_embd=2048, n_ff=8192,
                             n_head=32, n_head_kv=8, n_vocab=128256, tied_output=True, rope_freq_base=500000.0,
                             n_ctx_train=131072, quant="q4_k_m", source="q8_0", seed=321),
    # meta-llama/Llama-3.1-8B: 32 layers, 4096 hidden, 14336 FFN, 32 heads, 8 KV heads, 128256 vocabulary.
    "llama-3.1-8b": TinySpec(name="Llama-3.1-8B shape (random weights)", n_layer=32, n_embd=4096, n_ff=14336,
                             n_head=32, n_head_kv=8, n_vocab=128256, rope_freq_base=500000.0,
                             n_ctx_train=131072, quant="q4_k_m", source="q8_0", seed=318),
}  # fmt: skip


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "neuron-tai" / "shapes"


def shape_path(name: str, directory: Path | None = None) -> Path:
    """The cached GGUF of shape `name`, written (atomically) on first use."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    spec = SHAPES[name]
    path = (directory or cache_dir()) / f"{name}-shape-{spec.quant}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        start = time.perf_counter()
        print(f"writing the {name} shape (random weights, {spec.quant}) to {path} ...", file=sys.stderr, flush=True)
        write_tiny_model(partial, spec)
        partial.rename(path)
        print(f"  done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return path


if __name__ == "__main__":
    for arg in sys.argv[1:] or list(SHAPES):
        print(shape_path(arg))
