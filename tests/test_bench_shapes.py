"""The real-shape generator: published geometry, a tied head and a padded vocabulary that llama.cpp loads and splits."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from neuron_tai.shard import stage_bounds, write_stages
from testkit.local_chain import LocalChain
from testkit.models import tensor_shapes, vocabulary
from testkit.shapes import SHAPES
from tests.conftest import TINY_SHAPED, OpenBackend

# Parameter counts of the published checkpoints (their safetensors headers), which the
# geometry alone must reproduce: layers, widths, heads, KV heads, vocabulary, tying.
PUBLISHED_PARAMETERS = {"llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_shapes_have_the_published_parameter_count(name: str) -> None:
    spec = SHAPES[name]
    n_vocab = len(vocabulary(spec.n_vocab)[0])
    total = sum(rows * (cols or 1) for _, rows, cols in tensor_shapes(spec, n_vocab))
    assert n_vocab == 128256
    assert total == PUBLISHED_PARAMETERS[name]


def test_shaped_model_is_quantized_tied_and_padded(tiny_shaped: Path) -> None:
    reader = gguf.GGUFReader(str(tiny_shaped), "r")
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # the head is token_embd, as in Llama-3.2-1B
    assert tensors["token_embd.weight"].shape.tolist() == [TINY_SHAPED.n_embd, TINY_SHAPED.n_vocab]
    assert tensors["blk.0.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_K
    field = reader.get_field("general.name")
    assert field is not None and field.contents() == "tiny real-shape llama"


def test_shaped_model_tokenizes_text_and_its_split_gives_the_whole_models_logits(
    tiny_shaped: Path, tmp_path: Path, open_backend: OpenBackend
) -> None:
    whole = open_backend(tiny_shaped)
    text = "The lighthouse keeper climbed 112 stairs, every evening."
    tokens = whole.tokenize(text)
    assert tokens[0] == 1 and whole.detokenize(tokens[1:]) == text
    shards = write_stages(tiny_shaped, tmp_path / "s2", stage_bounds(TINY_SHAPED.n_layer, stages=2))
    prompt = {"a": tokens[:24], "b": whole.tokenize("Paris is the capital.")}  # within the test context's n_batch
    solo = LocalChain([whole]).greedy(prompt, steps=6)
    split = LocalChain([open_backend(p) for p in shards]).greedy(prompt, steps=6)
    for name, rows in solo.items():
        assert len(rows) == 7 and rows[0].shape == (TINY_SHAPED.n_vocab,)
        for step, (a, b) in enumerate(zip(rows, split[name], strict=True)):
            assert np.array_equal(a, b), f"{name} step {step}: max diff {np.abs(a - b).max()}"
