"""The ``mlxchat`` command: ``generate``, ``chat``, ``serve``, ``train``, ``info`` and ``profile``.

Arguments are checked before any model loads (one line on stderr and exit status 2 when one is wrong);
library errors are one line too (status 1); Ctrl-C ends ``generate`` quietly with status 130.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

from pydantic import ValidationError

from .batching import DEFAULT_PREFILL_STEP_BUDGET
from .constraints import format_grammar
from .distributed.watchdog import DEFAULT_TIMEOUT
from .errors import MlxchatError
from .generation import GenerationConfig, GenerationReport
from .pacing import DEFAULT_DECODE_SLOWDOWN
from .runtime import package_version

EPILOG = """examples:
  mlxchat generate "What is the capital of France?"
  mlxchat generate --tools demo "What's the weather in London?"
  mlxchat generate --model Qwen/Qwen3-0.6B --max-tokens 200 "Write a haiku about rain."
  mlxchat chat --model ./my-checkpoint --system "Be concise."
  mlxchat serve --model Qwen/Qwen3-0.6B --port 8000     # OpenAI-compatible API, chat page at /
  mlxchat chat --web --tools demo                        # the chat page in a browser
  mlx.launch --backend ring -n 2 -- mlxchat generate --distributed tensor --model Qwen/Qwen3-0.6B "Hi"
  mlxchat serve --model Qwen/Qwen3-0.6B --adapter ./my-lora  # a peft-format LoRA adapter, unfused
  mlxchat train sft run.yaml                            # LoRA/QLoRA or whole-model SFT; grpo too
  mlxchat info
  MLXCHAT_PROFILE=p.json mlxchat generate "Hi" && mlxchat profile p.json

