"""The qwen3 plugin matches transformers: logits, cached decoding, chunked prefill, greedy tokens; and
mlx-lm-quantized checkpoints load and match mlx-lm."""

from __future__ import annotations

import pytest
from conftest import loaded, reference
from parity import assert_close, chunked_logits, full_logits, greedy

ARCHS = ["qwen3", "qwen3_moe"]


@pytest.mark.parametrize("name", ARCHS)
def test_logits_match_transformers(name: str) -> None:
    ref = reference(name)
    assert_close(full_logits(loaded(name), ref["input_ids"]), ref["logits"])


@pytest.mark.parametrize("name", ARCHS)
def test_cached_decoding_matches_full_forward(name: str) -> None:
    ref = reference(name)
    model = loaded(name)
    assert_close(chunked_logits(model, ref["input_ids"], [24]), full_logits(model, ref["input_ids"]))


@pytest.mark.parametrize("name", ARCHS)
def test_uneven_prefill_chunks_match(name: str) -> None:
    ref = reference(name)
    model = loaded(name)
    assert_close(chunked_logits(model, ref["input_ids"], [5, 11, 1, 7, 13]), ref["logits"])


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_continuation_equals_transformers(name: str) -> None:
    ref = reference(name)
    prompt = ref["input_ids"][: int(ref["prompt_len"])].tolist()
    assert greedy(loaded(name), prompt, len(ref["greedy"])) == ref["greedy"].tolist()


@pytest.mark.parametrize("name", ["qwen3_q4", "qwen3_moe_q4"])
def test_mlx_lm_quantized_checkpoint_loads_and_matches_mlx_lm(name: str) -> None:
    ref = reference(name)
    model = loaded(name)
    assert model.quantization is not None and model.quantization["bits"] == 4
    assert_close(full_logits(model, ref["input_ids"]), ref["logits"])
    result = model.generate(ref["input_ids"][:8].tolist(), {"max_tokens": 10, "temperature": 0.0})
    assert len(result.tokens) == 10 or result.finish_reason == "stop"
