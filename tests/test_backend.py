"""The llama.cpp stage backend on the tiny model: exactness, isolation, refusals, rollback."""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from engine import llama_handles
from engine.backend import (
    ContextConfig,
    DecodeFailed,
    DecodeOutcome,
    Segment,
    StageBackend,
)
from engine.gguf_header import read_header
from engine.llama_handles import LlamaModel, capture_llama_log, reads_every_weight
from engine.messages import Output
from engine.process_memory import release_free_heap, release_mapped_file, resident_memory
from neuron_tai.shard import write_stages
from protocol.errors import ErrorCode, Fault
from protocol.sampling import Sampling
from testkit.local_chain import LocalChain
from testkit.models import TinySpec, write_tiny_model
from tests.conftest import CONFIG, OpenBackend


def prompts(seed: int, lengths: list[int], n_vocab: int = 268) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)
    return {f"s{i}": [1, *rng.integers(3, n_vocab, n - 1).tolist()] for i, n in enumerate(lengths)}


LENGTHS = [5, 11, 3, 17]


@pytest.mark.parametrize(
    ("model", "shards"),
    [
        ("tiny_model", "tiny_shards2"),
        ("tiny_model", "tiny_shards3"),
        ("tiny_quant", "tiny_quant_shards2"),
        ("tiny_quant", "tiny_quant_shards3"),
    ],
)
def test_split_pipeline_is_bit_identical_to_whole_model(
    model: str, shards: str, open_backend: OpenBackend, request: pytest.FixtureRequest
) -> None:
    whole_path: Path = request.getfixturevalue(model)
    paths: list[Path] = request.getfixturevalue(shards)
    whole = LocalChain([open_backend(whole_path)]).greedy(prompts(1, LENGTHS), steps=16)
    split = LocalChain([open_backend(p) for p in paths]).greedy(prompts(1, LENGTHS), steps=16)
    for name in whole:
        assert len(split[name]) == 17
        for step, (a, b) in enumerate(zip(whole[name], split[name], strict=True)):
            assert np.array_equal(a, b), f"{name} step {step}: max diff {np.abs(a - b).max()}"


@pytest.mark.parametrize("shards", ["tiny_shards2", "tiny_quant_shards2"])
def test_outputs_do_not_depend_on_partners_contents(
    shards: str, open_backend: OpenBackend, request: pytest.FixtureRequest
) -> None:
    """Same batch shape, different co-batched sessions: the observed session is bit-identical."""
    paths: list[Path] = request.getfixturevalue(shards)
    mine = prompts(7, [9])["s0"]
    traces = []
    for partner_seed in (100, 200):
        partners = {f"p{k}": v for k, v in prompts(partner_seed, [4, 13, 6]).items()}
        pipe = LocalChain([open_backend(p) for p in paths])
        traces.append(pipe.greedy({"me": mine, **partners}, steps=20))
    for step, (a, b) in enumerate(zip(traces[0]["me"], traces[1]["me"], strict=True)):
        assert np.array_equal(a, b), f"step {step}: max diff {np.abs(a - b).max()}"
    assert len(traces[0]["me"]) == 21
    # The partners really differed: each one's first logits moved by far more than rounding.
    for name in ("ps0", "ps1", "ps2"):
        assert np.abs(traces[0][name][0] - traces[1][name][0]).max() > 0.1, name


def teacher_forced(chain: LocalChain, prompt: list[int], name: str, follow: list[np.ndarray]) -> list[np.ndarray]:
    """One session's logits when fed the prompt, then the argmax tokens of `follow` (another run's trace)."""
    chain.open(name)
    trace = [chain.step({name: prompt})[name]]
    for row in follow[:-1]:
        trace.append(chain.step({name: [int(np.argmax(row))]})[name])
    return trace


