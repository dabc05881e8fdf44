"""The weight kernel-path decision, for CPUs this machine may not have (pure: no llama.cpp)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.kernels import (
    AMX_BUFFER,
    GGML_Q2_K,
    GGML_Q4_0,
    GGML_Q4_K,
    REPACK_BUFFER,
    CpuFeatures,
    KernelChoiceError,
    KernelPath,
    WeightTensor,
    choose_path,
    parse_cpuinfo,
    path_of_buffers,
    placement,
    repackable,
)

AVX2 = CpuFeatures("AMD EPYC (avx2)", frozenset({"sse4_2", "avx", "avx2", "fma"}))
AVX512 = CpuFeatures("Xeon (avx512)", AVX2.flags | {"avx512f", "avx512bw", "avx512_vnni"})
AMX = CpuFeatures("Xeon Sapphire Rapids", AVX512.flags | {"amx_tile", "amx_int8", "amx_bf16"})
OLD = CpuFeatures("old x86", frozenset({"sse4_2", "avx"}))

# What each host's native llama.cpp build offers: AMX is compiled in only on an AMX build machine.
OFFERED = {"amx": [AMX_BUFFER, REPACK_BUFFER], "avx512": [REPACK_BUFFER], "avx2": [REPACK_BUFFER], "old": []}
Q4_K_M_LIKE = [
    WeightTensor("token_embd.weight", 14, (640, 262144)),  # Q6_K, read by GET_ROWS: never repacked
    WeightTensor("blk.0.attn_q.weight", GGML_Q4_K, (640, 1024)),
    WeightTensor("blk.0.attn_k.weight", GGML_Q4_0, (640, 256)),
    WeightTensor("blk.0.attn_v.weight", 8, (640, 256)),  # Q8_0: no x86 repack
    WeightTensor("blk.0.ffn_down.weight", GGML_Q4_K, (2048, 644)),  # rows not a multiple of 8
    WeightTensor("blk.0.ffn_up.weight", GGML_Q2_K, (640, 2048)),  # Q2_K: AVX-512 only
    WeightTensor("blk.0.attn_norm.weight", 0, (640,)),
    WeightTensor("output.weight", GGML_Q4_K, (640, 262144)),
]


def test_cpuinfo_is_parsed_from_the_first_processor() -> None:
    text = "processor: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
    text += "flags\t\t: fpu avx2 avx512f amx_tile amx_int8\n\n"
    text += "processor: 1\nmodel name\t: other\nflags\t: fpu\n"
    cpu = parse_cpuinfo(text)
    assert cpu.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert (cpu.avx2, cpu.avx512, cpu.amx) == (True, True, True)
    assert cpu.summary()["amx_flags"] == ["amx_int8", "amx_tile"]
    assert parse_cpuinfo("") == CpuFeatures("unknown", frozenset())


@pytest.mark.parametrize("host", ["amx", "avx512", "avx2", "old"])
def test_auto_never_chooses_amx_and_prefers_repack(host: str) -> None:
    chosen = choose_path("auto", OFFERED[host])
    assert chosen is not KernelPath.AMX
    assert chosen is (KernelPath.REPACK if REPACK_BUFFER in OFFERED[host] else KernelPath.PLAIN)


@pytest.mark.parametrize(("host", "cpu"), [("amx", AMX), ("avx512", AVX512), ("avx2", AVX2), ("old", OLD)])
def test_default_placement_never_lets_llama_cpp_reach_the_amx_buffer(host: str, cpu: CpuFeatures) -> None:
    offered = OFFERED[host]
    plan = placement(choose_path("auto", offered), offered, Q4_K_M_LIKE, cpu)
    # llama.cpp tries its extra buffer types, AMX first, only with use_extra_bufts.
    assert not (plan.use_extra_bufts and AMX_BUFFER in offered)


def test_on_an_amx_build_repack_is_routed_tensor_by_tensor() -> None:
    plan = placement(KernelPath.REPACK, OFFERED["amx"], Q4_K_M_LIKE, AMX)
    assert not plan.use_extra_bufts
    routed = {t.name for t in Q4_K_M_LIKE if any(re.search(p, t.name) for p in plan.repack_patterns)}
    assert routed == {"blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_up.weight", "output.weight"}


def test_without_amx_repack_is_llama_cpps_own_choice() -> None:
    for host in ("avx512", "avx2"):
        plan = placement(KernelPath.REPACK, OFFERED[host], Q4_K_M_LIKE, AVX2)
        assert plan.use_extra_bufts and plan.repack_patterns == ()


def test_plain_switches_extra_buffers_off_and_amx_only_on_request() -> None:
    assert not placement(KernelPath.PLAIN, OFFERED["amx"], Q4_K_M_LIKE, AMX).use_extra_bufts
    amx = placement(choose_path("amx", OFFERED["amx"]), OFFERED["amx"], Q4_K_M_LIKE, AMX)
    assert amx.path is KernelPath.AMX and amx.use_extra_bufts


@pytest.mark.parametrize(("requested", "host"), [("amx", "avx512"), ("repack", "old"), ("fast", "avx2")])
def test_a_path_the_library_lacks_is_refused(requested: str, host: str) -> None:
    with pytest.raises(KernelChoiceError):
        choose_path(requested, OFFERED[host])


def test_repackable_mirrors_ggml_cpu_on_x86() -> None:
    q4k = WeightTensor("blk.3.ffn_gate.weight", GGML_Q4_K, (256, 512))
    assert repackable(q4k, AVX2) and not repackable(q4k, OLD)
    q2k = WeightTensor("blk.3.ffn_gate.weight", GGML_Q2_K, (256, 512))
    assert repackable(q2k, AVX512) and not repackable(q2k, AVX2)
    assert not repackable(WeightTensor("blk.3.ffn_gate.weight", GGML_Q4_K, (256, 500)), AVX2)
    assert not repackable(WeightTensor("token_embd.weight", GGML_Q4_0, (256, 512)), AVX2)
    assert not repackable(WeightTensor("blk.3.ffn_gate.weight", GGML_Q4_K, (256, 8, 2)), AVX2)


@given(st.lists(st.sampled_from([AMX_BUFFER, REPACK_BUFFER, "CPU_Mapped", "CPU"]), max_size=4))
def test_the_reported_path_is_the_fastest_buffer_in_use(buffers: list[str]) -> None:
    path = path_of_buffers(buffers)
    if AMX_BUFFER in buffers:
        assert path is KernelPath.AMX
    elif REPACK_BUFFER in buffers:
        assert path is KernelPath.REPACK
    else:
        assert path is KernelPath.PLAIN


def test_llama_server_is_built_without_amx_only_where_the_library_has_it() -> None:
    from bench.llama_server import isa_flags  # noqa: PLC0415 - bench code, imported where tested

    assert isa_flags(AMX, without_amx=False) == []  # native, as llama-cpp-python builds
    flags = isa_flags(AMX, without_amx=True)
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AMX_INT8=OFF" in flags
    assert "-DGGML_AVX512=ON" in flags and "-DGGML_AVX2=ON" in flags
    assert "-DGGML_AVX512=OFF" in isa_flags(AVX2, without_amx=True)
