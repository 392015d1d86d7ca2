"""Training: supervised fine-tuning and pre-training of any plugin architecture on MLX autograd.

A run, end to end::

    from mlxchat.train import TrainConfig, encode_chat, from_scratch, save_checkpoint, train

    module = from_scratch({"model_type": "qwen3", "vocab_size": ..., ...}, seed=0)
    examples = [encode_chat(template, conversation, stop_ids={im_end}) for conversation in data]
    train(module, examples, TrainConfig(steps=2000, learning_rate=2e-3))
    save_checkpoint("out", module, config=hf_config, tokenizer=tokenizer, chat_template=source)

``mlxchat.load_model("out")`` (and transformers) then load the result. The loss counts only the
assistant's tokens of each conversation (:func:`encode_chat`); :meth:`Example.pretraining` trains on all.
"""

from . import rewards
from .adapters import load_adapter, save_adapter
from .data import Batch, Example, bucketed_batches, encode_chat, make_batch
from .export import save_checkpoint
from .grpo import GRPOConfig, GRPORecord, grpo
from .loop import LogRecord, TrainConfig, evaluate, masked_loss, train
from .lora import LoRALinear, LoRASwitchLinear, lora
from .scratch import from_scratch, init_weights
from .tokenizer import NAME_SPLIT, QWEN_SPECIAL_TOKENS, QWEN_SPLIT, train_tokenizer, untrained_tokenizer

__all__ = [
    "NAME_SPLIT",
    "QWEN_SPECIAL_TOKENS",
    "QWEN_SPLIT",
    "Batch",
    "Example",
    "GRPOConfig",
    "GRPORecord",
    "LoRALinear",
    "LoRASwitchLinear",
    "LogRecord",
    "TrainConfig",
    "bucketed_batches",
    "encode_chat",
    "evaluate",
    "from_scratch",
    "grpo",
    "init_weights",
    "load_adapter",
    "lora",
    "make_batch",
    "rewards",
    "masked_loss",
    "save_adapter",
    "save_checkpoint",
    "train",
    "train_tokenizer",
    "untrained_tokenizer",
]