# Largest relative logit difference between a session batched with 7 others and alone,
# teacher-forced along the batched run's tokens (8 sessions x 33 steps, prompt seeds 3-5):
# F32 measured 8.7e-7; Q4_K_M 0.032 (the quantized kernels take other paths for batches of
# 4+ rows, and activations re-quantized to 8 bits per layer magnify their rounding). Two
# different sessions' logits differ by 0.8-1.0 relative, so cross-talk would be order 1.
@pytest.mark.parametrize(("model", "tolerance"), [("tiny_model", 1e-5), ("tiny_quant", 0.1)])
def test_batched_matches_solo_within_tolerance(
    model: str, tolerance: float, open_backend: OpenBackend, request: pytest.FixtureRequest
) -> None:
    """Batched vs solo differ by kernel rounding only; with F32 weights greedy tokens stay identical."""
    path: Path = request.getfixturevalue(model)
    all_prompts = prompts(3, [6, 14, 9, 3, 4, 11, 8, 7])
    batched = LocalChain([open_backend(path)]).greedy(all_prompts, steps=32)
    worst = 0.0
    for name, prompt in all_prompts.items():
        solo_chain = LocalChain([open_backend(path, replace(CONFIG, n_seq_max=1))])
        solo = teacher_forced(solo_chain, prompt, name, batched[name])
        for a, b in zip(batched[name], solo, strict=True):
            if model == "tiny_model":
                assert int(np.argmax(a)) == int(np.argmax(b))
            worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
    assert 0.0 < worst < tolerance, f"relative logit difference {worst}"
    s0, s1 = batched["s0"], batched["s1"]
    other = min(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(s0, s1, strict=True))
    assert other > 5 * tolerance, f"two sessions differ by only {other}: the tolerance would hide cross-talk"


def cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


@pytest.mark.skipif("avx2" not in cpu_flags(), reason="llama.cpp repacks Q4_K weights only on CPUs with AVX2")
def test_quantized_model_reaches_the_repack_kernels(tiny_quant: Path, tiny_model: Path) -> None:
    """llama.cpp logs a CPU_REPACK buffer when it moved weights into its batched-kernel layout."""

    def load_log(path: Path) -> list[str]:
        with capture_llama_log() as lines:
            LlamaModel(path).close()
        return lines

    repack = [line for line in load_log(tiny_quant) if "CPU_REPACK model buffer size" in line]
    assert len(repack) == 1, "the quantized test model no longer reaches llama.cpp's repacked kernels"
    assert float(repack[0].rsplit("=", 1)[1].split()[0]) > 0.5  # MiB: the Q4_K matrices (1.09 MiB)
    assert not [line for line in load_log(tiny_model) if "CPU_REPACK model buffer" in line]  # F32 is never repacked
    types = {t.tensor_type for t in gguf.GGUFReader(str(tiny_quant)).tensors}
    assert types == {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K}


def test_rewind_equals_a_fresh_session(tiny_model: Path, open_backend: OpenBackend) -> None:
    backend: StageBackend = open_backend(tiny_model)
    tokens = np.array(prompts(5, [12])["s0"], np.int32)
    other = np.array(prompts(6, [12])["s0"], np.int32)
    seq = backend.open_sequence()
    backend.decode([Segment(seq, 0, tokens=other, output=Output.LOGITS)])
    backend.rewind(seq, 4)
    assert backend.length(seq) == 4
    backend.rewind(seq, 0)
    rewound = backend.decode([Segment(seq, 0, tokens=tokens, output=Output.LOGITS)])[0].logits
    fresh_seq = backend.open_sequence()
    fresh = backend.decode([Segment(fresh_seq, 0, tokens=tokens, output=Output.LOGITS)])[0].logits
    assert rewound is not None and fresh is not None
    # Different KV cells change the summation order: equal to F32 rounding, not bit-exact.
    np.testing.assert_allclose(rewound, fresh, rtol=1e-5, atol=1e-5)
    assert int(np.argmax(rewound)) == int(np.argmax(fresh))
    # Partial rewind: replay the tail of the same tokens and get the same last logits.
    backend.rewind(seq, 7)
    again = backend.decode([Segment(seq, 7, tokens=tokens[7:], output=Output.LOGITS)])[0].logits
    assert again is not None
    np.testing.assert_allclose(again, fresh, rtol=1e-5, atol=1e-5)


