"""``mlxchat train sft|grpo CONFIG.yaml``: a run described by one YAML file, with a progress bar on stderr and
checkpoints that a run started again with the same file resumes from.

Example (SFT with LoRA; data: one chat a line, ``{"messages": [...], "tools": [...]}``)::

    model: Qwen/Qwen3-0.6B          # default: the demo model
    data: train.jsonl
    eval_data: held_out.jsonl       # optional
    output: runs/units              # the adapter (or, without lora, the whole checkpoint); checkpoints/ inside
    lora: {rank: 8, alpha: 16}      # omit for a whole-model run
    train: {steps: 200, learning_rate: 1e-4, save_every: 20}

GRPO takes prompts (``{"messages": [...], "answer": ...}`` a line), ``grpo:`` (:class:`GRPOConfig`'s fields)
instead of ``train:``, and ``rewards:``, each one of ``exact_match: {key, pattern}``, ``json_schema: {schema}``,
``tool_call: {tools}`` or ``python: module:function``.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import InvalidInputError, MlxchatError
from ..limits import check_depth
from .grpo import GRPOConfig, GRPORecord
from .loop import LogRecord, TrainConfig
from .rewards import Reward


class LoRAOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rank: int = Field(8, ge=1)
    alpha: float = Field(16, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: list[str] | None = None
    dora: bool = False
    seed: int = 0
    """The adapters' random start."""


class RunConfig(BaseModel):
    """The YAML file of a run."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    dtype: Literal["float32", "float16", "bfloat16"] | None = None
    adapter: str | None = None
    """An adapter to start from (peft layout); its settings replace ``lora``'s."""
    data: str
    eval_data: str | None = None
    output: str
    lora: LoRAOptions | None = None
    train: TrainConfig | None = None
    grpo: GRPOConfig | None = None
    rewards: list[dict[str, Any]] = Field(default_factory=list)


def read_config(path: str | Path, kind: str) -> tuple[RunConfig, Path]:
    """The run's settings, relative paths taken from the file's folder; errors say which field."""
    import yaml

    file = Path(path)
    try:
        raw = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError, yaml.YAMLError) as exc:
        raise InvalidInputError(f"{file}: cannot read the run config: {exc}") from exc
    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in error["loc"]) or "the file"
        raise InvalidInputError(f"{file}: {where}: {error['msg']}") from None
    needed = "train" if kind == "sft" else "grpo"
    if getattr(config, needed) is None:
        raise InvalidInputError(f"{file}: a {kind} run needs a '{needed}:' section")
    if kind == "grpo" and not config.rewards:
        raise InvalidInputError(f"{file}: a grpo run needs 'rewards:'")
    return config, file.parent


def run(kind: str, path: str | Path, *, progress: bool = True) -> Path:
    """Run ``mlxchat train KIND PATH``; returns the output folder."""
    from ..loading import load_model
    from .adapters import load_adapter, save_adapter
    from .lora import lora

    config, base = read_config(path, kind)
    output = _resolved(base, config.output)
    try:  # before the model loads and the steps run: an output that cannot be written lost the whole run
        (output / "checkpoints").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidInputError(f"output: cannot make {output / 'checkpoints'} ({exc})") from None
    records = _read_jsonl(_resolved(base, config.data))
    model = load_model(config.model, dtype=config.dtype)
    try:
        if config.adapter is not None:
            load_adapter(model, _resolved(base, config.adapter) if not _is_repo(config.adapter) else config.adapter)
        elif config.lora is not None:
            options = config.lora.model_dump(exclude_none=True)
            lora(model, **options)
        checkpoints = output / "checkpoints"
        if kind == "sft":
            _sft(model, config, base, records, checkpoints, progress)
        else:
            _grpo(model, config, base, records, checkpoints, progress)
        if config.adapter is not None or config.lora is not None:
            save_adapter(model, output)
        else:
            _save_whole(model, output)
    finally:
        model.close()
    return output