Without --model, the small demo model shipped inside the package is used (it knows a tiny world:
capitals, two-digit arithmetic, unit conversions, and weather/time tools)."""

DIM, RESET = "\033[2m", "\033[0m"
MAX_TOOL_ROUNDS = 8


class UsageError(Exception):
    """A command-line argument that cannot work (reported before anything loads)."""


def dim(text: str, stream: TextIO) -> str:
    """``text`` dimmed when ``stream`` is a terminal."""
    return f"{DIM}{text}{RESET}" if stream.isatty() else text


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown in the help, examples kept as written."""


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", help="checkpoint folder or Hugging Face repo id (default: the demo model)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                        help="compute dtype (default: float32 on CPU, the checkpoint's own on a GPU)")
    parser.add_argument("--context-length", type=int, metavar="N",
                        help="most tokens (prompt and reply) a generation may hold (default: the model's own)")
    parser.add_argument("--adapter", metavar="DIR",
                        help="a LoRA adapter in peft's layout (folder or Hub repo) applied to the model, unfused")
    parser.add_argument("--kv-bits", type=int, choices=[2, 3, 4, 5, 6, 8, 16], metavar="BITS",
                        help="store attention keys and values in BITS a value: 16 as float16, 8 or 4 group-wise "
                             "quantized (default: the compute dtype)")
    parser.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64,
                        help="features per quantization group of --kv-bits")
    parser.add_argument("--int8-activations", action="store_true",
                        help="quantized checkpoints: round the activations to 8 bits in products of 4 rows or "
                             "more (prompts, batched steps), as llama.cpp does (outputs off by ~1e-3; prefill about "
                             "twice as fast with AVX-512 VNNI, 1.6x with AVX2; without AVX2 no change)")
    parser.add_argument("--distributed", choices=["tensor", "pipeline"],
                        help="split the model over the processes mlx.launch started (every rank runs the same "
                             "command; rank 0 does the talking, the others follow it)")
    parser.add_argument("--distributed-timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help="with --distributed: how long rank 0 waits for one step of the other ranks before it "
                             "gives the group up (a rank died or hangs) and fails with an error")
    parser.add_argument("--prefill-step-budget", type=int, default=DEFAULT_PREFILL_STEP_BUDGET, metavar="N",
                        help="most prompt tokens one step prefills beside a token of every running generation "
                             "(smaller: smoother streams while a long prompt arrives, slower prefill)")
    parser.add_argument("--max-decode-slowdown", type=float, default=DEFAULT_DECODE_SLOWDOWN, metavar="X",
                        help="while generations decode, a step prefills only as many prompt tokens as keep it "
                             "within X times their own step, as measured (0: off, the budget alone bounds it)")


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    _model_args(parser)
    parser.add_argument("--max-tokens", type=int, metavar="N",
                        help="most tokens to generate per reply (default: 512)")
    parser.add_argument("--temperature", type=float, help="0 for greedy (default: the checkpoint's)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling mass (default: the checkpoint's)")
    parser.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (default: the checkpoint's)")
    parser.add_argument("--seed", type=int, help="random seed for sampling (default: none)")
    parser.add_argument("--system", help="system prompt")
    parser.add_argument("--no-think", action="store_true", help="ask the chat template to turn reasoning off")
    parser.add_argument("--thinking", choices=["stream", "show", "hide"],
                        help="reasoning: stream it inline, show it on stderr, or hide it (default: stream on a "
                             "terminal, hide when the output is piped)")
    parser.add_argument("--tools", metavar="SPEC",
                        help="tools the model may call, run automatically with a trace on stderr: 'demo' (the "
                             "demo's weather and time tools) or module:function,... (@tool functions); with "
                             "chat --web they run on the page, where the demo's weather waits for approval and "
                             "its time asks which city")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxchat",
        description="Run local chat models on MLX behind stateful chat sessions.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mlxchat {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser("generate", help="stream one reply to a prompt, then print its report",
                                   formatter_class=_Formatter,
                                   description="Stream one reply to PROMPT (through the chat template unless "
                                               "--raw) and print the generation report on stderr.")
    generate.add_argument("prompt", help="the prompt ('-' reads standard input)")
    generate.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    generate.add_argument("--image", action="append", default=[], metavar="PATH",
                          help="an image to show the model with the prompt (repeatable; vision models)")
    shape = generate.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE",
                       help="constrain the reply to JSON valid against the JSON Schema in FILE")
    shape.add_argument("--json", action="store_true", help="constrain the reply to a JSON object")
    _sampling_args(generate)

    chat = commands.add_parser("chat", help="an interactive chat session", formatter_class=_Formatter,
                               description="Chat interactively. Commands: /image PATH, /reset, /system TEXT, "
                                           "/save FILE, /help, /quit. Ctrl-C stops a reply (and keeps it), "
                                           "Ctrl-D quits. --web opens the chat page in a browser instead.")
    _sampling_args(chat)
    chat.add_argument("--web", action="store_true",
                      help="serve the chat page on a free loopback port and open it in a browser (the conversations "
                           "are kept in the server's default store)")

    serve = commands.add_parser("serve", help="an OpenAI- and Anthropic-compatible HTTP API (needs mlxchat[server])",
                                formatter_class=_Formatter,
                                description="Serve POST /v1/chat/completions, the Responses API (/v1/responses, "
                                            "stored and continued by previous_response_id), Anthropic's POST "
                                            "/v1/messages, GET /v1/models and GET /health for one model; requests "
                                            "reuse cached prompts. See the README's 'Running the server safely'.")
    _model_args(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (on a loopback address only loopback Host names are accepted)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--served-model-name", "--name", dest="name", metavar="NAME",
                       help="the model id clients use; requests naming another get 404 (default: the checkpoint's "
                            "Hub repo id or folder name)")
    serve.add_argument("--store", default=str(_default_store()), metavar="PATH",
                       help="SQLite file keeping stored responses across restarts (':memory:' keeps them only "
                            "while the server runs)")
    serve.add_argument("--store-max-age", type=float, default=30.0, metavar="DAYS",
                       help="days a stored response is kept (0: for ever); older ones are answered 404")
    serve.add_argument("--store-max-rows", type=int, default=10_000, metavar="N",
                       help="most stored responses kept, the oldest removed first (0: no bound)")
    serve.add_argument("--max-spill-gb", type=float, default=8.0,
                       help="disk for prompt caches evicted from memory, in PATH.spill beside the store (0: none)")
    serve.add_argument("--api-key", default=os.environ.get("MLXCHAT_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                            "$MLXCHAT_API_KEY, else no key)")
    serve.add_argument("--caches", type=int, default=4, help="idle prompt caches kept between requests")
    serve.add_argument("--max-cache-gb", type=float, default=4.0, help="memory the idle prompt caches may hold")
    serve.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body accepted")
    serve.add_argument("--max-kv-gb", type=float, default=None,
                       help="memory the caches of admitted requests hold, each reserved as its reply grows up to "
                            "prompt + max_tokens; more waits, a request that can never fit gets 503 (default: half "
                            "the machine's memory)")
    serve.add_argument("--metrics-open", action="store_true",
                       help="serve GET /metrics without the API key to loopback clients (a local scraper)")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="generation requests running or waiting at once (429 beyond)")
    serve.add_argument("--max-connections", type=int, default=128, help="requests in flight at once (503 beyond)")
    serve.add_argument("--header-timeout", type=float, default=10.0,
                       help="seconds a connection may take to send a request's headers")
    serve.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="seconds a request may take to send its body (408 beyond)")
    serve.add_argument("--input-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="how long a chat page tool's question waits for the user's answer (the turn holds its "
                            "memory meanwhile); past it the tool gets an error and the turn goes on")
    serve.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                       help="a browser origin allowed to call the API (repeatable; default: none)")
    serve.add_argument("--allow-remote-images", action="store_true",
                       help="fetch http(s) image URLs in requests (default: only data: URLs)")
    serve.add_argument("--tools", metavar="SPEC",
                       help="tools the chat page's conversations may call, run on the server: 'demo' (the demo's "
                            "weather tool, which waits for the user's approval, and time tool, which asks the "
                            "user which city) or module:function,... (@tool functions; API clients run their "
                            "own tools)")

    train = commands.add_parser("train", help="fine-tune: SFT or GRPO, with LoRA/QLoRA adapters or the whole model",
                                formatter_class=_Formatter,
                                description="Run the training described by CONFIG.yaml (see mlxchat.train.cli): "
                                            "a progress bar on stderr, checkpoints in OUTPUT/checkpoints; the "
                                            "same command again resumes from the last one.")
    train.add_argument("kind", choices=["sft", "grpo"], help="supervised fine-tuning on chats, or GRPO on prompts")
    train.add_argument("config", metavar="CONFIG.yaml", help="the run's settings")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")

    info = commands.add_parser("info", help="MLX version, device, BLAS, registered plugins, the process group",
                               formatter_class=_Formatter)
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.add_argument("--model", "-m", help="also a checkpoint's context limit and where it comes from (reads "
                                            "its config.json only)")

    profile = commands.add_parser("profile", help="summarise a profile report (MLXCHAT_PROFILE=report.json)",
                                  formatter_class=_Formatter)
    profile.add_argument("report", help="a report the profiler wrote (see mlxchat.profiling)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "info":
            return _info(args)
        if args.command == "profile":
            from . import profiling

            print(profiling.summary(profiling.load(args.report)))
            return 0
        if args.command == "serve":
            return _serve(args)
        if args.command == "train":
            from .train.cli import run

            print(run(args.kind, args.config, progress=not args.no_progress))
            return 0
        config = _config(args)
        tools = _tools(args.tools, page=args.command == "chat" and args.web)
        if args.command == "generate":
            return _generate(args, config, tools)
        if args.web:
            return _web(args, config, tools)
        return _chat(args, config, tools)
    except UsageError as exc:
        print(f"mlxchat: {exc}", file=sys.stderr)
        return 2
    except MlxchatError as exc:
        print(f"mlxchat: {exc}", file=sys.stderr)
        return 1


def _info(args: argparse.Namespace) -> int:
    from .distributed import group_info
    from .runtime import runtime_info

    info = runtime_info()
    info["distributed"] = group_info()
    if args.model:
        from .loading import checkpoint_context

        limit, reason = checkpoint_context(args.model)
        info["context"] = {"model": args.model, "context_length": limit, "reason": reason}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    blas = info["blas"] + (f" ({info['blas_path']})" if info["blas_path"] else "")
    if info["gemv_route"]:
        blas += ", single-row products routed to sgemv"
    rows = [("mlxchat", info["mlxchat"]), ("MLX", info["mlx"]), ("Python", info["python"]),
            ("platform", info["platform"]), ("device", info["device"]), ("CPU cores", info["cpu_count"]),
            ("BLAS", blas), ("BLAS route", info["blas_route"]), ("quantized", info["quantized_kernels"]),
            ("fused", info["fused_kernels"])]
    if info["blas_note"]:
        rows.append(("note", info["blas_note"]))
    for name, types in info["plugins"].items():
        rows.append((f"plugin {name}", ", ".join(types)))
    group = info["distributed"]
    if group is not None:
        rows.append(("process group", f"rank {group['rank']} of {group['size']} ({group['backend']} backend)"))
    if "context" in info:
        rows.append(("context", f"{info['context']['context_length']} tokens ({info['context']['reason']})"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    missing = [name for name in ("starlette", "uvicorn", "prometheus_client")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"serve needs {' and '.join(missing)}: pip install 'mlxchat[server]'")
    from .server import ServerSettings, serve

    values = {"model_name": args.name, "api_key": args.api_key or None, "caches": args.caches,
              "max_cache_gb": args.max_cache_gb, "max_body_mb": args.max_body_mb, "max_queue": args.max_queue,
              "max_connections": args.max_connections, "header_timeout": args.header_timeout,
              "input_timeout": args.input_timeout, "body_timeout": args.body_timeout,
              "cors_origins": args.cors_origin, "allow_remote_images": args.allow_remote_images,
              "store": args.store, "max_spill_gb": args.max_spill_gb, "store_max_age_days": args.store_max_age,
              "store_max_rows": args.store_max_rows, "max_kv_gb": args.max_kv_gb,
              "metrics_open": args.metrics_open}
    try:
        settings = ServerSettings.model_validate(values)
    except ValidationError as exc:
        raise UsageError(_first_problem(exc)) from None
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be from 0 to 65535, got {args.port}")
    _check_context_length(args)
    tools = _tools(args.tools, page=True)
    model = _load(args)
    if _follows(model):
        return 0
    try:
        serve(model, host=args.host, port=args.port, settings=settings, tools=tools)
    except KeyboardInterrupt:  # uvicorn shut down cleanly, then re-raised the interrupt
        return 130
    return 0


def _web(args: argparse.Namespace, config: GenerationConfig, tools: list[Any]) -> int:
    """``chat --web``: the chat page on a free loopback port, opened in a browser once the server listens."""
    import socket
    import threading
    import webbrowser

    missing = [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"chat --web needs {' and '.join(missing)}: pip install 'mlxchat[server]'")
    if args.system:
        raise UsageError("chat --web: the page's conversations take no --system prompt")
    from .server import ServerSettings, serve

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    model = _load(args)
    if _follows(model):
        return 0
    model.defaults = model.defaults.merged(config)
    url = f"http://127.0.0.1:{port}/"

    def open_when_listening() -> None:
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                threading.Event().wait(0.1)
                continue
            print(dim(f"the chat page is at {url} (Ctrl-C ends it)", sys.stderr), file=sys.stderr)
            webbrowser.open(url)
            return

    threading.Thread(target=open_when_listening, daemon=True).start()
    try:
        serve(model, port=port, settings=ServerSettings(store=str(_default_store())), tools=tools)
    except KeyboardInterrupt:
        return 130
    return 0


def _default_store() -> Path:
    """``$XDG_DATA_HOME/mlxchat/store.sqlite3`` (``~/.local/share`` when unset)."""
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "mlxchat" / "store.sqlite3"


def _check_context_length(args: argparse.Namespace) -> None:
    if args.context_length is not None and args.context_length < 2:
        raise UsageError("--context-length: must be at least 2")


def _first_problem(exc: ValidationError) -> str:
    error = exc.errors(include_url=False, include_input=False)[0]
    option = "--" + str(error["loc"][0]).replace("_", "-") if error["loc"] else "an option"
    return f"{option}: {error['msg'].removeprefix('Value error, ')}"


def _load(args: argparse.Namespace) -> Any:
    from .loading import load_model
    from .quantized import set_int8_activations

    if args.prefill_step_budget < 1:
        raise UsageError(f"--prefill-step-budget must be at least 1, got {args.prefill_step_budget}")
    slowdown = args.max_decode_slowdown or None
    if slowdown is not None and not (1 < slowdown < math.inf):
        raise UsageError(f"--max-decode-slowdown must be above 1 (or 0 for off), got {args.max_decode_slowdown}")
    if not args.distributed_timeout > 0:
        raise UsageError(f"--distributed-timeout must be a positive number of seconds, got {args.distributed_timeout}")
    if args.int8_activations:
        set_int8_activations(True)
    print(dim(f"loading {args.model or 'the demo model'} ...", sys.stderr), file=sys.stderr)
    return load_model(args.model, dtype=args.dtype, context_length=args.context_length,
                      kv_bits=args.kv_bits, kv_group_size=args.kv_group_size, distributed=args.distributed,
                      distributed_timeout=args.distributed_timeout, prefill_step_budget=args.prefill_step_budget,
                      max_decode_slowdown=slowdown, adapter=args.adapter)


def _follows(model: Any) -> bool:
    """On a rank other than 0 of a split model: run rank 0's work until it is done (then the command ends)."""
    if getattr(model, "rank", 0) == 0:
        return False
    model.follow()
    return True


def _config(args: argparse.Namespace) -> GenerationConfig:
    """The generation settings of the command line, checked before the model loads."""
    _check_context_length(args)
    values = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "seed": args.seed, "enable_thinking": False if args.no_think else None,
              "response_format": _response_format(args)}
    try:
        return GenerationConfig.model_validate({k: v for k, v in values.items() if v is not None})
    except ValidationError as exc:
        raise UsageError(_first_problem(exc)) from None


def _response_format(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--json`` or ``--json-schema FILE`` as a response format, its schema read and compiled now."""
    if getattr(args, "json", False):
        return {"type": "json_object"}
    path = getattr(args, "json_schema", None)
    if path is None:
        return None
    try:
        schema = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise UsageError(f"--json-schema: cannot read a JSON Schema from {path} ({exc})") from None
    fmt = {"type": "json_schema", "json_schema": {"name": Path(path).stem, "schema": schema}}
    try:
        format_grammar(fmt)
    except MlxchatError as exc:
        raise UsageError(f"--json-schema {path}: {exc}") from None
    return fmt


def _tools(spec: str | None, page: bool = False) -> list[Any]:
    """The tools ``--tools`` names: ``demo``, or ``module:function`` items separated by commas. The demo's
    tools run automatically in a terminal; on the chat ``page`` the weather waits for approval and the time
    asks the user (so the page's questions can be seen)."""
    if not spec:
        return []
    if spec == "demo":
        from .demo.world import DEMO_PAGE_TOOLS, DEMO_TOOLS

        return list(DEMO_PAGE_TOOLS if page else DEMO_TOOLS)
    from .tools import Tool

    tools = []
    for item in spec.split(","):
        module_name, _, name = item.strip().partition(":")
        if not module_name or not name:
            raise UsageError(f"--tools: {item!r} is neither 'demo' nor module:function")
        try:
            function = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError, TypeError) as exc:  # (TypeError: a relative name, ".mod")
            raise UsageError(f"--tools: cannot load {item} ({exc})") from None
        if not callable(function):
            raise UsageError(f"--tools: {item} is a {type(function).__name__}, not a function")
        try:
            tools.append(function if isinstance(function, Tool) else Tool(function))
        except TypeError as exc:
            raise UsageError(f"--tools: {item} is not a usable tool ({exc})") from None
    return tools


def _report_line(report: GenerationReport) -> str:
    return (f"[{report.prompt_tokens} prompt tokens, {report.cached_prompt_tokens} cached, "
            f"{report.generated_tokens} generated | prefill {report.prefill_tps:.1f} tok/s, "
            f"decode {report.decode_tps:.1f} tok/s, ttft {report.ttft_s:.2f} s | "
            f"peak {report.peak_memory_gb:.2f} GB | {report.finish_reason}]")


class Printer:
    """Writes a streamed turn: text to ``out``, reasoning as ``--thinking`` says, calls as a trace on ``err``."""

    def __init__(self, out: TextIO, err: TextIO, thinking: str | None):
        self.out, self.err = out, err
        self.thinking = thinking or ("stream" if out.isatty() else "hide")
        self._in_thinking = False

    def _reasoning(self, text: str) -> None:
        if self.thinking == "hide":
            return
        target = self.out if self.thinking == "stream" else self.err
        if not self._in_thinking:
            target.write(DIM if target.isatty() else "<think>\n")
            self._in_thinking = True
        target.write(text)
        target.flush()

    def end_reasoning(self) -> None:
        if self._in_thinking:
            target = self.out if self.thinking == "stream" else self.err
            target.write(f"{RESET}\n" if target.isatty() else "\n</think>\n")
            self._in_thinking = False

    def print(self, events: Iterable[Any]) -> Any:
        """Write a turn's events; return its result."""
        from .reply import TextDelta, ThinkingDelta, ToolCallEvent
        from .session import Done

        result, wrote = None, False
        for event in events:
            if isinstance(event, ThinkingDelta):
                self._reasoning(event.text)
                continue
            self.end_reasoning()
            if isinstance(event, TextDelta):
                self.out.write(event.text)
                self.out.flush()
                wrote = True
            elif isinstance(event, ToolCallEvent):
                call = event.call
                invalid = f" INVALID: {call.error}" if call.status == "invalid" else ""
                self.err.write(dim(f"[tool call {call.id}: {call.name}({call.function.arguments}){invalid}]",
                                   self.err) + "\n")
            elif isinstance(event, Done):
                result = event.result
        self.end_reasoning()
        if wrote or result is None or not result.tool_calls:
            self.out.write("\n")
            self.out.flush()
        return result

    def reset_style(self) -> None:
        """After an interruption: no dimmed text left behind on a terminal."""
        for stream in (self.out, self.err):
            if stream.isatty():
                stream.write(RESET)
        self.out.write("\n")
        self.out.flush()


def _turn(session: Any, printer: Printer, first: Any, tools: list[Any]) -> Any:
    """Print a turn, and while the model calls offered tools, run them, show the results and continue."""
    by_name = {t.name: t for t in tools}
    result = printer.print(first)
    rounds = 0
    while result is not None and result.tool_calls and rounds < MAX_TOOL_ROUNDS:
        valid = [c for c in result.tool_calls if c.status == "ok"]
        if not valid:
            break
        for call in valid:
            output = _run_tool(by_name.get(call.name), call)
            printer.err.write(dim(f"[tool result {call.id}: {output}]", printer.err) + "\n")
            session.add_tool_result(call.id, output)
        rounds += 1
        result = printer.print(session.respond_stream())
    return result


def _run_tool(tool: Any, call: Any) -> str:
    if tool is None:
        return f"error: no tool named {call.name!r}"
    try:
        output = tool(**call.arguments)
    except Exception as exc:  # noqa: BLE001 - the model sees the failure and can recover
        return f"error: {type(exc).__name__}: {exc}"
    return output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)


def _generate(args: argparse.Namespace, config: GenerationConfig, tools: list[Any]) -> int:
    printer = Printer(sys.stdout, sys.stderr, args.thinking)
    try:
        model = _load(args)
        if _follows(model):
            return 0
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        if args.image and (args.raw or model.chat_template is None):
            raise UsageError("--image needs the chat template (drop --raw)")
        if args.raw or model.chat_template is None:
            report = None
            for chunk in model.stream(prompt, config):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                report = chunk.report or report
            sys.stdout.write("\n")
        else:
            session = model.chat_session(system=args.system, default_config=config, tools=tools or None)
            result = _turn(session, printer, session.send_stream(prompt, images=args.image), tools)
            report = result.report if result else None
    except KeyboardInterrupt:
        printer.reset_style()
        return 130
    if report is not None:
        print(_report_line(report), file=sys.stderr)
    return 0


def _chat(args: argparse.Namespace, config: GenerationConfig, tools: list[Any]) -> int:
    model = _load(args)
    if _follows(model):
        return 0
    session = model.chat_session(system=args.system, default_config=config, tools=tools or None)
    printer = Printer(sys.stdout, sys.stderr, args.thinking)
    interactive = sys.stdin.isatty()
    images: list[str] = []
    if interactive:
        print(dim(f"chatting with {model.path}; /help for commands, Ctrl-D to quit", sys.stderr), file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        if not line.strip():
            continue
        if line.startswith("/"):
            try:
                if _command(session, line.strip(), images):
                    return 0
            except MlxchatError as exc:
                print(f"mlxchat: {exc}", file=sys.stderr)
            continue
        stream = None
        try:
            stream = session.send_stream(line, images=images)
            images.clear()
            result = _turn(session, printer, stream, tools)
        except KeyboardInterrupt:
            printer.reset_style()
            result = stream.result if stream is not None else None
        except MlxchatError as exc:
            print(f"mlxchat: {exc}", file=sys.stderr)
            continue
        if result is not None:
            print(dim(_report_line(result.report), sys.stderr), file=sys.stderr)


COMMANDS = ("/image PATH  show the model an image with the next message\n"
            "/reset  clear the conversation\n/system [TEXT]  set (or remove) the system prompt\n"
            "/save [FILE]  save the transcript as JSON\n/help  this list\n/quit  leave")


def _command(session: Any, line: str, images: list[str]) -> bool:
    """Run a /command; True means quit. ``/image`` adds to ``images``, which go with the next message."""
    name, _, rest = line.partition(" ")
    if name in ("/quit", "/exit"):
        return True
    if name == "/image":
        path = Path(rest.strip()).expanduser()
        if not rest.strip() or not path.is_file():
            print(f"mlxchat: /image needs the path of an image file ({rest.strip() or 'none given'})", file=sys.stderr)
        elif not session.model.supports_images:
            print("mlxchat: this model reads no images", file=sys.stderr)
        else:
            images.append(str(path))
            print(dim(f"{path.name} goes with your next message", sys.stderr), file=sys.stderr)
        return False
    if name == "/reset":
        session.reset()
        print(dim("conversation cleared", sys.stderr), file=sys.stderr)
    elif name == "/system":
        session.set_system(rest or None)
        print(dim(f"system prompt {'set' if rest else 'removed'}", sys.stderr), file=sys.stderr)
    elif name == "/save":
        path = Path(rest or "transcript.json")
        try:
            path.write_text(json.dumps([m.model_dump() for m in session.messages], indent=2, ensure_ascii=False))
        except OSError as exc:  # the conversation goes on: it is not lost to a mistyped path
            print(f"mlxchat: /save: cannot write {path} ({exc.strerror or exc})", file=sys.stderr)
            return False
        print(dim(f"saved {len(session.messages)} messages to {path}", sys.stderr), file=sys.stderr)
    elif name in ("/help", "/?"):
        print(COMMANDS, file=sys.stderr)
    else:
        print(f"mlxchat: unknown command {name}; /help lists the commands", file=sys.stderr)
    return False


if __name__ == "__main__":
    sys.exit(main())