def test_seeded_sampling_is_reproducible_and_retry_safe(tiny_model: Path, open_backend: OpenBackend) -> None:
    backend: StageBackend = open_backend(tiny_model)
    params = Sampling(temperature=1.5, top_k=40, top_p=0.95, seed=42)
    prompt = np.array(prompts(8, [6])["s0"], np.int32)

    def sample_run(seed_params: Sampling, n: int = 12) -> list[int]:
        seq = backend.open_sequence(seed_params)
        tok = backend.decode([Segment(seq, 0, tokens=prompt, output=Output.TOKEN)])[0].token
        out = [tok]
        for _ in range(n):
            assert tok is not None
            pos = backend.length(seq)
            tok = backend.decode([Segment(seq, pos, tokens=np.array([tok], np.int32), output=Output.TOKEN)])[0].token
            out.append(tok)
        # A retried last step (rewind one, resend) samples the same token.
        backend.rewind(seq, pos)
        retry = backend.decode([Segment(seq, pos, tokens=np.array([out[-2]], np.int32), output=Output.TOKEN)])
        assert retry[0].token == out[-1]
        backend.close_sequence(seq)
        return [int(t) for t in out if t is not None]

    first, second = sample_run(params), sample_run(params)
    assert first == second
    assert sample_run(replace(params, seed=43)) != first
    assert len(set(first)) > 1  # really sampling, not greedy


@pytest.mark.parametrize(
    ("make_segment", "reason"),
    [
        (lambda seq: Segment(seq, 3, tokens=np.array([5], np.int32), output=Output.LOGITS), ErrorCode.POSITION),
        (lambda seq: Segment(seq + 5, 0, tokens=np.array([5], np.int32)), ErrorCode.UNKNOWN_SESSION),
        (lambda seq: Segment(seq, 0, tokens=np.array([5, 268], np.int32)), ErrorCode.BAD_REQUEST),
        (lambda seq: Segment(seq, 0, tokens=np.array([-1], np.int32)), ErrorCode.BAD_REQUEST),
        (lambda seq: Segment(seq, 0, hidden=np.zeros((1, 64), np.float32)), ErrorCode.WRONG_STAGE),
        (lambda seq: Segment(seq, 0, tokens=np.array([5], np.int32), output=Output.HIDDEN), ErrorCode.WRONG_STAGE),
        (lambda seq: Segment(seq, 0, tokens=np.zeros(65, np.int32)), ErrorCode.TOO_LARGE),
        (lambda seq: Segment(seq, 0, tokens=np.zeros(0, np.int32)), ErrorCode.BAD_REQUEST),
    ],
)
def test_malformed_segments_are_refused_before_llama_cpp(
    tiny_model: Path, open_backend: OpenBackend, make_segment: Any, reason: ErrorCode
) -> None:
    backend: StageBackend = open_backend(tiny_model)
    seq = backend.open_sequence()
    with pytest.raises(Fault) as info:
        backend.decode([make_segment(seq)])
    assert info.value.code is reason
    assert str(info.value)
    assert backend.length(seq) == 0


@pytest.mark.parametrize(
    ("hidden", "reason"),
    [
        (np.zeros((2, 63), np.float32), ErrorCode.BAD_REQUEST),
        (np.full((2, 64), np.nan, np.float32), ErrorCode.BAD_REQUEST),
        (np.full((1, 64), np.inf, np.float32), ErrorCode.BAD_REQUEST),
    ],
)
def test_bad_hidden_input_is_refused(
    tiny_shards2: list[Path], open_backend: OpenBackend, hidden: Any, reason: ErrorCode
) -> None:
    backend: StageBackend = open_backend(tiny_shards2[1])
    seq = backend.open_sequence()
    with pytest.raises(Fault) as info:  # checked as a request arrives: the shape and every value
        backend.check_payload(None, hidden, Output.LOGITS)
    assert info.value.code is reason
    if np.isfinite(hidden).all():  # a decode checks the shape too; values it leaves to check_payload
        with pytest.raises(Fault) as info:
            backend.decode([Segment(seq, 0, hidden=hidden, output=Output.LOGITS)])
        assert info.value.code is reason
    assert backend.length(seq) == 0


def test_duplicate_sequence_in_one_batch_is_refused(tiny_model: Path, open_backend: OpenBackend) -> None:
    backend: StageBackend = open_backend(tiny_model)
    seq = backend.open_sequence()
    one = np.array([5], np.int32)
    with pytest.raises(Fault, match="twice"):
        backend.decode([Segment(seq, 0, tokens=one), Segment(seq, 1, tokens=one)])


