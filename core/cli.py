"""The ``mlxchat`` command: ``generate``, ``chat`` and ``info``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

from .errors import MlxchatError
from .generation import GenerationConfig, GenerationReport


def dim(text: str, stream: TextIO) -> str:
    """``text`` dimmed when ``stream`` is a terminal."""
    return f"\033[2m{text}\033[0m" if stream.isatty() else text

EPILOG = """examples:
  mlxchat generate "What is the capital of France?"
  mlxchat generate --model Qwen/Qwen3-0.6B --max-tokens 200 "Write a haiku about rain."
  mlxchat chat --model ./my-checkpoint --system "Be concise."
  mlxchat serve --model Qwen/Qwen3-0.6B --port 8000     # OpenAI-compatible API
  mlxchat info

Without --model, the small demo model shipped inside the package is used (it knows a tiny world:
capitals, two-digit arithmetic, unit conversions, and weather/time tools)."""


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", help="checkpoint folder or Hugging Face repo id (default: the demo model)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                        help="compute dtype (default: float32 on CPU, the checkpoint's on a GPU)")
    parser.add_argument("--max-tokens", type=int, help="most tokens to generate per reply")
    parser.add_argument("--temperature", type=float, help="0 for greedy (default: the checkpoint's)")
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--system", help="system prompt")
    parser.add_argument("--no-think", action="store_true", help="ask the chat template to turn reasoning off")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxchat",
        description="Run local chat models on MLX behind stateful chat sessions.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser("generate", help="stream one reply to a prompt, then print its report",
                                   description="Stream one reply to PROMPT (through the chat template unless "
                                               "--raw) and print the generation report.")
    generate.add_argument("prompt", help="the prompt ('-' reads standard input)")
    generate.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    _sampling_args(generate)

    chat = commands.add_parser("chat", help="an interactive chat session",
                               description="Chat interactively. Commands: /reset, /system TEXT, /save FILE, "
                                           "/help, /quit. Ctrl-C stops a reply (and keeps it), Ctrl-D quits.")
    _sampling_args(chat)

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP API (needs mlxchat[server])",
                                description="Serve POST /v1/chat/completions (streaming, tools, reasoning) and "
                                            "GET /v1/models for one model; requests reuse cached prompts.")
    serve.add_argument("--model", "-m", help="checkpoint folder or Hugging Face repo id (default: the demo model)")
    serve.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--name", help="the model id clients use (default: the checkpoint folder's name)")
    serve.add_argument("--caches", type=int, default=4, help="prompt caches kept between requests")

    info = commands.add_parser("info", help="MLX version, device, BLAS and registered plugins")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "info":
            return _info(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            from .server import serve

            serve(_load(args), host=args.host, port=args.port, model_name=args.name, caches=args.caches)
            return 0
        return _chat(args)
    except MlxchatError as exc:
        print(f"mlxchat: {exc}", file=sys.stderr)
        return 1


def _info(args: argparse.Namespace) -> int:
    from .runtime import runtime_info

    info = runtime_info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    blas = info["blas"] + (f" ({info['blas_path']})" if info["blas_path"] else "")
    if info["gemv_route"]:
        blas += ", single-row products routed to sgemv"
    rows = [("mlxchat", info["mlxchat"]), ("MLX", info["mlx"]), ("Python", info["python"]),
            ("platform", info["platform"]), ("device", info["device"]), ("CPU cores", info["cpu_count"]),
            ("BLAS", blas)]
    if info["blas_note"]:
        rows.append(("note", info["blas_note"]))
    for name, types in info["plugins"].items():
        rows.append((f"plugin {name}", ", ".join(types)))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _load(args: argparse.Namespace) -> Any:
    from .loading import load_model

    print(dim(f"loading {args.model or 'the demo model'} ...", sys.stderr), file=sys.stderr)
    return load_model(args.model, dtype=args.dtype)


def _config(args: argparse.Namespace) -> GenerationConfig:
    values = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "seed": args.seed, "enable_thinking": False if args.no_think else None}
    return GenerationConfig.model_validate({k: v for k, v in values.items() if v is not None})


def _report_line(report: GenerationReport) -> str:
    return (f"[{report.prompt_tokens} prompt tokens, {report.cached_prompt_tokens} cached, "
            f"{report.generated_tokens} generated | prefill {report.prefill_tps:.1f} tok/s, "
            f"decode {report.decode_tps:.1f} tok/s, ttft {report.ttft_s:.2f} s | "
            f"peak {report.peak_memory_gb:.2f} GB | {report.finish_reason}]")


def _print_events(events: Iterable[Any], out: TextIO) -> Any:
    """Stream a chat turn to the terminal: reasoning dimmed, calls shown, text as it comes."""
    from .reply import TextDelta, ThinkingDelta, ToolCallEvent
    from .session import Done

    result, thinking = None, False
    start, end = ("\033[2m", "\033[0m") if out.isatty() else ("", "")
    for event in events:
        if isinstance(event, ThinkingDelta):
            if not thinking:
                out.write(start)
                thinking = True
            out.write(event.text)
        else:
            if thinking:
                out.write(end + "\n")
                thinking = False
            if isinstance(event, TextDelta):
                out.write(event.text)
            elif isinstance(event, ToolCallEvent):
                call = event.call
                out.write(f"\n[tool call {call.id}: {call.name}({call.function.arguments})"
                          f"{' INVALID: ' + (call.error or '') if call.status == 'invalid' else ''}]")
            elif isinstance(event, Done):
                result = event.result
        out.flush()
    if thinking:
        out.write(end)
    out.write("\n")
    return result


def _generate(args: argparse.Namespace) -> int:
    model = _load(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    config = _config(args)
    if args.raw or model.chat_template is None:
        report = None
        for chunk in model.stream(prompt, config):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            report = chunk.report or report
        sys.stdout.write("\n")
    else:
        session = model.chat_session(system=args.system)
        result = _print_events(session.send_stream(prompt, config=config), sys.stdout)
        report = result.report if result else None
    if report is not None:
        print(_report_line(report), file=sys.stderr)
    return 0


def _chat(args: argparse.Namespace) -> int:
    model = _load(args)
    config = _config(args)
    session = model.chat_session(system=args.system)
    print(dim(f"chatting with {model.path}; /help for commands, Ctrl-D to quit", sys.stderr), file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        if not line.strip():
            continue
        if line.startswith("/"):
            if _command(session, line.strip()):
                return 0
            continue
        stream = session.send_stream(line, config=config)
        try:
            result = _print_events(stream, sys.stdout)
        except KeyboardInterrupt:
            sys.stdout.write("\033[0m\n" if sys.stdout.isatty() else "\n")
            result = stream.result
        if result is not None:
            print(dim(_report_line(result.report), sys.stderr), file=sys.stderr)


def _command(session: Any, line: str) -> bool:
    """Run a /command; True means quit."""
    name, _, rest = line.partition(" ")
    if name in ("/quit", "/exit"):
        return True
    if name == "/reset":
        session.reset()
        print(dim("conversation cleared", sys.stderr), file=sys.stderr)
    elif name == "/system":
        session.set_system(rest or None)
        print(dim(f"system prompt {'set' if rest else 'removed'}", sys.stderr), file=sys.stderr)
    elif name == "/save":
        path = Path(rest or "transcript.json")
        path.write_text(json.dumps([m.model_dump() for m in session.messages], indent=2, ensure_ascii=False))
        print(dim(f"saved {len(session.messages)} messages to {path}", sys.stderr), file=sys.stderr)
    else:
        print("/reset  clear the conversation\n/system [TEXT]  set (or remove) the system prompt\n"
              "/save [FILE]  save the transcript as JSON\n/quit  leave", file=sys.stderr)
    return False


if __name__ == "__main__":
    sys.exit(main())
