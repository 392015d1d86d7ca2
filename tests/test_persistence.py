"""Sessions and prompt caches on disk (mlxchat.persistence): what a file refuses (another model, damage, the
wrong kind), ``load_session(resume=...)``, and a vision prompt cache (images, rotary shifts, snapshots)
coming back exactly. Every architecture's save-and-resume contract runs in test_conformance.py."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

import mlxchat
from mlxchat import persistence
from mlxchat.errors import InvalidInputError, SavedStateError, SessionStateError
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


def rewritten(path: Path, change: Any, version: int = persistence.VERSION, signed: bool = True) -> Path:
    """The saved file at ``path`` with ``change(header)`` made to its document, signed again as ``version`` signs
    (a file written so, not damage; the oldest files were not ``signed``)."""
    arrays, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
    header = json.loads(metadata["mlxchat"])
    change(header)
    header.pop("digest")
    header["version"] = version
    if signed:
        header["digest"] = persistence._checksum(arrays, header["cache"] if version == 1 else header)
    out = path.with_name(f"rewritten-{path.stem}.safetensors")
    mx.save_safetensors(str(out), arrays, metadata={"mlxchat": json.dumps(header)})
    return out


def test_a_bit_flipped_anywhere_in_the_document_is_refused(saved, tmp_path) -> None:
    """The checksum covers the transcript and the header too, not only the cache (a flipped bit in an alias
    made a snapshot another layer's state; one in a message changed what the session remembered)."""
    model = loaded("qwen3")
    data = saved.read_bytes()
    for text, at in ((b"Hello there", 8), (b"architecture", 2)):
        damaged = bytearray(data)
        damaged[data.index(text) + at] ^= 0x02
        (tmp_path / "flipped.session").write_bytes(bytes(damaged))
        with pytest.raises(SavedStateError, match="damaged"):
            mlxchat.ChatSession.load(model, tmp_path / "flipped.session")


def test_a_file_of_format_version_1_still_loads(saved) -> None:
    model = loaded("qwen3")
    old = rewritten(saved, lambda header: None, version=1)
    assert mlxchat.ChatSession.load(model, old).messages == mlxchat.ChatSession.load(model, saved).messages
    unsigned = rewritten(saved, lambda header: None, version=1, signed=False)
    assert len(mlxchat.ChatSession.load(model, unsigned).cache) == len(mlxchat.ChatSession.load(model, saved).cache)


def test_images_kept_as_data_urls_whatever_the_schemes_case() -> None:
    from mlxchat.multimodal import images_kept

    kept = [{"role": "user", "content": [{"type": "image", "image": "DATA:image/png;base64,AAAA"}]}]
    named = [{"role": "user", "content": [{"type": "image", "image": "/etc/hostname"}]}]
    assert images_kept(kept) and not images_kept(named)


def test_a_saved_transcript_naming_an_image_file_is_refused(saved) -> None:
    """A session keeps its images as data: URLs; a file naming a path (or URL) there must not make us read it."""
    def name_a_file(header: dict[str, Any]) -> None:
        header["extras"]["session"]["messages"][-2]["content"] = [{"type": "image", "image": "/etc/hostname"},
                                                                   {"type": "text", "text": "Hello there"}]

    with pytest.raises(SavedStateError, match="an image of the saved conversation is not kept in it"):
        mlxchat.ChatSession.load(loaded("qwen3"), rewritten(saved, name_a_file))


def test_aliases_that_name_no_array_or_hide_one_are_refused(saved) -> None:
    model = loaded("qwen3")
    arrays = mx.load(str(saved), format="safetensors")
    real = sorted(arrays)
    for aliases in ({"x": [1]}, {"x": "nothing"}, {real[0]: real[1]}):
        with pytest.raises(SavedStateError, match="damaged"):
            mlxchat.ChatSession.load(model, rewritten(saved, lambda header, a=aliases: header.update(aliases=a)))
    with pytest.raises(SavedStateError, match="damaged"):
        mlxchat.ChatSession.load(model, rewritten(saved, lambda header: header["model"].update(fingerprint=[1])))


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


@pytest.mark.parametrize(("name", "kv_bits"), [("qwen3", None), ("qwen3", 8), ("qwen3", 16), ("lfm2", None)])
def test_a_cache_file_of_another_shape_is_refused_at_load(name, kv_bits, tmp_path) -> None:
    """A tensor-parallel rank's file holds part of each layer's heads (or channels): it passes the header
    check (same model) and must fail at load, not later as a GenerationError."""
    model = loaded(name)
    cache = model.make_prompt_cache(kv_bits=kv_bits)
    model.generate([1, 2, 3], {"max_tokens": 2}, cache=cache)

    def split() -> None:  # on the worker, whose arrays these are
        for layer in cache.layers:
            if isinstance(layer, mlxchat.cache.QuantizedKVCache) and layer.tail is not None:
                heads = layer.tail[0].shape[1]
                layer.tail = (layer.tail[0][:, : heads // 2], layer.tail[1][:, : heads // 2])
                return
            if isinstance(layer, mlxchat.cache.KeysValues) and layer.keys is not None:
                heads = layer.keys.shape[1]
                layer.keys, layer.values = layer.keys[:, : heads // 2], layer.values[:, : heads // 2]
                return
            if isinstance(layer, mlxchat.cache.StateCache) and layer.arrays and layer.arrays[0] is not None:
                layer.arrays[0] = layer.arrays[0][..., : layer.arrays[0].shape[-1] // 2]
                return
        raise AssertionError("no layer holds arrays")

    model.worker.run(split)
    save_prompt_cache(model, cache, tmp_path / "rank.cache")
    with pytest.raises(SavedStateError, match=r"do not fit this model's .*tensor-parallel rank"):
        load_prompt_cache(model, tmp_path / "rank.cache")
    whole = model.make_prompt_cache(kv_bits=kv_bits)
    model.generate([1, 2, 3], {"max_tokens": 2}, cache=whole)
    save_prompt_cache(model, whole, tmp_path / "whole.cache")
    assert load_prompt_cache(model, tmp_path / "whole.cache")[0].tokens == whole.tokens


@pytest.mark.parametrize("damage", ["state left out", "scales as bytes", "biases wider", "a huge shift"])
def test_a_cache_file_whose_layer_fields_do_not_fit_is_refused_at_load(damage, tmp_path) -> None:
    """Arrays and fields a file could carry that fit the layout but not the layer: a hybrid's state left out (it
    read as zeros and answered wrongly), quantized keys' scales that are no floats or biases of another shape,
    a rotary shift past 32 bits (each loaded, then failed every turn or answered garbage)."""
    model = loaded("lfm2" if damage == "state left out" else "qwen3")
    cache = model.make_prompt_cache(kv_bits=None if damage == "state left out" else 8)
    model.generate(list(range(1, 80)), {"max_tokens": 2}, cache=cache)

    def spoil() -> None:  # on the worker, whose arrays these are
        layer = cache.layers[0]
        if damage == "state left out":
            layer.arrays[0] = None
        elif damage == "a huge shift":
            layer.shifts = [(0, 2**40)]
        else:
            (packed, scales, biases), values = layer.quantized
            if damage == "scales as bytes":
                scales = scales.astype(mx.uint8)
            else:
                biases = mx.concatenate([biases, biases], axis=-1)
            layer.quantized = ((packed, scales, biases), values)

    model.worker.run(spoil)
    save_prompt_cache(model, cache, tmp_path / "spoilt.cache")
    with pytest.raises(SavedStateError, match="without its state|scales and biases|shifts"):
        load_prompt_cache(model, tmp_path / "spoilt.cache")


def test_a_session_saved_with_tools_resumed_where_the_template_takes_none_says_what_to_do(tmp_path) -> None:
    folder = tmp_path / "no-tools"
    shutil.copytree(fixture_path("qwen3"), folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    def get_weather(city: str) -> str:
        """Get the weather.

        Args:
            city: The city.
        """
        return "sunny"

    session = loaded("qwen3").chat_session(tools=[get_weather])
    session.send("Hello there", config=GREEDY)
    session.save(tmp_path / "tools.session")
    with mlxchat.load_model(folder) as model:
        assert not model.supports_tools
        with pytest.raises(SavedStateError, match="takes no tools .* tools=\\[\\] drops the saved tools"):
            mlxchat.ChatSession.load(model, tmp_path / "tools.session")
        resumed = mlxchat.ChatSession.load(model, tmp_path / "tools.session", tools=[])
        assert [m.content for m in resumed.messages] == [m.content for m in session.messages]


def test_a_transcript_that_is_no_list_of_messages_is_refused() -> None:
    session = loaded("qwen3").chat_session()
    for transcript in (["hi"], "hi", [1, 2]):
        with pytest.raises(InvalidInputError, match="a transcript is a list of messages"):
            session.prime_history(transcript)  # type: ignore[arg-type]
    session.prime_history(m for m in [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert [m.content for m in session.messages] == ["hi", "yo"]  # (an iterator: taken once)


def test_extras_with_keys_json_turns_into_strings_load_back(tmp_path) -> None:
    """The checksum is of the document as it is read back: keys JSON writes as strings sort the same there."""
    model = loaded("qwen3")
    save_prompt_cache(model, model.make_prompt_cache(), tmp_path / "e.cache", {"map": {10: "a", 2: "b"}})
    assert load_prompt_cache(model, tmp_path / "e.cache")[1] == {"map": {"10": "a", "2": "b"}}


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


def test_a_session_whose_model_named_a_function_with_a_lone_surrogate_saves_and_comes_back(tmp_path,
                                                                                           scripted) -> None:
    model = loaded("qwen3")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    session = model.chat_session(tools=tools, default_config={"max_tokens": 70})
    scripted.append(model.tokenizer.encode('<tool_call>\n{"name": "get_weather\\ud800", "arguments": {}}\n'
                                           "</tool_call>") + [model.tokenizer.token_id("<|im_end|>")])
    (call,) = session.send("Weather?").tool_calls
    assert call.status == "invalid" and call.name == "get_weather\\ud800" and "lone surrogate" in call.error
    session.save(tmp_path / "escaped.session")  # MLX refused the file's header: UTF-8 cannot carry U+D800
    assert mlxchat.ChatSession.load(model, tmp_path / "escaped.session").tool_calls[0].name == call.name


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
    assert resumed.export_state().model_dump(mode="json") == session.export_state().model_dump(mode="json")
    assert resumed.export_state().context_policy == "truncate_oldest" and resumed.tool_calls == session.tool_calls
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


def test_a_session_file_without_the_later_tool_settings_loads_with_their_defaults(saved) -> None:
    """Files written before ``auto_tools``, ``max_tool_rounds`` and ``decisions`` were saved still load."""
    def without(header: dict[str, Any]) -> None:
        for name in ("auto_tools", "max_tool_rounds", "decisions"):
            del header["extras"]["session"][name]

    state = mlxchat.ChatSession.load(loaded("qwen3"), rewritten(saved, without, version=1)).export_state()
    assert (state.auto_tools, state.max_tool_rounds, state.decisions) == (False, 8, {})
    assert [m.role for m in state.messages] == ["system", "user", "assistant"]


def private_attributes(source: str) -> list[str]:
    """The ``x._name`` attributes a module's source reads or writes (dunders aside)."""
    return sorted({node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)
                   and node.attr.startswith("_") and not node.attr.startswith("__")})


def test_persistence_reaches_the_session_only_through_its_public_api() -> None:
    """mlxchat.persistence saves and restores through export_state()/import_state(): it touches no private
    attribute of a session (nor of anything else)."""
    assert private_attributes(Path(persistence.__file__).read_text()) == []
    assert private_attributes("session._busy or session._load_decisions({})") == ["_busy", "_load_decisions"]