def test_failed_decode_changes_nothing(tiny_model: Path, open_backend: OpenBackend) -> None:
    """A batch llama.cpp cannot place (no KV slot) leaves every sequence as it was."""
    config = ContextConfig(n_seq_max=4, n_ctx=256, n_batch=256, n_ubatch=64)
    backend: StageBackend = open_backend(tiny_model, config)
    reference: StageBackend = open_backend(tiny_model, config)
    assert backend.ctx.n_ctx == 256
    a_tokens = np.array(prompts(11, [20])["s0"], np.int32)
    for b in (backend, reference):
        a = b.open_sequence()
        b.decode([Segment(a, 0, tokens=a_tokens, output=Output.LOGITS)])
    victim = backend.open_sequence()
    backend.decode([Segment(victim, 0, tokens=a_tokens[:10])])
    with pytest.raises(DecodeFailed) as info:
        backend.decode(
            [
                Segment(0, 20, tokens=a_tokens[:4], output=Output.LOGITS),
                Segment(victim, 10, tokens=np.zeros(240, np.int32), output=Output.LOGITS),
            ]
        )
    assert info.value.outcome is DecodeOutcome.NO_KV_SLOT
    assert backend.length(0) == 20 and backend.length(victim) == 10
    assert backend.ctx.seq_pos_max(0) == 19 and backend.ctx.seq_pos_max(victim) == 9
    step = np.array([7], np.int32)
    after = backend.decode([Segment(0, 20, tokens=step, output=Output.LOGITS)])[0].logits
    expected = reference.decode([Segment(0, 20, tokens=step, output=Output.LOGITS)])[0].logits
    assert after is not None and expected is not None
    np.testing.assert_allclose(after, expected, rtol=1e-5, atol=1e-5)


def test_sequences_are_limited_and_reusable(tiny_model: Path, open_backend: OpenBackend) -> None:
    backend: StageBackend = open_backend(tiny_model, replace(CONFIG, n_seq_max=2))
    a, b = backend.open_sequence(), backend.open_sequence()
    with pytest.raises(Fault) as info:
        backend.open_sequence()
    assert info.value.code is ErrorCode.SESSION_LIMIT
    backend.decode([Segment(a, 0, tokens=np.array([1, 5, 6], np.int32))])
    backend.close_sequence(a)
    backend.close_sequence(a)  # closing twice is harmless
    c = backend.open_sequence()
    assert c == a and backend.length(c) == 0 and backend.ctx.seq_pos_max(c) == -1
    assert backend.open_sequences == 2 and b != c


def test_sliding_window_rewind_is_refused_when_the_window_has_moved(
    tiny_gemma: Path, open_backend: OpenBackend
) -> None:
    # llama.cpp sizes the window cache pad256(n_swa * n_seq_max + n_ubatch) = 256 cells here,
    # so positions start to fall out of it after 256 tokens.
    config = ContextConfig(n_seq_max=2, n_ctx=1024, n_batch=16, n_ubatch=16)
    backend: StageBackend = open_backend(tiny_gemma, config)
    assert backend.info.n_swa == 4
    seq = backend.open_sequence()
    tokens = np.array(prompts(12, [400])["s0"], np.int32)
    for start in range(0, 400, 16):
        backend.decode([Segment(seq, start, tokens=tokens[start : start + 16])])
    assert backend.ctx.seq_pos_min(seq) > 40
    with pytest.raises(Fault) as info:
        backend.rewind(seq, 40)
    assert info.value.code is ErrorCode.POSITION and "sliding-window" in str(info.value)
    assert backend.length(seq) == 400
    backend.rewind(seq, 399)  # the window still covers a one-token retry
    backend.rewind(seq, 0)  # dropping everything is always possible
    assert backend.length(seq) == 0


