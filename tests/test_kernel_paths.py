"""The node's weight kernel paths on the real llama.cpp, quantized model included.

The default path is probed in a subprocess: on a host where it would crash (the AMX
kernels segfault on quantized models on some CPUs) the probe dies of a signal and the
test fails instead of the test run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.backend import ContextConfig, Segment, StageBackend
from engine.kernels import AMX_BUFFER, REPACK_BUFFER, KernelChoiceError, KernelPath, cpu_features
from engine.llama_handles import extra_buffer_types
from engine.messages import Output

PROBE = textwrap.dedent(
    """
    import sys
    import numpy as np
    from pathlib import Path
    from engine.backend import ContextConfig, Segment, StageBackend
    from engine.messages import Output

    config = ContextConfig(n_seq_max=4, n_ctx=512, n_batch=128, n_ubatch=128, n_threads=2)
    with StageBackend(Path(sys.argv[1]), config) as backend:
        seqs = [backend.open_sequence() for _ in range(4)]
        rng = np.random.default_rng(0)
        for rows in (1, 2, 3, 4, 5, 8, 16, 32):  # every kernel shape: vector, small and tiled matrix
            segs = [Segment(s, backend.length(s), tokens=rng.integers(3, 200, rows, dtype=np.int32),
                            output=Output.LOGITS) for s in seqs]
            for r in backend.decode(segs):
                assert r.logits is not None and np.isfinite(r.logits).all()
        print(backend.model.kernel_path.value, sorted(backend.model.weight_buffers))
    """
)


def test_the_default_kernel_path_runs_quantized_batches_without_crashing(tiny_quant: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(tiny_quant)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"probe ended with {proc.returncode}: {proc.stderr[-2000:]}"
    path, buffers = proc.stdout.split(maxsplit=1)
    assert path != KernelPath.AMX.value and AMX_BUFFER not in buffers
    if REPACK_BUFFER in extra_buffer_types():
        assert path == KernelPath.REPACK.value  # the fastest safe path is the default


CONFIG = ContextConfig(n_seq_max=4, n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2)


def decode_logits(model: Path, kernels: str) -> tuple[StageBackend, list[np.ndarray]]:
    backend = StageBackend(model, replace(CONFIG, kernels=kernels))
    seqs = [backend.open_sequence() for _ in range(3)]
    rng = np.random.default_rng(7)
    segs = [Segment(s, 0, tokens=rng.integers(3, 200, 6, dtype=np.int32), output=Output.LOGITS) for s in seqs]
    return backend, [r.logits for r in backend.decode(segs) if r.logits is not None]


@pytest.mark.skipif(
    REPACK_BUFFER not in extra_buffer_types() or not cpu_features().avx2,
    reason="this llama.cpp build or CPU has no repacked kernels",
)
def test_repack_and_plain_place_weights_differently_and_agree_closely(tiny_quant: Path) -> None:
    repack, fast = decode_logits(tiny_quant, "auto")
    plain, slow = decode_logits(tiny_quant, "plain")
    try:
        assert repack.model.kernel_path is KernelPath.REPACK and REPACK_BUFFER in repack.model.weight_buffers
        assert plain.model.kernel_path is KernelPath.PLAIN and REPACK_BUFFER not in plain.model.weight_buffers
        for a, b in zip(fast, slow, strict=True):
            # Same weights, other kernels: rounding-size differences, nowhere near another input's logits.
            assert np.abs(a - b).max() < 0.1 * np.abs(a).max()
    finally:
        repack.close()
        plain.close()


def test_an_f32_model_has_nothing_to_repack(tiny_model: Path) -> None:
    with StageBackend(tiny_model, CONFIG) as backend:
        assert backend.model.kernel_path is KernelPath.PLAIN
        assert set(backend.model.weight_buffers) <= {"CPU", "CPU_Mapped"}


@pytest.mark.skipif(AMX_BUFFER in extra_buffer_types(), reason="this llama.cpp build offers AMX")
def test_asking_for_amx_where_the_build_has_none_fails_at_start(tiny_quant: Path) -> None:
    with pytest.raises(KernelChoiceError, match="AMX"):
        StageBackend(tiny_quant, replace(CONFIG, kernels="amx"))
