"""Sessions and prompt caches on disk (mlxchat.persistence): what a file refuses (another model, damage, the
wrong kind), ``load_session(resume=...)``, and a vision prompt cache (images, rotary shifts, snapshots)
coming back exactly. Every architecture's save-and-resume contract runs in test_conformance.py."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

import mlxchat
from mlxchat.errors import SavedStateError, SessionStateError
from mlxchat.persistence import load_prompt_cache, load_session_state, save_prompt_cache
from mlxchat.testing import GREEDY

from conftest import fixture_path, loaded
from vision_support import chat


@pytest.fixture
def saved(tmp_path):
    model = loaded("qwen3")
    session = model.chat_session(system="Be terse.")
    session.send("Hello there", config=GREEDY)
    path = tmp_path / "chat.session"
    session.save(path)
    return path


def test_a_session_file_refuses_another_architecture(saved) -> None:
    with pytest.raises(SavedStateError, match=r"another model .*architecture 'qwen3' there, 'lfm2' here"):
        mlxchat.ChatSession.load(loaded("lfm2"), saved)


@pytest.mark.parametrize("other", ["qwen3_moe", "qwen3_rope_linear"])
def test_a_session_file_refuses_the_same_architecture_with_another_config(saved, other) -> None:
    with pytest.raises(SavedStateError, match="differs: config"):
        mlxchat.ChatSession.load(loaded(other), saved)


def test_a_session_file_refuses_another_compute_dtype(saved) -> None:
    with mlxchat.load_model(fixture_path("qwen3"), dtype="bfloat16") as model:
        with pytest.raises(SavedStateError, match="dtype 'float32' there, 'bfloat16' here"):
            mlxchat.ChatSession.load(model, saved)


def test_damaged_or_foreign_files_are_refused(saved, tmp_path) -> None:
    model = loaded("qwen3")
    cut = tmp_path / "cut.session"
    cut.write_bytes(saved.read_bytes()[:200])
    other = tmp_path / "weights.safetensors"
    mx.save_safetensors(str(other), {"w": mx.zeros((2, 2))})
    for path, message in ((cut, "not a file mlxchat saved"), (other, "not a file mlxchat saved"),
                          (tmp_path / "missing", "no such file")):
        with pytest.raises(SavedStateError, match=message):
            mlxchat.ChatSession.load(model, path)


def test_a_file_whose_tokens_leave_the_vocabulary_is_refused(tmp_path) -> None:
    model = loaded("qwen3")
    cache = model.make_prompt_cache()
    model.generate([1, 2, 3], {"max_tokens": 2}, cache=cache)
    cache.tokens[0] = model.config.vocab_size + 7
    save_prompt_cache(model, cache, tmp_path / "bad.cache")
    with pytest.raises(SavedStateError, match="outside the vocabulary"):
        load_prompt_cache(model, tmp_path / "bad.cache")


def test_a_cache_file_that_does_not_fit_its_layers_is_refused(tmp_path) -> None:
    model = loaded("qwen3")
    cache = model.make_prompt_cache()
    model.generate([1, 2, 3], {"max_tokens": 2}, cache=cache)
    cache.tokens.append(5)  # one token more than the layers hold
    save_prompt_cache(model, cache, tmp_path / "off.cache")
    with pytest.raises(SavedStateError, match="position"):
        load_prompt_cache(model, tmp_path / "off.cache")


def test_a_prompt_cache_file_is_not_a_session(tmp_path) -> None:
    model = loaded("qwen3")
    save_prompt_cache(model, model.make_prompt_cache(), tmp_path / "empty.cache", {"note": "hi"})
    cache, extras = load_prompt_cache(model, tmp_path / "empty.cache")
    assert len(cache) == 0 and extras == {"note": "hi"}
    with pytest.raises(SavedStateError, match="not a session"):
        load_session_state(model, tmp_path / "empty.cache")


def test_load_session_resumes_a_saved_session(saved) -> None:
    session = mlxchat.load_session(fixture_path("qwen3"), resume=saved, dtype="float32")
    try:
        assert [m.role for m in session.messages] == ["system", "user", "assistant"]
        assert session.send("And of Italy?", config=GREEDY).report.cached_prompt_tokens > 0
    finally:
        session.model.close()


def test_a_session_in_a_turn_cannot_be_saved(tmp_path) -> None:
    session = loaded("qwen3").chat_session()
    stream = session.send_stream("Hello", config=GREEDY)
    for _ in stream:
        with pytest.raises(SessionStateError, match="in progress"):
            session.save(tmp_path / "busy.session")
        break


def test_saved_settings_and_calls_come_back(tmp_path, scripted) -> None:
    model = loaded("qwen3")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    session = model.chat_session(system="Be terse.", tools=tools, default_config={"max_tokens": 70, "seed": 7},
                                 context_policy="truncate_oldest")
    end = model.tokenizer.token_id("<|im_end|>")
    scripted.append(model.tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
                                           "</tool_call>") + [end])
    session.send("Weather in Rome?")
    session.save(tmp_path / "tools.session")
    resumed = mlxchat.ChatSession.load(model, tmp_path / "tools.session")
    assert resumed.tools == session.tools and resumed.tool_calls == session.tool_calls
    assert resumed._defaults == session._defaults and resumed._context_policy == "truncate_oldest"
    resumed.add_tool_result("call_1", "sunny")  # the unanswered call is still pending
    header = json.loads(mx.load(str(tmp_path / "tools.session"), format="safetensors",
                                return_metadata=True)[1]["mlxchat"])
    assert header["extras"]["session"]["calls_made"] == 1


@pytest.mark.parametrize("name", ["qwen3_5_vl", "gemma4_vl"])
def test_a_prompt_cache_with_images_comes_back_exactly(name, tmp_path) -> None:
    """Image keys, the rotary shift an image leaves (Qwen3.5's multimodal RoPE) and the snapshots before each
    image survive the round trip: a follow-up reuses the same and generates the same."""
    model = loaded(name)
    messages, images = chat(name, "two")
    config = {"temperature": 0.0, "max_tokens": 4, "prefill_step": 16}
    cache = model.make_prompt_cache()
    model.generate(messages, config, images=images, cache=cache)
    save_prompt_cache(model, cache, tmp_path / "vision.cache")
    restored, _ = load_prompt_cache(model, tmp_path / "vision.cache")
    assert restored.images == cache.images and restored.tokens == cache.tokens
    assert restored.snapshot_positions == cache.snapshot_positions
    shifts = [getattr(layer, "shifts", None) for layer in cache.layers]
    assert [getattr(layer, "shifts", None) for layer in restored.layers] == shifts
    follow = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "And then?"}]
    first = model.generate(follow, config, images=images, cache=cache)
    second = model.generate(follow, config, images=images, cache=restored)
    assert first.tokens == second.tokens
    assert first.report.cached_prompt_tokens == second.report.cached_prompt_tokens > 0
