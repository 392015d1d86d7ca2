"""Random-weight checkpoints with the real shapes of released models, written by transformers in bfloat16.

    python -m benchmarks.checkpoints [KEY ...] [--force]    # build what is missing (all keys by default)

Speed depends on shapes, not on trained values, so random weights with a release's exact tensor shapes,
vocabulary size (the lm_head is a large share of decode), dtype (bf16, as released) and file layout
(config.json keys, tensor names) measure what a user of that release gets. Each checkpoint's config.json
is the release's own, from ``mlxchat.configs`` (where every value's source is named); transformers builds
the model from it (its own random init) and ``save_pretrained`` writes the weights, then the release's
config.json replaces the one transformers wrote.

- Qwen3-0.6B, Qwen3.5-0.8B, LFM2-350M and Gemma 4 E2B: the released configs, unchanged. Qwen3.5 and
  Gemma 4 are written text-only (no vision/audio towers), in their released wrapper layout.
- Qwen3-MoE: Qwen3-30B-A3B's config (128 experts, top-8, head_dim 128, its vocabulary) scaled down (our
  choice) to hidden 1024, 8 layers, 16/2 heads and expert width 384, so that it fits a 24 GB machine in
  float32.

Tokenizers: the real Qwen3 / Qwen3.5 vocabularies when ../shared/tokenizers (or $MLXCHAT_BENCH_TOKENIZERS)
has them; otherwise, and for LFM2 and Gemma 4, a byte-level BPE trained on the benchmark's own text with
the family's control tokens. Embedding and lm_head rows of ids the tokenizer lacks are zeroed, so greedy
decoding never picks them (as a trained model never does). Chat templates are the real ones
(benchmarks/templates, copied from ../shared/templates; provenance in their SOURCES.md there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"
DEFAULT_DIR = Path(os.environ.get("MLXCHAT_BENCH_CHECKPOINTS", HERE / "checkpoints"))
MARKER = "benchmark.json"


def _shared_tokenizers() -> Path:
    return Path(os.environ.get("MLXCHAT_BENCH_TOKENIZERS", HERE.parent.parent / "shared" / "tokenizers"))


@dataclass(frozen=True)
class BenchModel:
    """One benchmark checkpoint: how transformers builds it and what its release looks like on disk."""

    key: str
    title: str
    model_type: str
    """The model_type an mlxchat plugin must serve for the model to be benchmarked."""
    template: str
    hybrid: bool
    """Has layer state that cannot be cut back (conv / recurrent / sliding window)."""
    specials: tuple[str, ...]
    """Control tokens (a synthetic tokenizer puts them first, in this order)."""
    bos: str | None
    eos: tuple[str, ...]
    pad: str
    real_tokenizer: str | None
    params: float
    """Parameter count (checks memory before a checkpoint is built)."""
    lookup_params: float
    """Of which in per-layer embedding tables (read a row at a time; a plugin may keep them stored)."""
    config: Callable[[], dict[str, Any]] = field(repr=False)
    """The checkpoint's config.json: a release's, from mlxchat.configs."""
    model: Callable[[dict[str, Any]], tuple[Any, Any]] = field(repr=False)
    """(transformers model class, its config) for that config.json."""
    rename: Callable[[str], str] | None = field(default=None, repr=False)
    """Maps saved tensor names to the released ones (when they differ)."""


# -- Qwen3 ------------------------------------------------------------------------------------------

QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def _released(name: str, **changes: Any) -> Callable[[], dict[str, Any]]:
    """A release's config.json from mlxchat.configs, with ``changes`` (top level) applied."""

    def config() -> dict[str, Any]:
        from mlxchat import configs

        return {**configs.get(name), **changes}

    return config


def _hf_config(config_class: Any, config: dict[str, Any]) -> Any:
    """A transformers config from a config.json dict (the keys that only describe the file left out)."""
    skipped = ("architectures", "model_type", "transformers_version", "torch_dtype", "dtype")
    return config_class(**{k: v for k, v in config.items() if k not in skipped})


