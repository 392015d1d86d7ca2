"""``mlxchat train sft|grpo CONFIG.yaml`` and ``--adapter``: a LoRA run writes a peft adapter, a run killed
(SIGKILL) midway resumes to the uninterrupted result, bad configs are one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxchat
from mlxchat.cli import _load, build_parser, main

FIXTURES = Path(__file__).parent / "fixtures"
CHAT = FIXTURES / "qwen3_chat"
CHATS = [
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}],
    [{"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine"}],
    [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "see you"}],
]


def killed_after_its_first_checkpoint(kind: str, config: Path) -> str:
    """Run ``mlxchat train KIND CONFIG`` in a process SIGKILLed once ``latest`` names a checkpoint; returns
    the checkpoint it named then."""
    command = [sys.executable, "-c", "import sys; from mlxchat.cli import main; sys.exit(main(sys.argv[1:]))",
               "train", kind, str(config), "--no-progress"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = config.parent / "out" / "checkpoints" / "latest"
    try:
        while not latest.exists() and process.poll() is None:
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait()
    return latest.read_text()


def write_run(folder: Path, steps: int, save_every: int = 2, **extra) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    config = {"model": str(CHAT), "data": "chats.jsonl", "output": "out", "lora": {"rank": 4},
              "train": {"steps": steps, "learning_rate": 1e-2, "warmup_steps": 0, "log_every": 1,
                        "save_every": save_every, "batch_tokens": 64}, **extra}
    path = folder / "run.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def adapter_tensors(folder: Path) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in mx.load(str(folder / "adapter_model.safetensors")).items()}


def test_sft_with_lora_writes_a_peft_adapter(tmp_path: Path, capsys) -> None:
    assert main(["train", "sft", str(write_run(tmp_path, steps=4)), "--no-progress"]) == 0
    out = tmp_path / "out"
    assert capsys.readouterr().out.strip() == str(out)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert (out / "checkpoints" / "latest").read_text() == "step-0000004"
    ids = [1, 5, 9, 30]
    with mlxchat.load_model(CHAT) as base, mlxchat.load_model(CHAT, adapter=out) as tuned:
        assert np.abs(np.array(base.logits(ids)) - np.array(tuned.logits(ids))).max() > 1e-3


def test_a_run_killed_midway_resumes(tmp_path: Path) -> None:
    """SIGKILL once the first checkpoint is written, then the same command again: the adapter equals the one an
    uninterrupted run writes."""
    steps = 30
    assert main(["train", "sft", str(write_run(tmp_path / "whole", steps)), "--no-progress"]) == 0
    config = write_run(tmp_path / "killed", steps)
    saved = killed_after_its_first_checkpoint("sft", config)
    assert saved != f"step-{steps:07d}", "the run ended before it could be killed"
    assert not (tmp_path / "killed" / "out" / "adapter_model.safetensors").exists()
    assert main(["train", "sft", str(config), "--no-progress"]) == 0
    whole, resumed = adapter_tensors(tmp_path / "whole" / "out"), adapter_tensors(tmp_path / "killed" / "out")
    assert set(whole) == set(resumed)
    for name, value in whole.items():
        np.testing.assert_allclose(resumed[name], value, atol=1e-5)


@pytest.mark.parametrize(("change", "message"), [
    ({"train": None}, "needs a 'train:' section"),
    ({"epochs": 3}, "epochs"),
    ({"data": "missing.jsonl"}, "cannot read the data"),
    ({"data": "bad-utf8.jsonl"}, "cannot read the data"),
    ({"data": "deep.jsonl"}, "nests deeper"),
    ({"data": "surrogate.jsonl"}, "lone surrogate"),
    ({"data": "calls.jsonl"}, "tool_calls must be a list of calls"),
    ({"output": "a-file"}, "output: cannot make"),
    ({"train": None, "grpo": {"steps": 1}, "rewards": [{"json_schema": {}}]}, "rewards: json_schema: KeyError"),
    ({"train": None, "grpo": {"steps": 1}, "rewards": [{"exact_match": {"nothing": 1}}]}, "rewards: exact_match"),
    ({"train": None, "grpo": {"steps": 1}, "rewards": [{"python": "nowhere:fn"}]}, "rewards: python"),
])
def test_bad_run_configs_are_one_line_errors(tmp_path: Path, capsys, change: dict, message: str) -> None:
    path = write_run(tmp_path, steps=2)
    (tmp_path / "bad-utf8.jsonl").write_bytes(b'{"messages": "\xff\xfe"}\n')
    (tmp_path / "deep.jsonl").write_text("[" * 200 + "]" * 200 + "\n")
    (tmp_path / "surrogate.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "\ud800"},
                                                                       {"role": "assistant", "content": "x"}]}))
    (tmp_path / "calls.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                    {"role": "assistant", "tool_calls": "oops"}]}))
    (tmp_path / "a-file").write_text("")
    config = json.loads(path.read_text())
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None}
    path.write_text(json.dumps(config))
    assert main(["train", "grpo" if "grpo" in config else "sft", str(path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_serve_and_chat_take_an_adapter() -> None:
    adapter = FIXTURES / "lora" / "qwen3" / "peft"
    args = build_parser().parse_args(["serve", "--model", str(FIXTURES / "qwen3"), "--adapter", str(adapter)])
    model = _load(args)
    try:
        assert model.adapter == str(adapter)
    finally:
        model.close()
    assert build_parser().parse_args(["chat", "--adapter", "x"]).adapter == "x"
