"""A draft model for the demo model: the speculative-decoding rows of the harness measure acceptance and
speed on this pair (on random weights acceptance means nothing).

    python -m benchmarks.draft [--out benchmarks/drafts/demo-draft] [--steps 1500]

The draft is a 2-layer Qwen3 of hidden size 128 (0.53M parameters against the demo's 1.8M) trained
with :mod:`mlxchat.train` on the demo's own training data, rendered through the demo's template and encoded
with the demo's tokenizer (a draft must share its target's vocabulary), loss on the assistant's turns
only. Seeded: the same command rebuilds the same draft. A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .checkpoints import HERE

DEFAULT_OUT = HERE / "drafts" / "demo-draft"
SHAPE = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32}


def build(out: Path, steps: int, conversations: int, seed: int = 0) -> Path:
    from mlxchat import load_model
    from mlxchat.checkpoint import read_json
    from mlxchat.demo import MODEL_DIR
    from mlxchat.demo.build import TEMPLATE, encode_all
    from mlxchat.demo.data import DemoData
    from mlxchat.train import TrainConfig, from_scratch, save_checkpoint, train

    demo = load_model(MODEL_DIR)
    template, tokenizer = demo.chat_template, demo.tokenizer
    assert template is not None
    eos = tokenizer.token_id("<|im_end|>")
    assert eos is not None
    started = time.perf_counter()
    examples = encode_all(DemoData(seed).training(conversations), template, eos)
    config = {**read_json(MODEL_DIR / "config.json"), **SHAPE}
    config.pop("dtype", None)
    module = from_scratch(config, seed=seed)
    settings = TrainConfig(steps=steps, learning_rate=2e-3, warmup_steps=50, batch_tokens=2048, log_every=100,
                           seed=seed)
    train(module, examples, settings,
          on_log=lambda r: print(f"step {r.step:5d} loss {r.loss:.4f} {r.elapsed_s:5.0f} s", flush=True))
    save_checkpoint(out, module, config=config, tokenizer=tokenizer, chat_template=TEMPLATE.read_text(),
                    generation_config=read_json(MODEL_DIR / "generation_config.json"))
    print(f"draft written to {out} in {time.perf_counter() - started:.0f} s")
    demo.close()
    return out


def draft_path(out: Path = DEFAULT_OUT) -> Path:
    """The demo's draft, built the first time it is asked for."""
    if not (out / "config.json").exists():
        build(out, steps=1500, conversations=20000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.draft", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--conversations", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build(args.out, args.steps, args.conversations, args.seed)


if __name__ == "__main__":
    main()