def _sft(model: Any, config: RunConfig, base: Path, records: list[Any], checkpoints: Path, progress: bool) -> None:
    from .data import encode_chat
    from .loop import train

    assert config.train is not None
    if model.chat_template is None:
        raise InvalidInputError(f"{model.path}: an SFT run needs a chat template to render its chats")

    def encoded(items: list[Any], source: str) -> list[Any]:
        out = []
        for n, item in enumerate(items, 1):
            messages = item.get("messages") if isinstance(item, dict) else item
            if not isinstance(messages, list) or not messages:
                raise InvalidInputError(f"{source}: line {n}: expected a chat: {{\"messages\": [...]}} or a list")
            tools = item.get("tools") if isinstance(item, dict) else None
            out.append(encode_chat(model.chat_template, messages, tools=tools, stop_ids=model.eos_ids))
        return out

    examples = encoded(records, config.data)
    held_out = encoded(_read_jsonl(_resolved(base, config.eval_data)), config.eval_data) if config.eval_data else []
    bar = _Bar(config.train.steps, progress)

    def on_log(entry: LogRecord) -> None:
        if entry.kind == "train":
            bar.show(entry.step, f"loss {entry.loss:.4f}  {entry.tokens_per_s:,.0f} tok/s")
        else:
            bar.note(f"step {entry.step}: eval loss {entry.loss:.4f}")

    try:
        train(model, examples, config.train, eval_examples=held_out, on_log=on_log, checkpoint_dir=checkpoints)
    finally:
        bar.close()


def _grpo(model: Any, config: RunConfig, base: Path, records: list[Any], checkpoints: Path, progress: bool) -> None:
    from .grpo import grpo

    assert config.grpo is not None
    rewards = [_reward(model, spec, base) for spec in config.rewards]
    bar = _Bar(config.grpo.steps, progress)

    def on_step(record: GRPORecord) -> None:
        bar.show(record.step, f"reward {record.reward:.3f}  kl {record.kl:.4f}  len {record.completion_length:.0f}  "
                              f"{record.tokens_per_s:,.0f} tok/s")

    try:
        grpo(model, records, rewards, config.grpo, checkpoint_dir=checkpoints, on_step=on_step)
    finally:
        bar.close()


def _reward(model: Any, spec: dict[str, Any], base: Path) -> Reward:

    if len(spec) != 1:
        raise InvalidInputError(f"rewards: each entry names one reward, got {sorted(spec)}")
    (name, options), = spec.items()
    try:
        return _made_reward(model, name, options or {}, base)
    except MlxchatError:
        raise
    except Exception as exc:  # noqa: BLE001 - a reward's options from the file: any failure is theirs
        raise InvalidInputError(f"rewards: {name}: {type(exc).__name__}: {exc}") from None


def _made_reward(model: Any, name: str, options: Any, base: Path) -> Reward:
    from . import rewards

    if name != "python" and not isinstance(options, dict):
        raise InvalidInputError(f"rewards: {name}: its options are a mapping, got {options!r}")
    if name == "exact_match":
        return rewards.exact_match(**options)
    if name == "json_schema":
        return rewards.json_schema(options["schema"])
    if name == "tool_call":
        return rewards.tool_call(model, options["tools"])
    if name == "python":
        module_name, _, function = str(options).partition(":")
        if str(base) not in sys.path:
            sys.path.insert(0, str(base))
        found = getattr(importlib.import_module(module_name), function, None)
        if not callable(found):
            raise InvalidInputError(f"rewards: python: {options!r} is not module:function")
        return found  # type: ignore[no-any-return]
    raise InvalidInputError(f"rewards: unknown reward {name!r} (exact_match, json_schema, tool_call, python)")


def _save_whole(model: Any, output: Path) -> None:
    from ..checkpoint import read_json
    from .export import save_checkpoint

    config = read_json(Path(model.path) / "config.json")
    source = model.chat_template.source if model.chat_template is not None else None
    model.worker.run(lambda: save_checkpoint(output, model.module, config=config, tokenizer=model.tokenizer,
                                             chat_template=source, dtype=model.dtype))


def _read_jsonl(path: Path) -> list[Any]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"{path}: cannot read the data: {exc}") from exc
    items = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                item = json.loads(line)
                check_depth(item)
                items.append(item)
            except (ValueError, RecursionError) as exc:
                raise InvalidInputError(f"{path}: line {n} is not JSON we take: {exc}") from None
    if not items:
        raise InvalidInputError(f"{path}: no records")
    return items


def _resolved(base: Path, path: str) -> Path:
    given = Path(path).expanduser()
    return given if given.is_absolute() else base / given


def _is_repo(path: str) -> bool:
    return path.count("/") == 1 and not Path(path).exists() and not path.startswith((".", "/", "~"))


class _Bar:
    """A tqdm bar over the steps on stderr (steps, the last loss or reward, tokens/s, ETA); silent when off."""

    def __init__(self, steps: int, enabled: bool):
        from tqdm import tqdm

        self._bar = tqdm(total=steps, unit="step", file=sys.stderr, dynamic_ncols=True) if enabled else None

    def show(self, step: int, text: str) -> None:
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix_str(text)

    def note(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
