"""Which of llama.cpp's CPU kernels serve a stage's weights: a pure decision, tested without the hardware.

ggml-cpu can place quantized weights in "extra" buffer types whose matmul kernels
are faster than the plain ones: `AMX` (Intel AMX tiles, compiled in when the build
machine has AMX) and `CPU_REPACK` (weights interleaved for AVX2/AVX-512 or NEON
kernels). llama.cpp's default tries them in that order. On some AMX hosts the AMX
kernels crash on quantized models (llama.cpp #20824: segfault in
`ggml_backend_amx_mul_mat`), so a node never uses AMX unless asked to.

Three paths:
- `repack`: CPU_REPACK where ggml-cpu has a layout for the tensor, plain kernels elsewhere.
  Where the library offers no AMX this is exactly llama.cpp's default; where it does,
  the extra buffer types are switched off and the repackable weights are routed to
  CPU_REPACK by tensor buffer-type overrides, computed here by mirroring ggml-cpu's
  own choice (`ggml_repack_get_optimal_repack_type`, x86 part).
- `plain`: every weight in the ordinary CPU buffer (`use_extra_bufts = false`).
- `amx`: llama.cpp's default where AMX is offered; only on request.

`auto` picks repack when the library offers CPU_REPACK, else plain: the fastest safe path
(measured in evidence/kernel_paths.json).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

AMX_BUFFER = "AMX"
REPACK_BUFFER = "CPU_REPACK"

# ggml_type ids (ggml.h) of the matrix types ggml-cpu repacks on x86, and the ISA each needs.
GGML_Q4_0, GGML_Q4_K, GGML_Q2_K, GGML_IQ4_NL, GGML_MXFP4 = 2, 12, 10, 20, 39
_X86_REPACK_ISA = {GGML_Q4_0: "avx2", GGML_Q4_K: "avx2", GGML_IQ4_NL: "avx2", GGML_MXFP4: "avx2", GGML_Q2_K: "avx512f"}
_REPACK_ROW_MULTIPLE = 8  # the 8x8 layouts interleave 8 rows

# Weights used as the left operand of a matmul in a transformer block or the output head. Only
# these may be routed to CPU_REPACK: a repacked tensor can no longer be read by other ops
# (token_embd is read by GET_ROWS), and a forced placement skips llama.cpp's support check.
_MATMUL_WEIGHT = re.compile(
    r"^(blk\.\d+\.(attn_(q|k|v|qkv|output)|ffn_(gate|up|down|gate_up))\.weight|output\.weight)$"
)


class KernelPath(enum.StrEnum):
    AMX = "amx"
    REPACK = "repack"
    PLAIN = "plain"


KERNEL_CHOICES = ("auto", *(p.value for p in KernelPath))


# Batch-invariant mode pads decode batches to a multiple of this many rows, per kernel path:
# the smallest padding whose every batch size gave bit-identical logits to a solo run
# (bench/invariance_padding.py on gemma-3-270m Q4_K_M, tests/test_engine.py on the tiny
# Q4_K_M model). Repacked Q4_K runs 1-3 rows through a matrix-vector kernel and 4+ rows in
# groups of 4 through a matrix-matrix one; the plain kernels switch at 8 rows. AMX is never
# chosen by default and not measured: 8 as for the others.
INVARIANT_PAD_ROWS = {"repack": 8, "plain": 8, "amx": 8}

# The row blocks a call's weight matrices take, largest first, per kernel path. Repacked
# matrices take rows 16 at a time, then 4 at a time, and run each leftover row as a
# matrix-vector product of its own (ggml-cpu's repack gemm on x86 and ARM; costs measured in
# engine/row_blocks.py). A call the budget cuts short ends at a multiple of the largest block,
# and a call gets filler rows where they save passes (engine/scheduler.py). The plain and AMX
# paths are not measured for it: no blocks.
CALL_ROW_BLOCKS: dict[str, tuple[int, ...]] = {"repack": (16, 4), "plain": (), "amx": ()}


class KernelChoiceError(ValueError):
    """The requested path is not available in this llama.cpp library."""


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    """What the CPU reports (Linux /proc/cpuinfo flags) that decides kernels."""

    model: str
    flags: frozenset[str]

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def amx(self) -> bool:
        return "amx_int8" in self.flags or "amx_tile" in self.flags

    def summary(self) -> dict[str, object]:
        return {
            "model": self.model,
            "avx2": self.avx2,
            "avx512": self.avx512,
            "amx": self.amx,
            "amx_flags": sorted(f for f in self.flags if f.startswith("amx")),
        }


def parse_cpuinfo(text: str) -> CpuFeatures:
    """CPU model and flags from the text of /proc/cpuinfo (first processor)."""
    model, flags = "unknown", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return CpuFeatures(model, flags)


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuFeatures:
    try:
        return parse_cpuinfo(cpuinfo.read_text(errors="replace"))
    except OSError:
        return CpuFeatures("unknown", frozenset())


def choose_path(requested: str, offered: Iterable[str]) -> KernelPath:
    """The kernel path for a request ("auto", "repack", "plain", "amx") given the extra buffer types offered."""
    extras = set(offered)
    if requested == "auto":
        return KernelPath.REPACK if REPACK_BUFFER in extras else KernelPath.PLAIN
    try:
        path = KernelPath(requested)
    except ValueError:
        raise KernelChoiceError(f"kernel path must be auto, repack, plain or amx, not {requested!r}") from None
    needs = {KernelPath.AMX: AMX_BUFFER, KernelPath.REPACK: REPACK_BUFFER}.get(path)
    if needs is not None and needs not in extras:
        raise KernelChoiceError(
            f"kernel path {path.value!r} needs llama.cpp's {needs} buffer type, which this "
            f"library does not offer (it offers {sorted(extras) or 'none'})"
        )
    return path


@dataclass(frozen=True, slots=True)
class WeightTensor:
    name: str
    ggml_type: int
    dims: tuple[int, ...]  # ggml order: dims[0] is the row length, dims[1] the row count


def repackable(tensor: WeightTensor, cpu: CpuFeatures) -> bool:
    """Whether ggml-cpu (x86) has a repacked layout for this matmul weight on this CPU."""
    isa = _X86_REPACK_ISA.get(tensor.ggml_type)
    if isa is None or len(tensor.dims) != 2 or tensor.dims[1] % _REPACK_ROW_MULTIPLE:
        return False
    if not _MATMUL_WEIGHT.match(tensor.name):
        return False
    return isa in cpu.flags


@dataclass(frozen=True, slots=True)
class Placement:
    """How to load the model for a path: llama_model_params.use_extra_bufts and buffer-type overrides."""

    path: KernelPath
    use_extra_bufts: bool
    repack_patterns: tuple[str, ...] = ()  # regexes of tensors forced into CPU_REPACK


def placement(path: KernelPath, offered: Iterable[str], tensors: Sequence[WeightTensor], cpu: CpuFeatures) -> Placement:
    """The load parameters that realise `path` without ever placing a weight in the AMX buffer unless asked."""
    extras = set(offered)
    if path is KernelPath.PLAIN:
        return Placement(path, use_extra_bufts=False)
    if path is KernelPath.AMX or AMX_BUFFER not in extras:
        return Placement(path, use_extra_bufts=True)  # llama.cpp's own choice: AMX first, or repack first
    names = [t.name for t in tensors if repackable(t, cpu)]
    patterns = tuple(_alternations(names))
    return Placement(path, use_extra_bufts=False, repack_patterns=patterns)


def _alternations(names: Sequence[str], per_pattern: int = 64) -> list[str]:
    """Exact-name regexes, a few dozen names each (llama.cpp compiles one std::regex per pattern)."""
    out = []
    for i in range(0, len(names), per_pattern):
        group = names[i : i + per_pattern]
        out.append("^(" + "|".join(re.escape(n) for n in group) + ")$")
    return out


def path_of_buffers(buffers: Iterable[str]) -> KernelPath:
    """The path a loaded model actually runs, from the weight buffer types llama.cpp reported."""
    names = set(buffers)
    if AMX_BUFFER in names:
        return KernelPath.AMX
    if REPACK_BUFFER in names:
        return KernelPath.REPACK
    return KernelPath.PLAIN