@pytest.mark.parametrize("bounds", [[(0, 2), (2, 6)], [(0, 5), (5, 6)]])
def test_sliding_window_shards_are_bit_identical(
    tiny_gemma: Path, model_dir: Path, open_backend: OpenBackend, bounds: list[tuple[int, int]]
) -> None:
    # Layer 5 is the tiny gemma's one full-attention layer: a shard of it alone has no sliding
    # layer, which llama.cpp cannot build a sliding-window cache for (it aborts the process).
    shards = write_stages(tiny_gemma, model_dir / f"g3-{bounds[0][1]}", bounds)
    config = ContextConfig(n_seq_max=4, n_ctx=1024, n_batch=64, n_ubatch=16)
    ps = prompts(13, [9, 30, 5])
    whole = LocalChain([open_backend(tiny_gemma, config)]).greedy(ps, steps=16)
    split = LocalChain([open_backend(p, config) for p in shards]).greedy(ps, steps=16)
    for name in whole:
        for a, b in zip(whole[name], split[name], strict=True):
            assert np.array_equal(a, b)


def test_backend_close_is_idempotent(tiny_model: Path) -> None:
    backend = StageBackend(tiny_model, CONFIG)
    backend.open_sequence(Sampling(temperature=1.0, seed=1))
    backend.close()
    backend.close()
    with pytest.raises(RuntimeError, match="closed"):
        _ = backend.ctx.ptr


def test_tokenize_round_trip(tiny_model: Path, open_backend: OpenBackend) -> None:
    backend: StageBackend = open_backend(tiny_model)
    tokens = backend.tokenize("the cat and the hat")
    assert tokens[0] == 1 and len(tokens) > 3
    assert backend.detokenize(tokens[1:]).strip() == "the cat and the hat"
    with pytest.raises(Fault):
        backend.detokenize([9999])


def test_quantized_tiny_models_must_fit_the_blocks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiples of 256"):
        write_tiny_model(tmp_path / "k.gguf", TinySpec(quant="q4_k_m"))  # n_embd 64
    with pytest.raises(ValueError, match="quant must be one of"):
        write_tiny_model(tmp_path / "x.gguf", TinySpec(quant="q3_k_s"))
    assert not list(tmp_path.iterdir())


def test_greedy_sampling_picks_what_llama_cpps_greedy_sampler_picks(
    tiny_quant: Path, open_backend: OpenBackend
) -> None:
    """The greedy path takes the argmax of the logits row itself; llama.cpp's sampler must agree."""
    import llama_cpp as lc  # noqa: PLC0415

    backend = open_backend(tiny_quant)
    seqs = [backend.open_sequence() for _ in range(4)]
    rng = np.random.default_rng(3)
    segs = [Segment(s, 0, tokens=rng.integers(3, 200, 5, dtype=np.int32), output=Output.TOKEN) for s in seqs]
    ours = [r.token for r in backend.decode(segs)]
    reference = lc.llama_sampler_init_greedy()
    try:
        theirs = [int(lc.llama_sampler_sample(reference, backend.ctx.ptr, 5 * i + 4)) for i in range(4)]
    finally:
        lc.llama_sampler_free(reference)
    assert ours == theirs and len(set(ours)) > 1