def _qwen3(config: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if config["model_type"] == "qwen3_moe":
        return Qwen3MoeForCausalLM, _hf_config(Qwen3MoeConfig, config)
    return Qwen3ForCausalLM, _hf_config(Qwen3Config, config)



# -- Qwen3.5 ----------------------------------------------------------------------------------------


def _qwen35(config: dict[str, Any]) -> tuple[Any, Any]:
    """The text model alone (the release's weights sit under model.language_model: see _qwen35_name)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM, _hf_config(Qwen3_5TextConfig, config["text_config"])



def _qwen35_name(name: str) -> str:
    """Released Qwen3.5 keeps the text model under model.language_model (the VLM's layout)."""
    return name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name


# -- LFM2 -------------------------------------------------------------------------------------------

LFM2_SPECIALS = (
    "<|pad|>",
    "<|startoftext|>",
    "<|endoftext|>",
    "<|fim_pre|>",
    "<|fim_mid|>",
    "<|fim_suf|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|tool_list_start|>",
    "<|tool_list_end|>",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    "<|tool_response_start|>",
    "<|tool_response_end|>",
)
def _lfm2(config: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import Lfm2Config, Lfm2ForCausalLM

    return Lfm2ForCausalLM, _hf_config(Lfm2Config, config)



# -- Gemma 4 ----------------------------------------------------------------------------------------

GEMMA4_SPECIALS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<|turn>",
    "<turn|>",
    "<|channel>",
    "<channel|>",
    "<|think|>",
    "<|tool>",
    "<tool|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
    "<|image|>",
    "<|audio|>",
    "<|video|>",
)


def _gemma4(config: dict[str, Any]) -> tuple[Any, Any]:
    """The multimodal wrapper without its vision and audio towers (the text model is what both engines run)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig

    text = _hf_config(Gemma4TextConfig, config["text_config"])
    return Gemma4ForConditionalGeneration, Gemma4Config(text_config=text, vision_config=None, audio_config=None,
                                                        tie_word_embeddings=config["tie_word_embeddings"])



QWEN_EOS = ("<|im_end|>", "<|endoftext|>")

MODELS: dict[str, BenchModel] = {
    m.key: m
    for m in (
        BenchModel(
            key="qwen3-0.6b",
            title="Qwen3-0.6B",
            model_type="qwen3",
            template="qwen3.jinja",
            hybrid=False,
            specials=QWEN_SPECIALS,
            bos=None,
            eos=QWEN_EOS,
            pad="<|endoftext|>",
            real_tokenizer="qwen3",
            params=0.596e9,
            lookup_params=0,
            config=_released("qwen3-0.6b"),
            model=_qwen3,
        ),
        BenchModel(
            key="lfm2-350m",
            title="LFM2-350M",
            model_type="lfm2",
            template="lfm2.jinja",
            hybrid=True,
            specials=LFM2_SPECIALS,
            bos="<|startoftext|>",
            eos=("<|im_end|>",),
            pad="<|pad|>",
            real_tokenizer=None,
            params=0.354e9,
            lookup_params=0,
            config=_released("lfm2-350m"),
            model=_lfm2,
        ),
        BenchModel(
            key="qwen3.5-0.8b",
            title="Qwen3.5-0.8B",
            model_type="qwen3_5",
            template="qwen3.5-2b-and-smaller.jinja",
            hybrid=True,
            specials=QWEN_SPECIALS,
            bos=None,
            eos=QWEN_EOS,
            pad="<|endoftext|>",
            real_tokenizer="qwen3.5",
            params=0.752e9,
            lookup_params=0,
            config=_released("qwen3.5-0.8b"),
            model=_qwen35,
            rename=_qwen35_name,
        ),
        BenchModel(
            key="qwen3-moe",
            title="Qwen3-MoE 128x8 (30B-A3B-like, scaled)",
            model_type="qwen3_moe",
            template="qwen3.jinja",
            hybrid=False,
            specials=QWEN_SPECIALS,
            bos=None,
            eos=QWEN_EOS,
            pad="<|endoftext|>",
            real_tokenizer="qwen3",
            params=1.558e9,
            lookup_params=0,
            config=_released("qwen3-30b-a3b", hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                             max_window_layers=8, num_attention_heads=16, num_key_value_heads=2,
                             moe_intermediate_size=384),
            model=_qwen3,
        ),
        BenchModel(
            key="gemma4-e2b",
            title="Gemma 4 E2B (text)",
            model_type="gemma4",
            template="gemma4-e2b-e4b.jinja",
            hybrid=True,
            specials=GEMMA4_SPECIALS,
            bos="<bos>",
            eos=("<eos>", "<turn|>"),
            pad="<pad>",
            real_tokenizer=None,
            params=4.629e9,
            lookup_params=262144 * 35 * 256,
            config=_released("gemma-4-e2b"),
            model=_gemma4,
        ),
    )
}


# -- tokenizers -------------------------------------------------------------------------------------


def _synthetic_tokenizer(specials: tuple[str, ...]) -> Any:
    """A byte-level BPE with merges learned from the benchmark text and the family's control tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from .texts import corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=4096, special_tokens=list(specials), show_progress=False, initial_alphabet=alphabet
    )
    tok.train_from_iterator(corpus(), trainer)
    return tok


def _write_tokenizer(spec: BenchModel, folder: Path) -> tuple[str, Any]:
    """Writes tokenizer.json / tokenizer_config.json; returns (what it is, the tokenizer)."""
    from tokenizers import Tokenizer

    real = _shared_tokenizers() / spec.real_tokenizer if spec.real_tokenizer else None
    if real is not None and (real / "tokenizer.json").exists():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(real / name, folder / name)
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        return f"real {spec.real_tokenizer} vocabulary ({real})", tok
    tok = _synthetic_tokenizer(spec.specials)
    tok.save(str(folder / "tokenizer.json"))
    flags = {"special": True, "normalized": False, "lstrip": False, "rstrip": False, "single_word": False}
    added = {str(tok.token_to_id(t)): {"content": t, **flags} for t in spec.specials}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos,
        "eos_token": spec.eos[0],
        "pad_token": spec.pad,
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return "synthetic byte-level BPE (merges learned on the benchmark text; no real vocabulary here)", tok


def _control_ids(spec: BenchModel, tok: Any, folder: Path) -> dict[str, int]:
    ids = {t: tok.token_to_id(t) for t in {*spec.eos, spec.pad, *([spec.bos] if spec.bos else [])}}
    missing = sorted(t for t, i in ids.items() if i is None)
    if missing:
        raise SystemExit(f"{folder}: tokenizer lacks control tokens {missing}")
    return {t: int(i) for t, i in ids.items()}


def _silence_unused_rows(model: Any, used: int) -> None:
    """Zero the embedding and lm_head rows of ids the tokenizer does not have.

    A trained model never emits those ids; random weights would, and their text cannot be tokenized back,
    which would make every engine's prompt-cache reuse look worse than on a real checkpoint.
    """
    import torch

    tables = {id(t): t for t in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)}
    with torch.no_grad():
        for table in tables.values():
            table[used:] = 0


