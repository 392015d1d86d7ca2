"""Where a reply's time goes: a profiler for generations, off unless asked for.

    import mlxchat
    mlxchat.profiling.enable("profile.json")    # or MLXCHAT_PROFILE=profile.json in the environment
    session.send("...")
    report = mlxchat.profiling.disable()         # also written to profile.json after every reply

``mlxchat profile profile.json`` prints a one-screen summary. Each reply records the phases before its
first token (template rendering, tokenizing, cache reuse, every prefill chunk), every decode step split into
graph building, evaluation and sampling (a speculative round also into drafting), the detokenizing and
reply parsing of the tokens it produced, its time to first token and the peak memory.

While profiling, decode steps run synchronously: the plain loop builds step n+1 before it reads token n,
so the device never waits on Python, and that overlap is what a split of a step into phases cannot see.
The cost shows as the difference between a profiled and an unprofiled run's decode rate.

Disabled, the profiler costs one check of a module flag per reply and per span (:func:`span`,
:func:`timed` and :func:`current` hand back the plain objects); nothing on the per-token path times
anything.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from .files import durable_replace

__all__ = ["ReplyProfile", "current", "disable", "enable", "enabled", "report", "span", "summary", "timed"]

F = TypeVar("F", bound=Callable[..., Any])
STEP_PHASES = ("draft", "build", "eval", "sample", "detokenize", "parse")
"""The parts of a decode step, in the order they run (``draft`` in speculative rounds only)."""
PHASES = ("template_render", "tokenize", "cache_reuse", "prefill", "decode")
"""The parts of a reply."""

enabled = False
"""Whether replies are being profiled (read, never set: use :func:`enable` / :func:`disable`)."""
_path: Path | None = None
_replies: list[dict[str, Any]] = []
_lock = threading.Lock()
_local = threading.local()
_NULL = contextlib.nullcontext()


class ReplyProfile:
    """The record of one reply, filled on the thread that generates it."""

    def __init__(self, pending: dict[str, float]):
        self.started = time.perf_counter()
        self.before = sum(pending.values())
        """Seconds timed before the reply began (rendering and tokenizing its prompt)."""
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        for name, seconds in pending.items():
            self.phases[name] = self.phases.get(name, 0.0) + seconds
        self.prefill_chunks: list[list[float]] = []
        self.steps: list[dict[str, float]] = []

    def add(self, phase: str, seconds: float) -> None:
        """Time spent in ``phase``: a step's phase goes to the step decoding now, others to the reply."""
        if phase in STEP_PHASES and self.steps:
            step = self.steps[-1]
            step[phase] = step.get(phase, 0.0) + seconds
            phase = "prefill" if step.get("prompt") else "decode"
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def prefill_chunk(self, start: int, end: int, seconds: float) -> None:
        self.prefill_chunks.append([start, end, seconds])
        self.phases["prefill"] += seconds

    def step(self, tokens: int = 1, prompt: int = 0, **phases: float) -> None:
        """Open the record of a decode step that produced ``tokens`` tokens (a speculative round: several);
        the first step also runs the prompt's last ``prompt`` tokens, and counts as prefill."""
        self.steps.append({"tokens": tokens, **({"prompt": prompt} if prompt else {}), **phases})
        self.phases["prefill" if prompt else "decode"] += sum(phases.values())

    def finish(self, report: Any) -> dict[str, Any]:
        """The reply's record, with its report's figures (a :class:`~mlxchat.generation.GenerationReport`)."""
        fields = ("prompt_tokens", "cached_prompt_tokens", "generated_tokens", "ttft_s", "prefill_tps", "decode_tps",
                  "peak_memory_gb", "finish_reason", "draft_tokens", "accepted_draft_tokens")
        return {
            **{name: getattr(report, name) for name in fields},
            "seconds": time.perf_counter() - self.started + self.before,
            "phases": self.phases,
            "prefill_chunks": self.prefill_chunks,
            "decode_steps": self.steps,
        }


def enable(path: str | os.PathLike[str] | None = None) -> None:
    """Profile every reply from now on; with ``path``, write the report there (JSON) after each one."""
    global enabled, _path
    with _lock:
        _path = Path(path) if path is not None else None
        _replies.clear()
        enabled = True


def disable() -> dict[str, Any]:
    """Stop profiling; the report of the replies profiled since :func:`enable` (written to its path too)."""
    global enabled
    with _lock:
        enabled = False
        out = _report()
        _write(out)
    return out


def report() -> dict[str, Any]:
    """The replies profiled so far (``{"mlxchat_profile": 1, "replies": [...]}``)."""
    with _lock:
        return _report()


def _report() -> dict[str, Any]:
    import mlx.core as mx

    return {"mlxchat_profile": 1,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "runtime": {"mlx": mx.__version__, "device": str(mx.default_device()),  # type: ignore[attr-defined]
                        "cpu_count": os.cpu_count()},
            "replies": list(_replies)}


def _write(out: dict[str, Any]) -> None:
    if _path is None:
        return
    _path.parent.mkdir(parents=True, exist_ok=True)
    temporary = _path.with_name(_path.name + ".tmp")
    temporary.write_text(json.dumps(out, indent=1))
    durable_replace(temporary, _path)


# -- what the library calls ----------------------------------------------------------------------------


def current() -> ReplyProfile | None:
    """The reply being profiled on this thread (``None`` when profiling is off)."""
    return getattr(_local, "reply", None) if enabled else None


def span(phase: str) -> contextlib.AbstractContextManager[Any]:
    """A ``with`` block timed into ``phase`` of this thread's reply (or of the next one it starts)."""
    return _timing(phase) if enabled else _NULL


