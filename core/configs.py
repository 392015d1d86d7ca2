"""Named configs: the ``config.json`` of each released model the built-in plugins serve, for research and
benchmarks without downloading a checkpoint::

    import mlxchat
    mlxchat.configs.list()                       # ['gemma-4-26b-a4b', ..., 'qwen3.5-0.8b', ...]
    raw = mlxchat.configs.get("qwen3-0.6b")      # the dict the checkpoint's config.json holds
    mlxchat.configs.source("qwen3-0.6b")         # 'Qwen/Qwen3-0.6B'
    model = mlxchat.build_model("qwen3-0.6b")    # random weights with the release's shapes

Hugging Face cannot be reached from where this was written, so every value comes from second-hand copies
of the released files: the repository notes in ../shared/research (arch_qwen.md section 7,
arch_gemma4_lfm2.md sections 1.10, 3 and 3.1), third-party test fixtures that quote the released configs
(Ollama's ``x/models/gemma4`` and ``qwen3_5`` tests, Megatron-Bridge's Qwen3.5 tests, llama.cpp ports'
LFM2 tests), the model cards' architecture tables as the Qwen3.5 and LFM2 releases state them, and
transformers' class defaults where a docstring names the checkpoint. The keys are written as each
release writes them (transformers 4.x style for Qwen3 and LFM2, the VLM wrapper with ``text_config``
for Qwen3.5 and Gemma 4); keys only a multimodal tower reads (``vision_config``, ``audio_config``) are
left out, since mlxchat serves the text model. A value marked UNCERTAIN in a comment below could not be
checked against a copy of the released file.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

__all__ = ["get", "list", "source"]

_list = list  # the module's own ``list`` shadows the builtin below


@dataclass(frozen=True)
class _Named:
    source: str
    """The Hugging Face repo id of the release."""
    config: dict[str, Any]


# -- Qwen3 (transformers 4.51 style: top-level rope_theta, rope_scaling null) ------------------------


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, tied: bool) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


def _qwen3_moe() -> dict[str, Any]:
    config = _qwen3(2048, 6144, 48, 32, 4, tied=False)
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", decoder_sparse_step=1,
                  mlp_only_layers=[], moe_intermediate_size=768, norm_topk_prob=True, num_experts=128,
                  num_experts_per_tok=8, output_router_logits=False, router_aux_loss_coef=0.001)
    return dict(sorted(config.items()))


# -- Qwen3.5 (a VLM wrapper; the text model under text_config) ----------------------------------------


def _qwen35(hidden: int, layers: int, heads: int, kv_heads: int, linear_value_heads: int, tied: bool, *,
            intermediate: int | None = None, experts: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """``experts``: (count, per token, expert width), the shared expert as wide as one."""
    text: dict[str, Any] = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": linear_value_heads,
        "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "model_type": "qwen3_5_text",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": tied,
        "use_cache": True,
        "vocab_size": 248320,
    }
    top = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"}
    if experts is None:
        text["intermediate_size"] = intermediate
    else:
        count, per_token, width = experts
        text.update(model_type="qwen3_5_moe_text", num_experts=count, num_experts_per_tok=per_token,
                    moe_intermediate_size=width, shared_expert_intermediate_size=width,
                    router_aux_loss_coef=0.001, output_router_logits=False)
        top = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe"}
    return {**top, "image_token_id": 248056, "text_config": dict(sorted(text.items())),
            "tie_word_embeddings": tied, "transformers_version": "4.57.0.dev0", "video_token_id": 248057,
            "vision_end_token_id": 248054, "vision_start_token_id": 248053}


# -- LFM2 (transformers 4.54 style: block_* keys, full_attn_idxs) -------------------------------------


def _lfm2(hidden: int, ff: int, heads: int, layers: int = 16,
          attention: tuple[int, ...] = (2, 5, 8, 10, 12, 14)) -> dict[str, Any]:
    return {
        "architectures": ["Lfm2ForCausalLM"],
        "block_auto_adjust_ff_dim": True,
        "block_dim": hidden,
        "block_ff_dim": ff,
        "block_ffn_dim_multiplier": 1.0,
        "block_mlp_init_scale": 1.0,
        "block_multiple_of": 256,
        "block_norm_eps": 1e-05,
        "block_out_init_scale": 1.0,
        "block_use_swiglu": True,
        "block_use_xavier_init": True,
        "bos_token_id": 1,
        "conv_L_cache": 3,
        "conv_bias": False,
        "conv_dim": hidden,
        "conv_dim_out": hidden,
        "conv_use_xavier_init": True,
        "eos_token_id": 7,
        "full_attn_idxs": _list(attention),
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "max_position_embeddings": 128000,
        "model_type": "lfm2",
        "norm_eps": 1e-05,
        "num_attention_heads": heads,
        "num_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": 8,
        "pad_token_id": 0,
        "rope_theta": 1000000.0,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.54.0.dev0",
        "use_cache": True,
        "use_pos_enc": True,
        "vocab_size": 65536,
    }


def _lfm2_moe() -> dict[str, Any]:
    attention = (2, 6, 10, 14, 18, 21)
    return {
        "architectures": ["Lfm2MoeForCausalLM"],
        "bos_token_id": 1,
        "conv_L_cache": 3,
        "conv_bias": False,
        "eos_token_id": 7,
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 7168,
        "layer_types": ["full_attention" if i in attention else "conv" for i in range(24)],
        "max_position_embeddings": 128000,
        "model_type": "lfm2_moe",
        "moe_intermediate_size": 1792,
        "norm_eps": 1e-05,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_dense_layers": 2,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "pad_token_id": 0,
        "rope_theta": 1000000.0,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.0.dev0",
        "use_cache": True,
        "use_expert_bias": True,
        "vocab_size": 65536,
    }


# -- Gemma 4 (a multimodal wrapper; the text model under text_config) ---------------------------------


def _gemma4(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, *, window: int,
            pattern: int, global_kv_heads: int | None = None, kv_shared: int = 0, per_layer: int | None = None,
            double_wide: bool = False, experts: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """``pattern``: one global layer after every ``pattern - 1`` sliding ones; ``global_kv_heads`` turns
    on K-equals-V on the global layers; ``per_layer``: the per-layer input width (null in the releases
    without one); ``experts``: (count, per token, expert width)."""
    text: dict[str, Any] = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": global_kv_heads is not None,
        "dtype": "bfloat16",
        "enable_moe_block": experts is not None,
        "final_logit_softcapping": 30.0,
        "global_head_dim": 512,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": hidden,
        "hidden_size_per_layer_input": per_layer,
        "intermediate_size": intermediate,
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
        "max_position_embeddings": 131072,
        "model_type": "gemma4_text",
        "num_attention_heads": heads,
        "num_global_key_value_heads": global_kv_heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "num_kv_shared_layers": kv_shared,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "sliding_window": window,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_double_wide_mlp": double_wide,
        "vocab_size": 262144,
        "vocab_size_per_layer_input": 262144,
    }
    if experts is not None:
        text["num_experts"], text["top_k_experts"], text["moe_intermediate_size"] = experts
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
            "text_config": dict(sorted(text.items())), "tie_word_embeddings": True, "vocab_size": 262144}


_CONFIGS: dict[str, _Named] = {
    # Qwen3: arch_qwen.md section 7 (0.6B, 30B-A3B) and the Qwen3 model cards' tables (layers, heads,
    # tie flags); widths as the released configs give them (third-party copies agree).
    "qwen3-0.6b": _Named("Qwen/Qwen3-0.6B", _qwen3(1024, 3072, 28, 16, 8, tied=True)),
    "qwen3-1.7b": _Named("Qwen/Qwen3-1.7B", _qwen3(2048, 6144, 28, 16, 8, tied=True)),
    "qwen3-4b": _Named("Qwen/Qwen3-4B", _qwen3(2560, 9728, 36, 32, 8, tied=True)),
    "qwen3-8b": _Named("Qwen/Qwen3-8B", _qwen3(4096, 12288, 36, 32, 8, tied=False)),
    "qwen3-14b": _Named("Qwen/Qwen3-14B", _qwen3(5120, 17408, 40, 40, 8, tied=False)),
    "qwen3-32b": _Named("Qwen/Qwen3-32B", _qwen3(5120, 25600, 64, 64, 8, tied=False)),
    "qwen3-30b-a3b": _Named("Qwen/Qwen3-30B-A3B", _qwen3_moe()),
    # Qwen3.5: the model cards' tables (hidden, layers, attention and DeltaNet heads, FFN width; 3 DeltaNet
    # layers to 1 attention layer). 397B-A17B and 35B-A3B are also quoted by third-party fixtures; 27B by
    # a Megatron script (arch_qwen.md section 7). UNCERTAIN: the tie flags of 4B and 9B, and whether the
    # small models' text_config says eos 248044 (<|endoftext|>) or 248046 (<|im_end|>).
    "qwen3.5-0.8b": _Named("Qwen/Qwen3.5-0.8B", _qwen35(1024, 24, 8, 2, 16, tied=True, intermediate=3584)),
    "qwen3.5-2b": _Named("Qwen/Qwen3.5-2B", _qwen35(2048, 24, 8, 2, 16, tied=True, intermediate=6144)),
    "qwen3.5-4b": _Named("Qwen/Qwen3.5-4B", _qwen35(2560, 32, 16, 4, 32, tied=True, intermediate=9216)),
    "qwen3.5-9b": _Named("Qwen/Qwen3.5-9B", _qwen35(4096, 32, 16, 4, 32, tied=False, intermediate=12288)),
    "qwen3.5-27b": _Named("Qwen/Qwen3.5-27B", _qwen35(5120, 64, 24, 4, 48, tied=False, intermediate=17408)),
    "qwen3.5-35b-a3b": _Named("Qwen/Qwen3.5-35B-A3B", _qwen35(2048, 40, 16, 2, 32, tied=False,
                                                              experts=(256, 8, 512))),
    "qwen3.5-122b-a10b": _Named("Qwen/Qwen3.5-122B-A10B", _qwen35(3072, 48, 32, 2, 64, tied=False,
                                                                  experts=(256, 8, 1024))),
    "qwen3.5-397b-a17b": _Named("Qwen/Qwen3.5-397B-A17B", _qwen35(4096, 60, 32, 2, 64, tied=False,
                                                                  experts=(512, 10, 1024))),
    # LFM2: arch_gemma4_lfm2.md section 3.1 (350M, 1.2B: configs quoted by ports' tests) and section 3
    # (8B-A1B). UNCERTAIN: 700M's width (1536), heads (24) and block_ff_dim (10240) are the model card's,
    # not a copy of its config; 2.6B's 30 layers, 22 conv + 8 attention and block_ff_dim 10752 are quoted by
    # a port's test, its width 2560 is what makes 2.6B parameters of them (2048 would make 1.9B), and the
    # attention layers' positions below are a guess.
    "lfm2-350m": _Named("LiquidAI/LFM2-350M", _lfm2(1024, 6656, 16)),
    "lfm2-700m": _Named("LiquidAI/LFM2-700M", _lfm2(1536, 10240, 24)),
    "lfm2-1.2b": _Named("LiquidAI/LFM2-1.2B", _lfm2(2048, 12288, 32)),
    "lfm2-2.6b": _Named("LiquidAI/LFM2-2.6B", _lfm2(2560, 10752, 32, layers=30,
                                                    attention=(2, 6, 10, 14, 18, 22, 26, 29))),
    "lfm2-8b-a1b": _Named("LiquidAI/LFM2-8B-A1B", _lfm2_moe()),
    # Gemma 4: Ollama's x/models/gemma4 tests quote each release's text_config; arch_gemma4_lfm2.md section
    # 1.10 agrees. UNCERTAIN: max_position_embeddings of 26B-A4B and 31B (131072 here; one copy says 262144).
    "gemma-4-e2b": _Named("google/gemma-4-E2B-it", _gemma4(1536, 35, 6144, 8, 1, window=512, pattern=5,
                                                           kv_shared=20, per_layer=256, double_wide=True)),
    "gemma-4-e4b": _Named("google/gemma-4-E4B-it", _gemma4(2560, 42, 10240, 8, 2, window=512, pattern=6,
                                                           kv_shared=18, per_layer=256)),
    "gemma-4-26b-a4b": _Named("google/gemma-4-26B-A4B-it", _gemma4(2816, 30, 2112, 16, 8, window=1024, pattern=6,
                                                                   global_kv_heads=2, experts=(128, 8, 704))),
    "gemma-4-31b": _Named("google/gemma-4-31B-it", _gemma4(5376, 60, 21504, 32, 16, window=1024, pattern=6,
                                                           global_kv_heads=4)),
}


def list() -> _list[str]:
    """The names of the known configs, sorted."""
    return sorted(_CONFIGS)


def get(name: str) -> dict[str, Any]:
    """The released ``config.json`` of ``name`` (a fresh copy: edit it freely)."""
    return copy.deepcopy(_named(name).config)


def source(name: str) -> str:
    """The Hugging Face repo id ``name``'s config was released in."""
    return _named(name).source


def _named(name: str) -> _Named:
    if name not in _CONFIGS:
        raise KeyError(f"no named config {name!r}; known: {', '.join(list())}")
    return _CONFIGS[name]
