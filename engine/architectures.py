"""What the shard tool must know about a model architecture to cut it into layer ranges.

Facts read from the llama.cpp sources vendored with llama-cpp-python 0.3.36
(`src/models/*.cpp`, `src/llama-model.cpp`).
"""

from __future__ import annotations

# Architectures whose graph names each layer's output `l_out-N` (the tensor a
# non-last stage captures) and whose layers depend only on their own metadata.
LAYER_SPLITTABLE = frozenset(
    {
        "apertus", "arcee", "baichuan", "bitnet", "bloom", "chatglm", "codeshell",
        "cohere2", "command-r", "dbrx", "deci", "ernie4_5", "ernie4_5-moe", "exaone",
        "exaone4", "falcon", "gemma", "gemma2", "gemma3", "glm4", "glm4moe", "gpt2",
        "gptneox", "granite", "grok", "internlm2", "jais", "llama", "minicpm3",
        "mistral3", "mpt", "nemotron", "olmo", "olmo2", "olmoe", "orion", "phi2",
        "phi3", "plamo", "qwen", "qwen2", "qwen2moe", "qwen2vl", "qwen3", "qwen3moe",
        "qwen3vl", "refact", "seed_oss", "smollm3", "stablelm", "starcoder",
        "starcoder2", "xverse",
    }
)  # fmt: skip

# Why the remaining known architectures cannot be served as layer ranges.
REFUSED = {
    **dict.fromkeys(
        ("mamba", "mamba2", "rwkv6", "rwkv7", "arwkv7", "rwkv6qwen2", "jamba",
         "falcon-h1", "granitehybrid", "qwen3next", "kimi-linear", "lfm2",
         "nemotron_h", "plamo2", "qwen35", "qwen35moe"),
        "keeps recurrent state, not a per-position KV cache",
    ),
    **dict.fromkeys(
        ("llama4", "deepseek", "deepseek2", "gemma3n", "afmoe", "laguna"),
        "derives a layer's kind from its absolute index, which a shard renumbers",
    ),
    **dict.fromkeys(
        ("bert", "nomic-bert", "jina-bert-v2", "jina-bert-v3", "modern-bert", "t5",
         "t5encoder", "gemma-embedding", "llama-embed"),
        "is an encoder or embedding model",
    ),
}  # fmt: skip

# Sliding-window defaults: architecture -> (period, dense_first) as llama.cpp's
# `load_swa_pattern` applies them when the file has no explicit pattern.
SWA_DEFAULT_PATTERN = {
    "gemma2": (2, False),
    "gemma3": (6, False),
    "cohere2": (4, False),
    "exaone4": (4, False),
    "olmo2": (4, False),
}


def refusal(arch: str) -> str | None:
    """Why `arch` cannot be split into layer ranges, or None when it can."""
    if arch in LAYER_SPLITTABLE:
        return None
    reason = REFUSED.get(arch, "does not name its layer outputs l_out-N in llama.cpp's graph")
    return f"architecture {arch!r} {reason}; it cannot be served as layer ranges"


def swa_layers(n_layer: int, period: int, dense_first: bool) -> list[bool]:
    """llama.cpp's `set_swa_pattern`: which layers use the sliding window."""
    if dense_first:
        return [period == 0 or i % period != 0 for i in range(n_layer)]
    return [period == 0 or i % period < period - 1 for i in range(n_layer)]
