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
- Vision (the image rows): Qwen3.5-0.8B and Gemma 4 E2B again, with the released vision towers (the
  vision_config values and their sources are above ``VISION_MODELS``) and the released processor configs;
  Gemma 4 without its audio tower. Token ids in config.json are those of the checkpoint's tokenizer.

Tokenizers: the real Qwen3 / Qwen3.5 vocabularies when ../shared/tokenizers (or $MLXCHAT_BENCH_TOKENIZERS)
has them; otherwise, and for LFM2 and Gemma 4, a byte-level BPE trained on the benchmark's own text with
the family's control tokens. Embedding and lm_head rows of ids the tokenizer lacks are zeroed, so greedy
decoding never picks them (as a trained model never does). Chat templates are the real ones
(benchmarks/templates, copied from ../shared/templates; provenance in their SOURCES.md there).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
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
    token_ids: dict[str, str] = field(default_factory=dict)
    """Top-level config.json keys that hold a control token's id (image, vision start/end, ...): set to
    this checkpoint's tokenizer's ids, like the text config's eos/pad/bos."""
    named_tokens: dict[str, str] = field(default_factory=dict)
    """Control tokens a processor looks up by role (``image_token``, ``boi_token``, ...): written into a
    synthetic tokenizer's tokenizer_config.json as ``extra_special_tokens``."""
    processor_files: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    """The release's processor configs (preprocessor_config.json, ...), written as released."""


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
    """A transformers config from a config.json dict (the keys that only describe the file left out; a
    copy, since transformers rewrites nested dicts such as vision_config's model_type)."""
    skipped = ("architectures", "model_type", "transformers_version", "torch_dtype", "dtype")
    return config_class(**copy.deepcopy({k: v for k, v in config.items() if k not in skipped}))


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



# -- vision towers ----------------------------------------------------------------------------------
#
# mlxchat.configs holds text configs only, and transformers' class defaults describe other (larger)
# towers, so the released vision configs below come from third-party copies of the released files.


def _vision_config(name: str, vision: dict[str, Any], **top: Any) -> Callable[[], dict[str, Any]]:
    """A release's config.json from mlxchat.configs with its vision_config and the top-level keys (token
    ids) that only a vision-language checkpoint reads."""

    def config() -> dict[str, Any]:
        from mlxchat import configs

        return {**configs.get(name), **top, "vision_config": dict(vision)}

    return config


# Qwen/Qwen3.5-0.8B's vision_config, as three independent ports quote it: a C++ parser's test mirrors the
# release's config.json, a quantizer checks checkpoints against an "official vision contract" for 0.8B (the
# source of hidden_act and the empty deepstack list), and an OCR model built on it pins the same values;
# a transformers run on the real checkpoint logs 12 blocks of width 768 and a 1024-wide merger output.
# One further copy gives patch 14; not followed (the others and the processor's patch_size say 16).
QWEN35_08B_VISION = {
    "deepstack_visual_indexes": [],
    "depth": 12,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 768,
    "in_channels": 3,
    "intermediate_size": 3072,
    "model_type": "qwen3_5",
    "num_heads": 12,
    "num_position_embeddings": 2304,
    "out_hidden_size": 1024,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}

# Qwen3.5's preprocessor_config.json and video_preprocessor_config.json: Qwen/Qwen3.5-2B-Base's files as
# a third party fetched them; a Qwen3.5 write-up and several ports' fixtures give the same values.
# UNCERTAIN: that 0.8B ships byte-identical files (every Qwen3.5 size shares the patch and merge sizes).
QWEN35_PROCESSOR = {
    "preprocessor_config.json": {
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast",
    },
    "video_preprocessor_config.json": {
        "size": {"longest_edge": 25165824, "shortest_edge": 4096},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
        "video_processor_type": "Qwen3VLVideoProcessor",
    },
}


