"""llama.cpp's own `llama-server` and `llama-batched-bench`, built once from the installed llama-cpp-python's sources.

The peer and the ceiling run the same llama.cpp as the node: the sdist of the installed
llama-cpp-python version (from pip's cache when it is there), only these two targets, linked
statically, cached per version under ~/.cache/neuron-tai/. A failed build is logged there
and reported; the bench then skips this peer rather than failing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import IO

import llama_cpp as lc

from bench.common import shown
from engine.kernels import AMX_BUFFER, CpuFeatures, cpu_features
from engine.llama_handles import extra_buffer_types

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",  # llama-server and llama-batched-bench live under tools/
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # no downloads: the bench only uses the HTTP API
    "-DLLAMA_OPENSSL=OFF",
]


# ggml's CMake switches for x86 instruction sets, and the /proc/cpuinfo flag each needs.
_ISA_OPTIONS = {
    "GGML_SSE42": "sse4_2",
    "GGML_AVX": "avx",
    "GGML_AVX2": "avx2",
    "GGML_FMA": "fma",
    "GGML_F16C": "f16c",
    "GGML_BMI2": "bmi2",
    "GGML_AVX_VNNI": "avx_vnni",
    "GGML_AVX512": "avx512f",
    "GGML_AVX512_VBMI": "avx512vbmi",
    "GGML_AVX512_VNNI": "avx512_vnni",
    "GGML_AVX512_BF16": "avx512_bf16",
}


def isa_flags(cpu: CpuFeatures, without_amx: bool) -> list[str]:
    """CMake flags for the build: native (as llama-cpp-python builds), or this CPU's ISA without AMX.

    A native build on an AMX machine compiles the AMX kernels in, and llama-server's
    `--override-tensor` cannot route weights to CPU_REPACK instead. So where the node's library
    offers AMX, llama-server is built for the same instruction sets minus AMX: its default
    placement is then the node's repack path.
    """
    if not without_amx:
        return []
    on = [f"-D{opt}={'ON' if flag in cpu.flags else 'OFF'}" for opt, flag in _ISA_OPTIONS.items()]
    return ["-DGGML_NATIVE=OFF", *on, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def _without_amx() -> bool:
    return AMX_BUFFER in extra_buffer_types()


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "neuron-tai" / f"llama-server-{lc.__version__}{'-noamx' if _without_amx() else ''}"


SERVER = "llama-server"
BATCHED_BENCH = "llama-batched-bench"  # llama.cpp's own batched decode benchmark: the ceiling
TARGETS = (SERVER, BATCHED_BENCH)


def cached_binary(name: str = SERVER) -> Path | None:
    binary = cache_dir() / name
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None


def ensure_llama_server(name: str = SERVER) -> tuple[Path | None, str]:
    """The cached binary `name`, building every missing target first; (None, why) when it cannot be had."""
    if (binary := cached_binary(name)) is not None:
        return binary, f"cached {binary}"
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    log_path = root / "build.log"
    with log_path.open("w") as log:
        try:
            source = _vendored_source(root, log)
            build = root / "build"
            flags = [*CMAKE_FLAGS, *isa_flags(cpu_features(), _without_amx())]
            _run(["cmake", "-S", str(source), "-B", str(build), *flags], log)
            jobs = str(os.cpu_count() or 2)
            missing = [t for t in TARGETS if cached_binary(t) is None]
            _run(["cmake", "--build", str(build), "--target", *missing, "-j", jobs], log)
            for target in missing:
                shutil.copy2(build / "bin" / target, root / target)
        except (OSError, subprocess.CalledProcessError, tarfile.TarError) as exc:
            return None, f"{name} could not be built ({exc}); see {log_path}"
    shutil.rmtree(root / "build", ignore_errors=True)
    shutil.rmtree(root / "src", ignore_errors=True)
    return root / name, f"built {root / name} (log: {log_path})"


def _vendored_source(root: Path, log: IO[str]) -> Path:
    """vendor/llama.cpp from the sdist of the installed llama-cpp-python version."""
    src = root / "src"
    target = src / "llama.cpp"
    if (target / "CMakeLists.txt").exists():
        return target
    download = root / "sdist"
    spec = f"llama-cpp-python=={lc.__version__}"
    _run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", spec, "-d", str(download)],
        log,
    )
    archive = next(download.glob("llama_cpp_python-*.tar.gz"))
    prefix = f"{archive.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name.removeprefix(prefix)
        tar.extractall(target, members=[m for m in members if m.name], filter="data")
    shutil.rmtree(download, ignore_errors=True)
    return target


def _run(cmd: list[str], log: IO[str]) -> None:
    print("  $", shown(" ".join(cmd)), flush=True)
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
