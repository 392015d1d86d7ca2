"""What every rank of a test_distributed.py launch runs (``mlx.launch --backend ring -n N -- python this OUT``):
each fixture loaded split over the group, in each mode, and what every rank gets from it written to
``OUT/rank<r>.json`` (and the logits to ``OUT/rank<r>.npz``) for the test to compare with one process.

Every rank runs this same script (the calls pair up with rank 0's), except in the follow scenario, where
rank 0 alone drives a session and the other ranks run ``model.follow()``.
"""

# mlxchat before mlx.core: it puts OpenBLAS under MLX.
import mlxchat  # noqa: I001

import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlxchat.errors import DistributedError
from mlxchat.testing import fixture_folders, fixture_info

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROMPT = [int(t) for t in np.random.default_rng(0).integers(1, 500, 20)]  # with 10 new tokens: fits every fixture
GREEDY = {"max_tokens": 10, "temperature": 0.0}
SAMPLED = {"max_tokens": 10, "temperature": 0.9, "top_p": 0.95, "seed": 7}
TURN = {"max_tokens": 6, "temperature": 0.0, "repetition_penalty": 1.3}
QUESTIONS = ("Hello there", "What is the capital of France?", "And of Italy?")
FOLLOWED = "qwen3_5"  # a hybrid: DeltaNet states return through snapshots


def session_turns(model: mlxchat.GenerativeModel, **options: Any) -> list[dict[str, Any]]:
    """A 3-turn chat: each turn's reply tokens and what its cache served (``options``: the session's)."""
    session = model.chat_session(system="You are terse.", default_config=TURN, **options)
    turns = []
    for question in QUESTIONS:
        result = session.send(question)
        turns.append({"tokens": result.tokens, "cached": result.report.cached_prompt_tokens,
                      "prompt": result.report.prompt_tokens})
    session.close()
    return turns


def stopped_stream(model: mlxchat.GenerativeModel) -> list[int]:
    """Tokens of a stream whose reader stops after three, then of a full generation."""
    seen = []
    for chunk in model.stream(PROMPT, GREEDY):
        seen.append(chunk.token)
        if len(seen) == 3:
            break
    return seen + model.generate(PROMPT, GREEDY).tokens


def run(folder: Path, mode: str, logits: dict[str, np.ndarray]) -> dict[str, Any]:
    name = f"{folder.name}/{mode}"
    try:
        model = mlxchat.load_model(folder, dtype="float32", distributed=mode)  # type: ignore[arg-type]
    except DistributedError as exc:
        return {"error": str(exc)}
    logits[name] = np.array(model.logits(PROMPT))
    record: dict[str, Any] = {
        "greedy": model.generate(PROMPT, GREEDY).tokens,
        "sampled": model.generate(PROMPT, SAMPLED).tokens,
        "param_bytes": sum(v.nbytes for v in dict(tree_flatten(model.module.parameters())).values()),
    }
    if fixture_info(folder).get("kind", "text") == "text" and not fixture_info(folder).get("variant_of"):
        record["session"] = session_turns(model)
        record["stopped"] = stopped_stream(model)
    model.close()
    return record


def followed(mode: str) -> dict[str, Any]:
    """Rank 0 alone drives a session, a stream it leaves early and a generation; the others follow."""
    model = mlxchat.load_model(FIXTURES / FOLLOWED, dtype="float32", distributed=mode)  # type: ignore[arg-type]
    if model.rank != 0:  # type: ignore[attr-defined]
        model.follow()  # type: ignore[attr-defined]
        return {"followed": True}
    record = {"session": session_turns(model), "stopped": stopped_stream(model),
              "kv8": session_turns(model, kv_bits=8, kv_group_size=32)}  # the others make caches of its format
    model.close()
    return record


def fixtures() -> list[Path]:
    """Every architecture's fixture, text and vision (whose text logits are compared), and every quantized
    variant; not the other variants (RoPE scalings, layouts), which split like their architecture."""
    found = fixture_folders(FIXTURES) + fixture_folders(FIXTURES, kind="vision")
    return [f for f in found if not fixture_info(f).get("variant_of") or quantized(f)]


def quantized(folder: Path) -> bool:
    config = json.loads((folder / "config.json").read_text())
    return "quantization" in config or "quantization" in config.get("text_config", {})


def main() -> None:
    out, modes = Path(sys.argv[1]), sys.argv[2].split(",")
    rank = mx.distributed.init().rank()
    results: dict[str, Any] = {}
    logits: dict[str, np.ndarray] = {}
    folders = fixtures()
    for mode in modes:
        for folder in folders:
            results[f"{folder.name}/{mode}"] = run(folder, mode, logits)
        results[f"follow/{mode}"] = followed(mode)
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    np.savez(out / f"rank{rank}.npz", **logits)


if __name__ == "__main__":
    main()