@contextlib.contextmanager
def _timing(phase: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        _add(phase, time.perf_counter() - start)


def timed(phase: str, function: F) -> F:
    """``function`` itself, or while profiling a wrapper that times every call into ``phase``."""
    if not enabled:
        return function

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _add(phase, time.perf_counter() - start)

    return wrapper  # type: ignore[return-value]


def _add(phase: str, seconds: float) -> None:
    reply = getattr(_local, "reply", None)
    if reply is not None:
        reply.add(phase, seconds)
    else:  # before the reply starts (rendering): kept for the next reply this thread begins
        pending = _pending()
        pending[phase] = pending.get(phase, 0.0) + seconds


def _pending() -> dict[str, float]:
    if not hasattr(_local, "pending"):
        _local.pending = {}
    pending: dict[str, float] = _local.pending
    return pending


def take_pending() -> dict[str, float] | None:
    """This thread's phases not yet in a reply (a prompt rendered here and generated on the worker)."""
    if not enabled:
        return None
    taken, _local.pending = _pending(), {}
    return taken


def give_pending(phases: dict[str, float] | None) -> None:
    """Hand phases taken on another thread to the next reply this thread begins."""
    if phases:
        pending = _pending()
        for name, seconds in phases.items():
            pending[name] = pending.get(name, 0.0) + seconds


def begin() -> ReplyProfile | None:
    """Start this thread's reply (``None`` when profiling is off); it takes the phases timed before it."""
    if not enabled:
        return None
    reply = ReplyProfile(_pending())
    _local.pending = {}
    _local.reply = reply
    return reply


def end(reply: ReplyProfile | None, generation_report: Any) -> None:
    """Close ``reply`` with its generation report and record it (writing the file when one was given);
    without a report (the generation failed or was dropped) it is discarded."""
    if reply is None or getattr(_local, "reply", None) is not reply:
        return
    _local.reply = None
    assert reply is not None
    if generation_report is None:
        return
    record = reply.finish(generation_report)
    with _lock:
        if enabled:
            _replies.append(record)
            _write(_report())


# -- reading a report ----------------------------------------------------------------------------------


def summary(data: dict[str, Any]) -> str:
    """A one-screen text summary of a profile report (what ``mlxchat profile`` prints)."""
    replies = data.get("replies", [])
    runtime = data.get("runtime", {})
    lines = [f"mlxchat profile: {len(replies)} replies (mlx {runtime.get('mlx')}, {runtime.get('device')}, "
             f"{runtime.get('cpu_count')} cores)"]
    if not replies:
        return "\n".join(lines)
    lines.append(f"{'reply':>5} {'prompt':>7} {'cached':>7} {'tokens':>7} {'TTFT s':>8} {'prefill/s':>10} "
                 f"{'decode/s':>9} {'peak GB':>8} {'drafts':>11}")
    shown = replies if len(replies) <= 8 else replies[:4] + replies[-4:]
    for index, r in enumerate(shown):
        number = index + 1 if len(replies) <= 8 or index < 4 else len(replies) - 8 + index + 1
        drafts = f"{r['accepted_draft_tokens']}/{r['draft_tokens']}" if r.get("draft_tokens") else "-"
        lines.append(f"{number:>5} {r['prompt_tokens']:>7} {r['cached_prompt_tokens']:>7} {r['generated_tokens']:>7} "
                     f"{r['ttft_s']:>8.3f} {r['prefill_tps']:>10.1f} {r['decode_tps']:>9.2f} "
                     f"{r['peak_memory_gb']:>8.2f} {drafts:>11}")
    if len(replies) > 8:
        lines.insert(len(lines) - 4, f"{'...':>5}")
    total = sum(r["seconds"] for r in replies)
    lines.append("")
    lines.append(f"{'phase (all replies)':<24} {'seconds':>9} {'share':>7}")
    for phase in PHASES:
        seconds = sum(r["phases"].get(phase, 0.0) for r in replies)
        lines.append(f"{phase.replace('_', ' '):<24} {seconds:>9.3f} {100 * seconds / total if total else 0:>6.1f}%")
    steps = [s for r in replies for s in r["decode_steps"] if not s.get("prompt")]
    if steps:
        tokens = sum(s["tokens"] for s in steps)
        lines.append("")
        lines.append(f"decode: {len(steps)} steps after the first token, {tokens} tokens; per step, ms "
                     "(median / mean):")
        used = [p for p in STEP_PHASES if any(p in s for s in steps)]
        lines.append("  " + "".join(f"{p:>16}" for p in used))
        medians = [statistics.median(s.get(p, 0.0) for s in steps) * 1e3 for p in used]
        means = [statistics.fmean(s.get(p, 0.0) for s in steps) * 1e3 for p in used]
        lines.append("  " + "".join(f"{f'{m:.2f} / {a:.2f}':>16}" for m, a in zip(medians, means, strict=True)))
        step_total = sum(means)
        if step_total:
            lines.append("  " + "".join(f"{f'{100 * a / step_total:.1f}%':>16}" for a in means))
    return "\n".join(lines)


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A report written by the profiler (checked to be one)."""
    from .errors import InvalidInputError

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"{path}: cannot read a profile report ({exc})") from exc
    if not isinstance(data, dict) or data.get("mlxchat_profile") != 1 or not isinstance(data.get("replies"), list):
        raise InvalidInputError(f"{path}: not an mlxchat profile report (write one with MLXCHAT_PROFILE=path.json)")
    return data


def _from_environment() -> None:
    path = os.environ.get("MLXCHAT_PROFILE")
    if path:
        enable(path)
        atexit.register(lambda: _write(report()) if enabled else None)


_from_environment()