def _qwen35_vl(config: dict[str, Any]) -> tuple[Any, Any]:
    """The vision-language model: saves model.language_model.*, model.visual.* as released."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration, _hf_config(Qwen3_5Config, config)


# google/gemma-4-E4B-it's vision_config as a third-party copy of its config.json shows it (transformers 5.7
# serialisation; its bookkeeping keys left out). E2B has the same tower: ports' tests parse "the standard
# Gemma 4 vision config" with these values under E2B's 1536-wide text model, and a port's size table gives
# every release narrower than 2816 (E2B, E4B) this 768-wide, 12 x 64 tower with clipped linears and no
# standardisation. UNCERTAIN: no full copy of E2B's own config.json was found.
GEMMA4_E2B_VISION = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "default_output_length": 280,
    "global_head_dim": 64,
    "head_dim": 64,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 768,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 131072,
    "model_type": "gemma4_vision",
    "num_attention_heads": 12,
    "num_hidden_layers": 16,
    "num_key_value_heads": 12,
    "patch_size": 16,
    "pooling_kernel_size": 3,
    "position_embedding_size": 10240,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
    "standardize": False,
    "use_clipped_linears": True,
}

# Gemma 4's multimodal token ids (arch_gemma4_lfm2.md section 1.1, and the E4B copy above); the
# benchmark's tokenizer replaces them with its own ids of the same tokens.
GEMMA4_MEDIA_IDS = {
    "image_token_id": 258880,
    "boi_token_id": 255999,
    "eoi_token_id": 258882,
    "video_token_id": 258884,
    "audio_token_id": 258881,
    "boa_token_id": 256000,
    "eoa_token_id": 258883,
    "vision_soft_tokens_per_image": 280,
}

# google/gemma-4-e2b-it's processor_config.json, image part: the image_processor block as two ports' tests
# and a write-up that fetched the file quote it (no "size" key; mlx-community's conversions add one).
# The audio feature extractor and video processor entries are left out (no audio tower here).
GEMMA4_PROCESSOR = {
    "processor_config.json": {
        "image_processor": {
            "do_convert_rgb": True,
            "do_normalize": False,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.0, 0.0, 0.0],
            "image_processor_type": "Gemma4ImageProcessor",
            "image_seq_length": 280,
            "image_std": [1.0, 1.0, 1.0],
            "max_soft_tokens": 280,
            "patch_size": 16,
            "pooling_kernel_size": 3,
            "resample": 3,
            "rescale_factor": 1 / 255,
        },
        "image_seq_length": 280,
        "processor_class": "Gemma4Processor",
    },
}


def _gemma4_vl(config: dict[str, Any]) -> tuple[Any, Any]:
    """The multimodal wrapper with its vision tower and embed_vision, without the audio tower."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration, _hf_config(Gemma4Config, {**config, "audio_config": None})


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


QWEN_MEDIA_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
GEMMA4_MEDIA_TOKENS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "video_token": "<|video|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}

VISION_MODELS: dict[str, BenchModel] = {
    m.key: m
    for m in (
        replace(  # the text checkpoint's description, with the tower's parameters and tokens
            MODELS["qwen3.5-0.8b"],
            key="qwen3.5-0.8b-vision",
            title="Qwen3.5-0.8B (vision)",
            params=0.853e9,
            config=_vision_config("qwen3.5-0.8b", QWEN35_08B_VISION),
            model=_qwen35_vl,
            rename=None,
            token_ids=QWEN_MEDIA_TOKENS,
            processor_files=QWEN35_PROCESSOR,
        ),
        replace(
            MODELS["gemma4-e2b"],
            key="gemma4-e2b-vision",
            title="Gemma 4 E2B (vision)",
            specials=GEMMA4_SPECIALS + ("<|image>", "<image|>", "<|audio>", "<audio|>"),
            params=4.797e9,
            config=_vision_config("gemma-4-e2b", GEMMA4_E2B_VISION, **GEMMA4_MEDIA_IDS),
            model=_gemma4_vl,
            token_ids={f"{role}_id": token for role, token in GEMMA4_MEDIA_TOKENS.items()},
            named_tokens=GEMMA4_MEDIA_TOKENS,
            processor_files=GEMMA4_PROCESSOR,
        ),
    )
}
"""Checkpoints with their vision towers, for the image rows (``--vision``)."""
ALL_MODELS = {**MODELS, **VISION_MODELS}


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
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos,
        "eos_token": spec.eos[0],
        "pad_token": spec.pad,
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
    }
    if spec.named_tokens:
        config["extra_special_tokens"] = spec.named_tokens
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return "synthetic byte-level BPE (merges learned on the benchmark text; no real vocabulary here)", tok


def _control_ids(spec: BenchModel, tok: Any, folder: Path) -> dict[str, int]:
    wanted = {*spec.eos, spec.pad, *([spec.bos] if spec.bos else []), *spec.token_ids.values()}
    ids = {t: tok.token_to_id(t) for t in wanted}
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
    released.update({key: ids[token] for key, token in spec.token_ids.items()})
    (work / "config.json").write_text(json.dumps(released, indent=2))
    for name, settings in spec.processor_files.items():
        (work / name).write_text(json.dumps(settings, indent=2))
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
    parser.add_argument("keys", nargs="*", help=f"checkpoints to build (default: all of {', '.join(ALL_MODELS)})")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    parser.add_argument("--root", type=Path, default=DEFAULT_DIR, help="where checkpoints live")
    args = parser.parse_args(argv)
    for key in args.keys or list(ALL_MODELS):
        if key not in ALL_MODELS:
            raise SystemExit(f"unknown checkpoint {key!r}; known: {', '.join(ALL_MODELS)}")
        if is_built(key, args.root) and not args.force:
            print(f"{folder_of(key, args.root)}: present")
            continue
        print(f"{build(ALL_MODELS[key], args.root)}: built", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