def _resident_bytes_of(path: Path) -> int:
    """Bytes of `path` this process holds resident through its mappings (/proc/self/smaps)."""
    target, total, inside = str(path.resolve()), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            inside = fields[-1] == target
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_trim"), reason="glibc's malloc_trim")
def test_heap_a_load_freed_goes_back_to_the_system() -> None:
    """Blocks freed below the heap's top stay resident until released: free() alone gives back
    only a free top, and a stage's later allocations are too few to reuse them."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 64 * 1024  # under glibc's mmap threshold: heap blocks
    blocks = [libc.malloc(size) for _ in range(256)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks[:-1]:
        libc.free(block)
    held = resident_memory().anon
    assert release_free_heap()
    released = held - resident_memory().anon
    libc.free(blocks[-1])  # it kept the freed blocks below the top until now
    assert released >= 8 * 2**20  # of the 16 MiB freed


def test_released_file_pages_come_back_on_use_with_identical_outputs(
    tiny_model: Path, open_backend: OpenBackend, tmp_path: Path
) -> None:
    """A stage keeps resident only the weights it computes with: loading reads the whole file, then
    its pages are dropped, and they come back from the file on the next touch, changing nothing."""
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_model.read_bytes())
    kept, dropped = open_backend(tiny_model), open_backend(copy)
    assert _resident_bytes_of(copy) == 0  # nothing touched since the load released it
    first = np.array(prompts(3, [9])["s0"], np.int32)
    follow = np.array(prompts(4, [5])["s0"], np.int32)
    for backend in (kept, dropped):
        seq = backend.open_sequence()
        backend.decode([Segment(seq, 0, tokens=first, output=Output.LOGITS)])
    assert _resident_bytes_of(copy) > 0
    assert release_mapped_file(copy) > 0
    assert _resident_bytes_of(copy) == 0 and _resident_bytes_of(tiny_model) > 0
    outs = []
    for backend in (kept, dropped):
        seq = backend.open_sequence()
        outs.append(backend.decode([Segment(seq, 0, tokens=follow, output=Output.LOGITS)])[0].logits)
    assert outs[0] is not None and outs[1] is not None
    assert np.array_equal(outs[0], outs[1])
    assert _resident_bytes_of(copy) > 0


def _resident_pages(path: Path, offset: int, nbytes: int) -> int:
    """How many pages of `path`'s bytes [offset, offset + nbytes) this process's mapping holds
    resident (the present bit of /proc/self/pagemap, readable for one's own pages)."""
    page = os.sysconf("SC_PAGE_SIZE")
    target = str(path.resolve())
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[5] != target:
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        address = start + offset - int(fields[2], 16)  # the mapping may begin past the file's start
        if start <= address and address + nbytes <= end:
            first, last = address // page, (address + nbytes - 1) // page
            with open("/proc/self/pagemap", "rb") as pagemap:
                pagemap.seek(first * 8)
                entries = pagemap.read(8 * (last - first + 1))
            return sum(int.from_bytes(entries[i : i + 8], "little") >> 63 for i in range(0, len(entries), 8))
    raise AssertionError(f"{path} is not mapped")


def test_a_non_last_stage_holds_no_page_of_the_output_head(tmp_path: Path, open_backend: OpenBackend) -> None:
    """It never runs the vocabulary projection: after loading and decoding it holds at most the
    few pages of the `output` tensor the kernel maps around neighbouring ones it touches
    (fault-around); the last stage, which runs it, holds every page."""
    model = write_tiny_model(tmp_path / "wide-vocab.gguf", TinySpec(n_vocab=4096))  # a 1 MiB output head
    counts, pages = [], 0
    for path in write_stages(model, tmp_path / "stages", [(0, 2), (2, 4)]):
        backend = open_backend(path)
        seq = backend.open_sequence()
        if backend.info.first:
            tokens = np.array(prompts(1, [20])["s0"], np.int32)
            backend.decode([Segment(seq, 0, tokens=tokens, output=Output.HIDDEN)])
        else:
            hidden = np.random.default_rng(0).standard_normal((20, backend.info.n_embd)).astype(np.float32)
            backend.decode([Segment(seq, 0, hidden=hidden, output=Output.LOGITS)])
        header = read_header(path)
        head = next(t for t in header.tensors if t.name == "output.weight")
        pages = -(-head.nbytes // os.sysconf("SC_PAGE_SIZE"))
        counts.append(_resident_pages(path, header.data_offset + head.offset, head.nbytes))
    assert counts[0] < pages // 4 and counts[1] >= pages - 1  # (its ends may share a page with a neighbour)


def test_a_non_last_stage_reserves_no_vocabulary_head(tmp_path: Path, open_backend: OpenBackend) -> None:
    """Its capture block lets it ask llama.cpp for no output row: its compute buffer has no room for
    logits and its logits buffer never grows, where the last stage's (same layers) holds a logits
    row for every row of a ubatch."""
    # a vocabulary wide enough that logits outweigh the attention scores in llama.cpp's compute buffer
    model = write_tiny_model(tmp_path / "wide-vocab.gguf", TinySpec(n_vocab=32768))
    config = replace(CONFIG, n_batch=64, n_ubatch=64)
    head, tail = (open_backend(p, config) for p in write_stages(model, tmp_path / "s", [(0, 2), (2, 4)]))
    assert head.capture_all and not tail.capture_all
    logits = 4 * head.info.n_vocab * config.n_ubatch
    assert head.compute_buffer_bytes < logits <= tail.compute_buffer_bytes  # no room for one logits tensor
    assert head.output_buffer_bytes() == 4 * head.info.n_vocab * config.n_seq_max
    seq = head.open_sequence()
    tokens = np.array(prompts(2, [config.n_batch])["s0"], np.int32) % head.info.n_vocab
    hidden = head.decode([Segment(seq, 0, tokens=tokens, output=Output.HIDDEN)])[0].hidden
    assert hidden is not None and hidden.shape == (config.n_batch, head.info.n_embd)  # every row, none an output


def _maps_file(path: Path) -> bool:
    target = str(path.resolve())
    return any(line.endswith(" " + target) for line in Path("/proc/self/maps").read_text().splitlines())


def test_a_stage_holding_a_tied_head_reads_its_file_into_memory_and_computes_the_same(
    tiny_shaped: Path, tiny_model: Path, tmp_path: Path, open_backend: OpenBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head that is the token embedding reads all of it each step, so the stage that holds it
    maps nothing (no page-cache neighbours come with what it reads); every other stage maps its file."""
    tied_first, tied_last = write_stages(tiny_shaped, tmp_path / "tied", [(0, 2), (2, 4)])
    (untied_last,) = write_stages(tiny_model, tmp_path / "untied", [(2, 4)])
    files = (tiny_shaped, tied_first, tied_last, tiny_model, untied_last)
    assert [reads_every_weight(read_header(p), p) for p in files] == [True, False, True, False, False]

    def logits_of(backend: StageBackend) -> np.ndarray:
        hidden = np.random.default_rng(3).standard_normal((6, backend.info.n_embd)).astype(np.float32)
        seq = backend.open_sequence()
        out = backend.decode([Segment(seq, 0, hidden=hidden, output=Output.LOGITS)])[0].logits
        assert out is not None
        return out

    read = open_backend(tied_last)
    assert not read.model.mapped and not _maps_file(tied_last)
    untied = open_backend(untied_last)
    assert untied.model.mapped and _maps_file(untied_last)
    monkeypatch.setattr(llama_handles, "reads_every_weight", lambda header, path: False)
    mapped = open_backend(tied_last)  # the same stage, mapped as before
    assert mapped.model.mapped and _maps_file(tied_last)
    assert np.array_equal(logits_of(read), logits_of(mapped))


@pytest.mark.parametrize("temperature", [150.0, float(np.finfo(np.float32).max)])
def test_a_huge_temperature_samples_from_the_whole_vocabulary(
    tiny_model: Path, open_backend: OpenBackend, temperature: float
) -> None:
    """The largest temperatures the wire takes (float32's largest) flatten the distribution, and
    never turn the logits into NaN: every draw is a token of the vocabulary, and they differ."""
    backend: StageBackend = open_backend(tiny_model)
    prompt = np.array(prompts(8, [6])["s0"], np.int32)
    drawn = set()
    for seed in range(8):
        seq = backend.open_sequence(Sampling(temperature=temperature, seed=seed))
        token = backend.decode([Segment(seq, 0, tokens=prompt, output=Output.TOKEN)])[0].token
        assert token is not None and 0 <= token < backend.info.n_vocab
        drawn.add(token)
        backend.close_sequence(seq)
    assert len(drawn) > 4


def test_closed_handles_refuse_instead_of_reaching_freed_memory(tiny_model: Path) -> None:
    """After close, the model's vocabulary and the context's KV memory are gone: using them is
    an error here, never a call into llama.cpp with a freed (or null) pointer."""
    backend = StageBackend(tiny_model, CONFIG)
    model, ctx = backend.model, backend.ctx
    backend.close()
    backend.close()  # twice is safe
    with pytest.raises(RuntimeError, match="model is closed"):
        model.tokenize("hello")
    with pytest.raises(RuntimeError, match="model is closed"):
        model.is_eog(1)
    with pytest.raises(RuntimeError, match="context is closed"):
        ctx.seq_rm(0, 0)


def test_a_context_llama_cpp_refuses_fails_with_one_error(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """More sequences than llama.cpp holds (256): a ValueError, and nothing else on the way out
    (no half-built handle complaining when it is collected)."""
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(ValueError, match="could not create a context"):
        StageBackend(tiny_model, replace(CONFIG, n_seq_max=300))
    gc.collect()
    assert unraisable == []
