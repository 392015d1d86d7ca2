"""Speculative decoding keeps the model's output exact: greedy tokens equal plain decoding on every
architecture (KV, sliding-window, conv and DeltaNet caches roll back), with drafts that agree always (the
model itself), often (a noisy copy of it: rounds end at every position) or hardly ever (a small random
model); sampling keeps the target's distribution (rejection sampling, checked on counts); the cache ends
as plain decoding leaves it; Qwen3.5's MTP head drafts, and matches its reference."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

import mlxchat
from mlxchat import CheckpointError, GenerationConfig, InvalidInputError
from mlxchat.speculative import Acceptance
from mlxchat.testing import SessionContract, fixture_folders, load_fixture, reference

from conftest import FIXTURES

ARCHITECTURES = fixture_folders(FIXTURES, variants=False)
GREEDY = {"temperature": 0.0, "max_tokens": 24}


def noisy_copy(folder: Path, scale: float = 0.05, seed: int = 0) -> mlxchat.GenerativeModel:
    """The fixture's model loaded again with every weight multiplied by ``1 + scale * noise``: it agrees with
    the original on most tokens but not all."""
    model = mlxchat.load_model(folder, dtype="float32")

    def perturb() -> None:
        rng = np.random.default_rng(seed)
        noisy = [(k, v * mx.array(1 + scale * rng.standard_normal(v.shape), v.dtype) if mx.issubdtype(
            v.dtype, mx.floating) else v) for k, v in tree_flatten(model.module.parameters())]
        model.module.update(tree_unflatten(noisy))
        mx.eval(model.module.parameters())

    model.worker.run(perturb)
    return model


def prompt_of(folder: Path) -> list[int]:
    ref = reference(folder)
    return ref["input_ids"][: int(ref["prompt_len"])].tolist()


@pytest.fixture(scope="module")
def noisy_drafts() -> dict[str, mlxchat.GenerativeModel]:
    drafts: dict[str, mlxchat.GenerativeModel] = {}
    yield drafts
    for draft in drafts.values():
        draft.close()


@pytest.mark.parametrize("folder", ARCHITECTURES, ids=lambda folder: folder.name)
@pytest.mark.parametrize("draft_tokens", [1, 4])
def test_greedy_speculative_output_equals_plain_decoding(folder: Path, draft_tokens: int,
                                                         noisy_drafts: dict[str, mlxchat.GenerativeModel]) -> None:
    model = load_fixture(folder)
    prompt = prompt_of(folder)
    plain = model.generate(prompt, GREEDY)
    noisy = noisy_drafts.setdefault(folder.name, noisy_copy(folder))
    for draft in (model, noisy):
        result = model.with_draft(draft).generate(prompt, {**GREEDY, "draft_tokens": draft_tokens})
        assert result.tokens == plain.tokens
        report = result.report
        assert report.draft_tokens > 0
        assert report.accepted_draft_tokens == report.draft_tokens if draft is model else (
            0 <= report.accepted_draft_tokens <= report.draft_tokens)


def test_a_noisy_draft_has_rounds_end_at_every_position() -> None:
    """The exactness test above means something only if drafts are rejected at varied positions."""
    folder = FIXTURES / "qwen3_5"
    model = load_fixture(folder)
    draft = noisy_copy(folder, scale=0.1)
    try:
        report = model.with_draft(draft).generate(prompt_of(folder), {**GREEDY, "max_tokens": 32,
                                                                     "draft_tokens": 4}).report
    finally:
        draft.close()
    assert 0 < report.accepted_draft_tokens < report.draft_tokens


def test_greedy_with_penalties_and_stop_strings_equals_plain_decoding() -> None:
    model = load_fixture(FIXTURES / "qwen3_5")
    prompt = prompt_of(FIXTURES / "qwen3_5")
    config = {**GREEDY, "repetition_penalty": 1.3, "frequency_penalty": 0.4, "logit_bias": {5: 2.0}}
    plain = model.generate(prompt, config)
    draft = noisy_copy(FIXTURES / "qwen3_5")
    try:
        assert model.with_draft(draft).generate(prompt, {**config, "draft_tokens": 3}).tokens == plain.tokens
    finally:
        draft.close()


def test_a_small_random_draft_with_another_embedding_size_gives_the_same_tokens() -> None:
    folder = FIXTURES / "qwen3"
    model = load_fixture(folder)
    config = {"model_type": "qwen3", "vocab_size": model.tokenizer.vocab_size, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 16, "tie_word_embeddings": True}
    draft = mlxchat.build_model(config, tokenizer=folder)
    assert draft.config.vocab_size != model.config.vocab_size
    try:
        prompt = prompt_of(folder)
        result = model.with_draft(draft).generate(prompt, {**GREEDY, "draft_tokens": 3})
        assert result.tokens == model.generate(prompt, GREEDY).tokens
        assert result.report.draft_tokens > 0
    finally:
        draft.close()


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "lfm2", "gemma4"])
def test_the_cache_ends_as_plain_decoding_leaves_it(name: str) -> None:
    """However a generation stops (length, a stop string mid-round), the next one from the same cache reuses
    exactly what plain decoding's would, and gives the same tokens."""
    folder = FIXTURES / name
    model = load_fixture(folder)
    speculative = model.with_draft(noisy_copy(folder))
    try:
        prompt = prompt_of(folder)
        text = model.generate(prompt, GREEDY).text
        for config in (GREEDY, {**GREEDY, "stop": [text[len(text) // 2 :][:3]]} if text else GREEDY):
            caches = [model.make_prompt_cache(), speculative.make_prompt_cache()]
            first = [m.generate(prompt, config, cache=c) for m, c in zip((model, speculative), caches, strict=True)]
            assert first[0].tokens == first[1].tokens
            assert caches[0].tokens == caches[1].tokens
            follow = prompt + first[0].tokens + prompt[:5]
            second = [m.generate(follow, config, cache=c) for m, c in zip((model, speculative), caches, strict=True)]
            assert second[0].tokens == second[1].tokens
            assert second[0].report.cached_prompt_tokens == second[1].report.cached_prompt_tokens
    finally:
        assert isinstance(speculative.draft, mlxchat.GenerativeModel)
        speculative.draft.close()


def test_the_drafts_state_counts_in_the_cache_memory() -> None:
    """A server bounds its idle caches by their bytes: the draft's cache and the MTP head's rows count."""
    for folder, make in ((FIXTURES / "qwen3", lambda m: m.with_draft(m)), (MTP, lambda m: m)):
        model = load_fixture(folder)
        cache = model.make_prompt_cache()
        plain = model.make_prompt_cache()
        prompt = prompt_of(folder)
        make(model).generate(prompt, {**GREEDY, "draft_tokens": 2}, cache=cache)
        model.generate(prompt, GREEDY, cache=plain)
        assert cache.draft is not None and cache.nbytes > plain.nbytes


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Drafts drawn from q, kept with probability min(1, p/q), a rejection redrawn from max(0, p - q): the
    token that comes out has distribution p, whatever q is."""
    p_logits = mx.log(mx.array([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    q = mx.array([[0.1, 0.1, 0.4, 0.4]])
    acceptance = Acceptance(temperature=1.0, seed=0)
    counts: Counter[int] = Counter()
    trials = 4000
    for _ in range(trials):
        draft = mx.random.categorical(mx.log(q), key=acceptance.keys.next())
        kept, token = acceptance.verify(p_logits, draft, q)
        counts[int(token.item()) if int(kept.item()) == 0 else int(draft.item())] += 1
    observed = np.array([counts[i] / trials for i in range(4)])
    assert np.abs(observed - [0.5, 0.3, 0.15, 0.05]).max() < 0.03


def test_sampled_speculative_decoding_is_reproducible_with_a_seed() -> None:
    model = load_fixture(FIXTURES / "qwen3")
    speculative = model.with_draft(model, draft_tokens=3)
    config = {"temperature": 0.8, "top_k": 20, "max_tokens": 16, "seed": 11}
    prompt = prompt_of(FIXTURES / "qwen3")
    first, second = speculative.generate(prompt, config), speculative.generate(prompt, config)
    assert first.tokens == second.tokens
    assert first.report.accepted_draft_tokens == first.report.draft_tokens  # its own draft: p == q


def test_a_draft_with_another_tokenizer_is_refused() -> None:
    model = load_fixture(FIXTURES / "qwen3")
    demo = mlxchat.load_model()
    try:
        with pytest.raises(CheckpointError, match="does not share this model's tokenizer"):
            model.with_draft(demo)
    finally:
        demo.close()


def test_draft_tokens_without_a_draft_is_an_input_error() -> None:
    model = load_fixture(FIXTURES / "qwen3")
    with pytest.raises(InvalidInputError, match="needs a draft"):
        model.generate([1, 2, 3], {"draft_tokens": 2, "max_tokens": 2})
    with pytest.raises(CheckpointError, match="no multi-token-prediction head"):
        model.with_draft("mtp")
    with pytest.raises(ValueError):
        GenerationConfig(draft_tokens=-1)


def test_load_model_with_a_draft_path_loads_and_closes_it() -> None:
    folder = FIXTURES / "qwen3"
    model = mlxchat.load_model(folder, draft=folder, draft_tokens=2)
    assert model.defaults.draft_tokens == 2 and isinstance(model.draft, mlxchat.GenerativeModel)
    result = model.generate(prompt_of(folder), {**GREEDY, "max_tokens": 8})
    assert result.report.draft_tokens > 0
    assert result.tokens == load_fixture(folder).generate(prompt_of(folder), {**GREEDY, "max_tokens": 8}).tokens
    draft = model.draft
    model.close()
    with pytest.raises(RuntimeError, match="closed"):
        draft.worker.submit(lambda: None)


# -- Qwen3.5's multi-token-prediction head ------------------------------------------------------------------

MTP = FIXTURES / "qwen3_5_mtp"


def test_the_mtp_head_loads_from_the_released_layout_and_matches_its_reference() -> None:
    """The head's logits for the reference sequence (target states at 0..L-2, tokens 1..L-1) against
    transformers' Qwen3.5 layers wired as vLLM's MTP head (tests/fixtures/builders/qwen35.py)."""
    model = load_fixture(MTP)
    assert model.has_mtp and not load_fixture(FIXTURES / "qwen3_5").has_mtp
    ref = reference(MTP)
    ids = ref["input_ids"]

    def run() -> np.ndarray:
        module = model.module
        states = module.model(mx.array(ids)[None])
        out = module.mtp_step(states[:, :-1], mx.array(ids[1:])[None], module.make_mtp_cache())
        return np.array(module.project(out)[0])

    assert np.abs(model.worker.run(run) - ref["mtp_logits"]).max() < 1e-4


def test_mtp_drafts_exactly_in_rounds_and_across_a_session() -> None:
    model = load_fixture(MTP)
    prompt = prompt_of(MTP)
    plain = model.generate(prompt, {**GREEDY, "max_tokens": 32})
    for draft_tokens in (1, 3):
        result = model.generate(prompt, {**GREEDY, "max_tokens": 32, "draft_tokens": draft_tokens})
        assert result.tokens == plain.tokens
        assert result.report.draft_tokens > 0
    assert model.with_draft("mtp", 2).defaults.draft_tokens == 2


def test_mtp_rows_follow_the_conversation() -> None:
    """The head's cache covers every position of the cached conversation after prefill and rounds, and
    rows of a changed history are dropped (its attention never sees tokens the conversation lost)."""
    model = load_fixture(MTP)
    cache = model.make_prompt_cache()
    prompt = prompt_of(MTP)
    first = model.generate(prompt, {**GREEDY, "draft_tokens": 3}, cache=cache)
    state = cache.draft
    assert state.covered == len(cache.tokens) and state.tokens[: len(cache.tokens)] == cache.tokens
    changed = prompt[:6] + [7, 8, 9]
    model.generate(changed, {**GREEDY, "max_tokens": 4, "draft_tokens": 3}, cache=cache)
    assert cache.draft.tokens[:9] == changed
    assert first.tokens  # the first reply ran


class TestSpeculativeSessions(SessionContract):
    """The session contract holds with speculative decoding on (every reply drafted by a noisy copy or,
    for Qwen3.5, its MTP head): rollbacks leave caches and snapshots exactly as turns expect."""

    @pytest.fixture(params=["qwen3", "lfm2", "qwen3_5_mtp"])
    def fixture_folder(self, request: pytest.FixtureRequest) -> Path:
        return FIXTURES / request.param

    @pytest.fixture
    def model(self, fixture_folder: Path, noisy_drafts: dict[str, mlxchat.GenerativeModel]) -> mlxchat.GenerativeModel:
        target = load_fixture(fixture_folder)
        if target.has_mtp:
            return target.with_draft("mtp", 3)
        return target.with_draft(noisy_drafts.setdefault(fixture_folder.name, noisy_copy(fixture_folder)), 3)