# -- building ---------------------------------------------------------------------------------------


def _rename_tensors(folder: Path, rename: Callable[[str], str]) -> None:
    from safetensors.torch import load_file, save_file

    for shard in sorted(folder.glob("*.safetensors")):
        tensors = load_file(shard)
        save_file({rename(k): v for k, v in tensors.items()}, shard, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {rename(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))


def folder_of(key: str, root: Path = DEFAULT_DIR) -> Path:
    return root / key


def is_built(key: str, root: Path = DEFAULT_DIR) -> bool:
    return (folder_of(key, root) / MARKER).exists()


def build(spec: BenchModel, root: Path = DEFAULT_DIR) -> Path:
    """Writes the checkpoint to ``root/<key>`` (via a temporary folder, so a half-built one never counts)."""
    import torch
    import transformers

    target = folder_of(spec.key, root)
    work = target.with_name(target.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    kind, tok = _write_tokenizer(spec, work)
    used = tok.get_vocab_size(with_added_tokens=True)
    ids = _control_ids(spec, tok, work)

    torch.manual_seed(0)
    released = spec.config()
    model_class, config = spec.model(released)
    model = model_class._from_config(config, dtype=torch.bfloat16)
    _silence_unused_rows(model, used)
    model.save_pretrained(work, max_shard_size="2GB")
    params = sum(p.numel() for p in model.parameters())
    del model
    if spec.rename is not None:
        _rename_tensors(work, spec.rename)

    eos = [ids[t] for t in spec.eos]
    special = {"eos_token_id": eos[0] if len(eos) == 1 else eos, "pad_token_id": ids[spec.pad]}
    if spec.bos:
        special["bos_token_id"] = ids[spec.bos]
    released.get("text_config", released).update(special)  # this checkpoint's tokenizer's ids
    (work / "config.json").write_text(json.dumps(released, indent=2))
    sampling = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    generation = {**special, "eos_token_id": eos, **sampling}
    (work / "generation_config.json").write_text(json.dumps(generation, indent=2))
    shutil.copyfile(TEMPLATES / spec.template, work / "chat_template.jinja")
    meta = {
        "key": spec.key,
        "title": spec.title,
        "parameters": params,
        "tokenizer": kind,
        "tokenizer_size": used,
        "template": spec.template,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "weights": f"random (transformers' own init, seed 0), stored bfloat16; embedding and lm_head rows "
        f"from id {used} on (ids the tokenizer lacks) are zero",
    }
    (work / MARKER).write_text(json.dumps(meta, indent=2))
    shutil.rmtree(target, ignore_errors=True)
    work.rename(target)
    return target


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoints", description=__doc__.split("\n")[0])
    parser.add_argument("keys", nargs="*", help=f"checkpoints to build (default: all of {', '.join(MODELS)})")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    parser.add_argument("--root", type=Path, default=DEFAULT_DIR, help="where checkpoints live")
    args = parser.parse_args(argv)
    for key in args.keys or list(MODELS):
        if key not in MODELS:
            raise SystemExit(f"unknown checkpoint {key!r}; known: {', '.join(MODELS)}")
        if is_built(key, args.root) and not args.force:
            print(f"{folder_of(key, args.root)}: present")
            continue
        print(f"{build(MODELS[key], args.root)}: built", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
