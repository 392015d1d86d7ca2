"""Every architecture matches transformers on its tiny fixtures (float32): the full forward's logits,
cached decoding and prefill in uneven chunks (across sliding windows and DeltaNet chunks), and greedy
tokens; and every MLX-quantized copy written by mlx-lm's converter loads and matches mlx-lm itself."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import loaded, reference
from parity import assert_close, chunked_logits, full_logits, greedy

ARCHS = ["qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe", "gemma4", "gemma4_moe"]
# Other layouts of the same weights: mlx-lm's unquantized conversion (norms folded, conv transposed).
LAYOUTS = {"qwen3_5_mlx": "qwen3_5"}
QUANTIZED = ["qwen3_q4", "qwen3_moe_q4", "qwen3_5_q4", "qwen3_5_moe_q4", "lfm2_q4", "lfm2_moe_q4", "gemma4_q4",
             "gemma4_moe_q4"]
CHUNKINGS = [[24], [5, 11, 1, 7, 13], [3, 14, 2, 9, 1, 5], [20, 17, 3], [1, 1, 2, 30], [39]]
# mlx-lm's quantized references come from MLX's own kernel; mlxchat's CPU kernels (mlxchat.quantized) add up
# the same products in another order, and so does plain float32 `x @ mx.dequantize(w).T`: both land 1.2e-4 from
# the reference on gemma4_q4's logits (of up to 6.3), the most sensitive fixture.
QUANTIZED_TOLERANCE = 3e-4


@pytest.mark.parametrize("name", ARCHS)
def test_logits_match_transformers(name: str) -> None:
    ref = reference(name)
    assert np.abs(ref["logits"]).max() > 2  # logits of a few units: a 1e-4 match means something
    assert_close(full_logits(loaded(name), ref["input_ids"]), ref["logits"])


@pytest.mark.parametrize("name", LAYOUTS)
def test_other_layouts_of_the_same_weights_match(name: str) -> None:
    ref = reference(LAYOUTS[name])
    assert_close(full_logits(loaded(name), ref["input_ids"]), ref["logits"])


@pytest.mark.parametrize("chunks", CHUNKINGS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("name", ARCHS)
def test_cached_decoding_in_uneven_chunks_matches(name: str, chunks: list[int]) -> None:
    ref = reference(name)
    assert_close(chunked_logits(loaded(name), ref["input_ids"], chunks), ref["logits"])


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_continuation_equals_transformers(name: str) -> None:
    ref = reference(name)
    prompt = ref["input_ids"][: int(ref["prompt_len"])].tolist()
    assert greedy(loaded(name), prompt, len(ref["greedy"])) == ref["greedy"].tolist()


@pytest.mark.parametrize("name", QUANTIZED)
def test_mlx_lm_quantized_checkpoint_loads_and_matches_mlx_lm(name: str) -> None:
    ref = reference(name)
    model = loaded(name)
    assert model.quantization is not None and model.quantization["bits"] == 4
    assert_close(full_logits(model, ref["input_ids"]), ref["logits"], QUANTIZED_TOLERANCE)
    assert_close(chunked_logits(model, ref["input_ids"], [5, 11, 1, 7, 13]), ref["logits"], QUANTIZED_TOLERANCE)
    result = model.generate(ref["input_ids"][:8].tolist(), {"max_tokens": 10, "temperature": 0.0})
    assert len(result.tokens) == 10 or result.finish_reason == "stop"
