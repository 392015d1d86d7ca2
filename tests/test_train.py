"""mlxchat.train: the loss mask, the training loop, the tokenizer trainer and the saved checkpoint."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

import mlxchat
from mlxchat.chat_template import ChatTemplate
from mlxchat.demo.build import TEMPLATE
from mlxchat.demo.data import DemoData
from mlxchat.demo.world import DEMO_TOOLS
from mlxchat.layers import fuse_projections
from mlxchat.tokenizer import Tokenizer
from mlxchat.tools.schema import tool_schemas
from mlxchat.train import (
    NAME_SPLIT,
    QWEN_SPLIT,
    Example,
    TrainConfig,
    encode_chat,
    from_scratch,
    make_batch,
    save_checkpoint,
    train,
    train_tokenizer,
    untrained_tokenizer,
)
from mlxchat.train.loop import make_optimizer, masked_loss

SOURCE = TEMPLATE.read_text(encoding="utf-8")
TOOLS = tool_schemas(DEMO_TOOLS)


@pytest.fixture(scope="module")
def conversations():
    return DemoData(seed=3).training(300)


@pytest.fixture(scope="module")
def tokenizer(conversations) -> Tokenizer:
    bootstrap = ChatTemplate(SOURCE, Tokenizer(untrained_tokenizer()))
    texts = [bootstrap.render(c.messages, tools=TOOLS if c.tools else None, add_generation_prompt=False)
             for c in conversations]
    return Tokenizer(train_tokenizer(texts, 400), {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})


@pytest.fixture(scope="module")
def template(tokenizer) -> ChatTemplate:
    return ChatTemplate(SOURCE, tokenizer)


def tiny_config(vocab_size: int) -> dict:
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": vocab_size,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 1024, "tie_word_embeddings": True, "hidden_act": "silu"}


def masked_text(tokenizer: Tokenizer, example: Example) -> list[str]:
    """The marked spans of an example, decoded."""
    spans, current = [], []
    for token, marked in zip(example.ids, example.mask, strict=True):
        if marked:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    if current:
        spans.append(tokenizer.decode(current))
    return spans


# -- tokenizer -------------------------------------------------------------------------------------


def test_tokenizer_splits_digits_and_keeps_control_tokens(tokenizer):
    ids = tokenizer.encode("It is 1234 km.<|im_end|>")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert ["1", "2", "3", "4"] == [p for p in pieces if p.strip().isdigit()]
    assert pieces[-1] == "<|im_end|>"
    for text, special in (("<|endoftext|>", True), ("<|im_start|>", True), ("<think>", False),
                          ("</tool_response>", False)):
        index = tokenizer.token_id(text)
        assert index is not None and (index in tokenizer.special_ids) == special
    text = "Grüße aus Köln 🌧️ -7°C\n\ttabs"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_name_split_spells_names_the_same_after_a_space_and_a_quote(conversations):
    name = "Rio de Janeiro"
    texts = [m["content"] for c in conversations for m in c.messages if isinstance(m.get("content"), str)]
    texts += [f"Trains leave {name} at {hour}." for hour in range(50)]  # a name frequent enough to be merged

    def name_ids(backend, text: str) -> list[int]:
        at = text.index(name)
        encoding = backend.encode(text)
        return [i for i, (a, b) in zip(encoding.ids, encoding.offsets, strict=True) if a < at + len(name) and b > at]

    for split, same in ((NAME_SPLIT, True), (QWEN_SPLIT, False)):
        backend = train_tokenizer(texts, 400, split=split)
        asked = name_ids(backend, f"What is the weather in {name}?")
        called = name_ids(backend, f'{{"city": "{name}"}}')
        assert (asked == called) == same, (asked, called)
        pieces = [backend.id_to_token(i) for i in asked]
        assert (pieces == [*"Rio", "Ġde", "Ġ", *"Janeiro"]) == same, pieces  # capitalised words letter by letter
        assert backend.decode(backend.encode("In Rio it's 21°C.").ids) == "In Rio it's 21°C."


def test_tokenizer_spends_no_merges_on_control_markers(tokenizer):
    vocab = tokenizer.backend.get_vocab(with_added_tokens=False)
    assert not any("im_start" in piece or "im_end" in piece for piece in vocab)


# -- the loss mask ---------------------------------------------------------------------------------


def test_mask_covers_exactly_the_generated_turn(tokenizer, template):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 12 + 5?"},
                {"role": "assistant", "content": "12 + 5 = 17.", "reasoning_content": "2 + 5 = 7."}]
    example = encode_chat(template, messages, stop_ids={tokenizer.token_id("<|im_end|>")})
    assert masked_text(tokenizer, example) == ["<think>\n2 + 5 = 7.\n</think>\n\n12 + 5 = 17.<|im_end|>"]
    assert example.trained_turns == 1
    assert example.ids == template.encode(messages, add_generation_prompt=False)


def test_mask_covers_tool_call_and_answer_not_history(tokenizer, template):
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "I need get_weather for Oslo.",
         "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temperature_c": 3}'},
        {"role": "assistant", "content": "It is 3°C in Oslo."},
    ]
    example = encode_chat(template, messages, tools=TOOLS, stop_ids={tokenizer.token_id("<|im_end|>")})
    # The first answer is history (Qwen3 renders it without its reasoning): context, not a target.
    assert masked_text(tokenizer, example) == [
        '<think>\nI need get_weather for Oslo.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\nIt is 3°C in Oslo.<|im_end|>",
    ]
    assert example.trained_turns == 2


def test_mask_without_stop_ids_keeps_the_templates_whole_turn(template):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    example = encode_chat(template, messages)
    marked = [t for t, m in zip(example.ids, example.mask, strict=True) if m]
    assert template.tokenizer.decode(marked).endswith("Hello!<|im_end|>\n")


def test_batch_shifts_and_pads():
    examples = [Example([1, 2, 3, 4], [False, False, True, True]), Example([5, 6], [False, True])]
    batch = make_batch(examples, pad_to=4)
    assert batch.inputs.tolist() == [[1, 2, 3, 0], [5, 0, 0, 0]]
    assert batch.targets.tolist() == [[2, 3, 4, 0], [6, 0, 0, 0]]
    assert batch.mask.tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]
    assert batch.tokens == 3


# -- the loop ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def examples(conversations, tokenizer, template):
    stop = {tokenizer.token_id("<|im_end|>")}
    return [encode_chat(template, c.messages, tools=TOOLS if c.tools else None, stop_ids=stop)
            for c in conversations]


def run(examples, tokenizer, steps=30, seed=0):
    module = from_scratch(tiny_config(tokenizer.vocab_size), seed=seed)
    config = TrainConfig(steps=steps, learning_rate=3e-3, warmup_steps=5, batch_tokens=1536, log_every=5,
                         eval_every=15, seed=seed)
    log = train(module, examples[:250], config, eval_examples=examples[250:])
    return module, log


def test_training_lowers_the_loss(examples, tokenizer):
    module, log = run(examples, tokenizer)
    train_losses = [r.loss for r in log if r.kind == "train"]
    evals = [r.loss for r in log if r.kind == "eval"]
    assert train_losses[-1] < 0.75 * train_losses[0]
    assert len(evals) == 2 and evals[1] < evals[0]
    assert 3e-4 <= log[-1].learning_rate < 3.2e-4  # the cosine ends at min_lr_ratio


def test_training_is_reproducible(examples, tokenizer):
    runs = [run(examples, tokenizer, steps=6) for _ in range(2)]
    assert [r.loss for r in runs[0][1]] == [r.loss for r in runs[1][1]]
    for (name, a), (_, b) in zip(tree_flatten(runs[0][0].parameters()), tree_flatten(runs[1][0].parameters()),
                                 strict=True):
        assert mx.array_equal(a, b).item(), name


def test_accumulation_matches_one_big_batch(examples, tokenizer):
    """Two accumulated batches give the update of the two together (the loss is averaged over both)."""
    config = TrainConfig(steps=1, learning_rate=1e-3, warmup_steps=0)
    results = []
    for groups in ([examples[:8]], [examples[:4], examples[4:8]]):
        module = from_scratch(tiny_config(tokenizer.vocab_size), seed=1)
        grad_fn = nn.value_and_grad(module, masked_loss)
        total, grads = 0, None
        for group in groups:
            batch = make_batch(group)
            _, g = grad_fn(module, batch)
            grads = g if grads is None else tree_map(mx.add, grads, g)
            total += batch.tokens
        grads = tree_map(lambda g, n=total: g / n, grads)
        make_optimizer(config).update(module, grads)
        results.append(dict(tree_flatten(module.parameters())))
    for name, value in results[0].items():  # 1% of Adam's first step (lr): float32 summation order differs
        np.testing.assert_allclose(np.array(value), np.array(results[1][name]), atol=1e-5, err_msg=name)


def test_rejects_token_ids_outside_the_vocabulary(tokenizer):
    from mlxchat import InvalidInputError

    module = from_scratch(tiny_config(tokenizer.vocab_size))
    with pytest.raises(InvalidInputError, match=f"token id {tokenizer.vocab_size} is outside"):
        train(module, [Example.pretraining([1, 2, tokenizer.vocab_size])], TrainConfig(steps=1))


def test_rejects_data_without_targets(tokenizer):
    module = from_scratch(tiny_config(tokenizer.vocab_size))
    with pytest.raises(ValueError, match="no training targets"):
        train(module, [Example([1, 2, 3], [False] * 3)], TrainConfig(steps=1))


# -- checkpoints -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory, examples, tokenizer):
    module, _ = run(examples, tokenizer, steps=6)
    folder = tmp_path_factory.mktemp("ckpt")
    config = tiny_config(tokenizer.vocab_size)
    save_checkpoint(folder, module, config=config, tokenizer=tokenizer, chat_template=SOURCE,
                    generation_config={"eos_token_id": [tokenizer.token_id("<|im_end|>")],
                                       "do_sample": False})
    return folder, module


def test_checkpoint_layout(saved):
    folder, _ = saved
    assert {p.name for p in folder.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                                   "tokenizer_config.json", "generation_config.json"}
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == SOURCE
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert "lm_head.weight" not in mx.load(str(folder / "model.safetensors"))  # tied


def test_checkpoint_reloads_with_identical_logits(saved, template):
    folder, module = saved
    model = mlxchat.load_model(folder, dtype="float32")
    ids = template.encode([{"role": "user", "content": "What is the capital of Peru?"}])
    fuse_projections(module)  # as loading does: the same joined products, so the same sums to the bit
    ours = np.array(module(mx.array([ids]))[0])
    np.testing.assert_array_equal(np.array(model.logits(ids)), ours)
    assert model.apply_chat_template([{"role": "user", "content": "What is the capital of Peru?"}]) == ids
    assert model.defaults.temperature == 0.0
    model.close()


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_checkpoint_loads_in_transformers(saved, template):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, module = saved
    hf_tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "Weather in Oslo and 12 + 34?"}]
    ids = template.encode(messages, tools=TOOLS)
    rendered = hf_tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                add_generation_prompt=True)
    assert rendered == template.render(messages, tools=TOOLS)
    assert hf_tokenizer(rendered, add_special_tokens=False)["input_ids"] == ids
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0].numpy()
    ours = np.array(module(mx.array([ids]))[0])
    assert float(np.abs(ours - theirs).max()) < 1e-4


def test_saving_a_loaded_model_round_trips(saved, tmp_path: Path):
    folder, _ = saved
    model = mlxchat.load_model(folder, dtype="float32")
    save_checkpoint(tmp_path, model.module, config=json.loads((folder / "config.json").read_text()),
                    tokenizer=model.tokenizer, chat_template=model.chat_template.source, dtype=mx.bfloat16)
    again = mlxchat.load_model(tmp_path, dtype="float32")
    ids = list(range(1, 30))
    np.testing.assert_allclose(np.array(again.logits(ids)), np.array(model.logits(ids)), atol=0.05)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    model.close()
    again.close()


def test_train_prints_nothing_unless_asked(examples, tokenizer, capsys):
    config = TrainConfig(steps=2, learning_rate=1e-3, warmup_steps=0, batch_tokens=512, log_every=1)
    module = from_scratch(tiny_config(tokenizer.vocab_size), seed=0)
    train(module, examples[:8], config)
    assert capsys.readouterr().out == ""
    log = train(module, examples[:8], config, verbose=True)
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in printed] == ["1/2", "2/2"] and all("tok/s" in line for line in printed)
    assert log[-1].tokens_per_s > 0
