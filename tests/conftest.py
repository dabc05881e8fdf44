"""Fixtures: tiny models written by the test session itself (no downloads)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from engine.backend import ContextConfig, StageBackend
from neuron_tai.shard import stage_bounds, write_stages
from testkit.models import TinySpec, write_tiny_model

# Property tests draw the same examples on every run (seeded from each test), so a run's
# verdict depends on the code alone, never on the run's luck, an example database or how
# loaded the machine is (no deadline per example).
settings.register_profile("deterministic", derandomize=True, database=None, deadline=None)
settings.load_profile("deterministic")

TINY_GEMMA = TinySpec(arch="gemma3", n_layer=6, sliding_window=4, seed=99)
# Q4_K_M as llama.cpp's quantizer mixes it (Q4_K matrices, Q6_K output and some attn_v and
# ffn_down, F32 norms). Rows of 256 and 512 elements fit K-quant blocks, and every matrix
# has a multiple of 8 rows (128, 256, 512), so CPU_REPACK takes the Q4_K ones on AVX2.
TINY_QUANT = TinySpec(n_embd=256, n_ff=512, quant="q4_k_m", seed=4321)
# The real-shape generator's path at test scale: random Q8_0 tensors streamed to disk, requantized
# to Q4_K_M, a vocabulary padded with unused tokens, and a head tied to the embedding (as Llama-3.2-1B).
TINY_SHAPED = TinySpec(
    n_embd=256,
    n_ff=512,
    n_vocab=1024,
    tied_output=True,
    source="q8_0",
    quant="q4_k_m",
    seed=2024,
    name="tiny real-shape llama",
)


@pytest.fixture(scope="session", autouse=True)
def own_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Shards, measured costs and peer binaries the suite (and every process it starts) caches
    go under the session's own directory, never the user's ~/.cache: a run leaves nothing
    behind and never finds what an earlier run or the bench left there."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(cache))
        yield cache


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(model_dir: Path) -> Path:
    return write_tiny_model(model_dir / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_shards2(tiny_model: Path, model_dir: Path) -> list[Path]:
    return write_stages(tiny_model, model_dir / "s2", stage_bounds(4, stages=2))


@pytest.fixture(scope="session")
def tiny_shards3(tiny_model: Path, model_dir: Path) -> list[Path]:
    return write_stages(tiny_model, model_dir / "s3", stage_bounds(4, split=[1, 3]))


@pytest.fixture(scope="session")
def tiny_quant(model_dir: Path) -> Path:
    return write_tiny_model(model_dir / "tiny-llama-q4_k_m.gguf", TINY_QUANT)


@pytest.fixture(scope="session")
def tiny_quant_shards2(tiny_quant: Path, model_dir: Path) -> list[Path]:
    return write_stages(tiny_quant, model_dir / "q2", stage_bounds(4, stages=2))


@pytest.fixture(scope="session")
def tiny_quant_shards3(tiny_quant: Path, model_dir: Path) -> list[Path]:
    return write_stages(tiny_quant, model_dir / "q3", stage_bounds(4, split=[1, 3]))


@pytest.fixture(scope="session")
def tiny_shaped(model_dir: Path) -> Path:
    return write_tiny_model(model_dir / "tiny-shaped-q4_k_m.gguf", TINY_SHAPED)


@pytest.fixture(scope="session")
def tiny_gemma(model_dir: Path) -> Path:
    return write_tiny_model(model_dir / "tiny-gemma3.gguf", TINY_GEMMA)


# F32 cache and no flash attention (llama.cpp's CPU kernel rounds through f16) for the
# F32 test model: batched-vs-solo differences stay at F32 rounding size.
# `open_backend(path, config)`: a backend that is closed when the test ends.
OpenBackend = Callable[..., StageBackend]

CONFIG = ContextConfig(n_seq_max=8, n_ctx=1024, n_batch=64, n_ubatch=16, kv_type="f32", flash_attn=False)


@pytest.fixture
def open_backend() -> Iterator[OpenBackend]:
    """Open backends that are closed when the test ends: `open_backend(path, config)`."""
    opened: list[StageBackend] = []

    def make(path: Path, config: ContextConfig = CONFIG) -> StageBackend:
        backend = StageBackend(path, config)
        opened.append(backend)
        return backend

    yield make
    for backend in opened:
        backend.close()
