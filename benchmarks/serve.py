"""``python -m benchmarks.serve``: serving engines side by side under a mixed chat workload, in one run, with
the goals of issue 25 computed from what the clients saw.

Engines, each a server in its own process on the same checkpoint, one after another:

- ``mlxchat``: ``mlxchat serve`` with its defaults (on a CPU float32, OpenBLAS, the gemv route; idle caches
  within 4 GB), keeping the number of clients + 2 caches and spilling none to disk (the workload never
  comes back to an evicted conversation, and the other engines keep none on disk);
  ``--budgets 64,128,256,512`` runs it once per ``--prefill-step-budget`` (rows ``mlxchat b=N``), and
  ``--slowdowns 0,2`` once per ``--max-decode-slowdown`` (rows ``mlxchat s=X``, 0 for off), to pick measured
  defaults.
- ``mlx-lm``: ``mlx_lm server`` (0.32.2) with its batch generator on for every client
  (``--decode-concurrency`` / ``--prompt-concurrency`` at the number of clients + 1) and a prompt cache of
  as many entries and bytes as mlxchat's, started the way the speed rows run mlx-lm at its best on a CPU:
  the same OpenBLAS preloaded before MLX, on a float32 copy of the weights (its server has no dtype
  setting).
- ``llama.cpp``: llama-cpp-python's server (``pip install 'llama-cpp-python[server]'``, see
  ``build_llama_cpp.sh``) on the F32 GGUF conversion of the same checkpoint (:mod:`benchmarks.gguf`, made
  on first use), every core, its RAM prompt cache on (4 GB), and ``--interrupt_requests false`` (by
  default a new request ends the running stream early). It serves one request at a time.
- ``llama-server``: llama.cpp's own server, built from the same sources by ``build_llama_cpp.sh`` (or
  ``LLAMA_SERVER``), on the same F32 GGUF: a slot per client and one for the documents (``--parallel``),
  continuous batching, its unified KV cache (F16, its default) sized for every slot's longest conversation,
  its RAM prompt cache at the same 4 GB, every core.

An engine that is not installed is listed as skipped; one that fails to start or run is listed with its
error, and the run goes on.

The workload, per number of clients (``--clients 1,4,8,16``): each client holds a multi-turn chat
(``--turns`` requests, each carrying the whole conversation) whose system prompt, about ``--system-tokens``
tokens, is the same for all; beside them one more client sends documents of about ``--document-tokens``
tokens to summarize, one after another, while the chats last. Every request streams, greedy, at most
``--max-tokens`` tokens. Each server answers one short request before the workload (loading, first
compilations), and each engine first runs one chat alone, without documents: its *solo step* (the median
gap between streamed pieces).

Reported per engine and client count: generated tokens per second over the run (every stream's tokens,
documents included, over the wall time), p50 / p99 time to first token of the chats and of the documents,
p50 / p99 inter-token latency of the chats (every gap between two streamed pieces), the same p99 over the
gaps that overlap a document's prefill (from its request to its first token) and its ratio to the solo
step, the share of prompt tokens the server reports as cached, and the share of the system prompt each
chat's first request found cached (llama.cpp reports none). For mlxchat, ``/metrics`` is scraped before and
after each run, and its counters' increase must equal what the clients saw (requests, prompt, cached and
generated tokens).

The goals (issue 25), under the table: while a document's prompt goes in, the chats' p99 inter-token
latency within 2x their solo step; at 8 clients, 7 of the 8 first turns with >= 95% of the shared system
prompt cached; at 8 clients, throughput >= 1.5x mlx-lm's and >= llama.cpp's.

Results go to ``results/serve.json`` and ``.md`` (``--quick``: ``results/quick.serve.*``, git-ignored).
``--quick`` smoke-tests the harness on the shipped demo model at tiny sizes; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .host import describe
from .load import counters_check, percentile, scrape_counters

RESULTS = Path(__file__).resolve().parent / "results"
ENGINES = ("mlxchat", "mlx-lm", "llama.cpp", "llama-server")
CACHE_GB = 4
"""Memory each engine's idle prompt caches may hold (mlxchat's default)."""
GOAL_ITL_RATIO = 2.0
GOAL_CLIENTS = 8
GOAL_CACHED_SHARE, GOAL_CACHED_CHATS = 0.95, 7
GOAL_VS = {"mlx-lm": 1.5, "llama.cpp": 1.0, "llama-server": 1.0}
WORDS = ("the", "river", "system", "answer", "tool", "careful", "number", "report", "city", "always", "cite",
         "source", "brief", "user", "format", "table", "check", "value", "step", "plan")


@dataclass
class Sample:
    """One streamed request as the client saw it (times from ``time.perf_counter``)."""

    kind: str
    """``chat`` or ``document``."""
    turn: int
    sent: float = 0.0
    stamps: list[float] = field(default_factory=list)
    """When each streamed piece arrived."""
    ended: float = 0.0
    """When the request ended (finished, failed or cut)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    """As the server's usage says (0: not reported)."""
    text: str = ""
    error: str | None = None
    cut: bool = False
    """Still running when the row's time ran out (its pieces count, its times and usage do not)."""

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.sent if self.stamps else 0.0

    @property
    def gaps(self) -> list[tuple[float, float]]:
        """(start, end) of each gap between two pieces."""
        return list(zip(self.stamps, self.stamps[1:], strict=False))

    @property
    def tokens(self) -> int:
        return self.generated_tokens or len(self.stamps)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def text_of(tokens: int, tokenizer: Any, seed: int) -> str:
    """Text of about ``tokens`` tokens of this checkpoint's tokenizer (made of plain words, varied by ``seed``)."""
    words: list[str] = []
    index = seed
    while True:
        words.extend(WORDS[(index * 7 + k) % len(WORDS)] for k in range(64))
        index += 1
        text = " ".join(words)
        if len(tokenizer.encode(text).ids) >= tokens:
            break
    low, high = 1, len(words)
    while low < high:  # the most words that stay within ``tokens``
        middle = (low + high + 1) // 2
        if len(tokenizer.encode(" ".join(words[:middle])).ids) <= tokens:
            low = middle
        else:
            high = middle - 1
    return " ".join(words[:low])


@dataclass(frozen=True)
class Setup:
    """What every server of a run shares."""

    folder: Path
    work: Path
    blas_path: str | None
    chat_tokens: int
    document_tokens: int
    """The most tokens one chat and one document request reach (what llama-server's KV cache must hold)."""


class Server:
    """One engine's server process on a free port (its output in ``log``); a context manager that starts it,
    waits until it has answered one short request, and stops it."""

    def __init__(self, engine: str, setup: Setup, clients: int, flags: Sequence[str] = ()):
        self.engine, self.setup, self.clients, self.flags = engine, setup, clients, list(flags)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = "default_model" if engine == "mlx-lm" else "bench"
        self.work = Path(tempfile.mkdtemp(prefix=f"{engine}-{clients}-", dir=setup.work))
        self.log = self.work / "server.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.stopped_rss: int | None = None

    def __enter__(self) -> Server:
        command = self._command()  # may convert or copy the weights first
        self.process = subprocess.Popen(command, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            self._wait_ready()
            warm_up(self)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop()

    def _command(self) -> list[str]:
        port, folder, caches = str(self.port), self.setup.folder, str(self.clients + 2)
        if self.engine == "mlxchat":
            return [sys.executable, "-m", "mlxchat.cli", "serve", "--model", str(folder), "--port", port,
                    "--served-model-name", self.model, "--store", str(self.work / "store.sqlite"),
                    "--caches", caches, "--max-cache-gb", str(CACHE_GB), "--max-spill-gb", "0",
                    "--max-queue", str(4 * self.clients + 8), *self.flags]
        if self.engine == "mlx-lm":
            blas = self.setup.blas_path
            preload = f"import ctypes; ctypes.CDLL({blas!r}, mode=ctypes.RTLD_GLOBAL); " if blas else ""
            return [sys.executable, "-c", f"{preload}import sys; from mlx_lm.server import main; sys.argv[0] = "
                    "'mlx_lm.server'; main()", "--model", str(float32_copy(folder, self.setup.work)), "--port", port,
                    "--decode-concurrency", str(self.clients + 1), "--prompt-concurrency", str(self.clients + 1),
                    "--prompt-cache-size", caches, "--prompt-cache-bytes", f"{CACHE_GB}GB", "--log-level", "WARNING"]
        from .gguf import convert

        cores = str(os.cpu_count() or 1)
        if self.engine == "llama-server":
            slots = self.clients + 1
            context = -(-(self.clients * self.setup.chat_tokens + self.setup.document_tokens) // 1024) * 1024
            return [str(llama_server()), "--model", str(convert(folder, "f32")), "--host", "127.0.0.1", "--port",
                    port, "--alias", self.model, "--threads", cores, "--threads-batch", cores, "--parallel",
                    str(slots), "--ctx-size", str(context), "--cont-batching", "--kv-unified", "--cache-ram",
                    str(CACHE_GB * 1024), "--no-webui"]
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(convert(folder, "f32")), "--port", port,
                "--model_alias", self.model, "--n_ctx", "16384", "--n_threads", cores, "--n_threads_batch", cores,
                "--cache", "true", "--cache_size", str(CACHE_GB * 10**9), "--interrupt_requests", "false",
                "--verbose", "false"]

    def _wait_ready(self, timeout: float = 900.0) -> None:
        import httpx

        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.engine} exited ({self.process.returncode}); see {self.log}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.engine} did not start within {timeout:.0f} s; see {self.log}")

    def peak_rss(self) -> int | None:
        """The server process's peak resident bytes so far, or when it was stopped (Linux's VmHWM; ``None``
        elsewhere)."""
        if self.process is None:
            return self.stopped_rss
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return None
        line = next((line for line in status.splitlines() if line.startswith("VmHWM:")), None)
        return None if line is None else int(line.split()[1]) * 1024

    def stop(self) -> None:
        if self.process is None:
            return
        self.stopped_rss = self.peak_rss()
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


def warm_up(server: Server) -> None:
    """One short request, unlike the workload's (no system prompt), so the engine has loaded the model and
    compiled its first steps before anything is timed."""
    import httpx

    with httpx.Client(timeout=900) as http:
        sample = stream(http, server, [{"role": "user", "content": "Hello"}], 2, Sample("warm-up", 0))
    if sample.error is not None:
        raise RuntimeError(f"{server.engine} failed its first request: {sample.error}; see {server.log}")


def float32_copy(folder: Path, work: Path) -> Path:
    """The checkpoint with float32 weights (for mlx-lm's server, which computes in the stored dtype)."""
    import mlx.core as mx

    target = work / "float32"
    if not (target / "config.json").exists():
        shutil.copytree(folder, target, ignore=shutil.ignore_patterns("*.safetensors"))
        for path in folder.glob("*.safetensors"):
            weights = mx.load(str(path))
            mx.save_safetensors(str(target / path.name), {name: w.astype(mx.float32) if mx.issubdtype(
                w.dtype, mx.floating) else w for name, w in weights.items()})  # type: ignore[union-attr]
    return target


def stream(http: Any, server: Server, messages: list[dict[str, str]], max_tokens: int, sample: Sample,
           stop: threading.Event | None = None) -> Sample:
    """Send one streamed chat request and time its pieces (``stop`` set: the row's time ran out, and the
    server was stopped under it)."""
    body = {"model": server.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    pieces: list[str] = []
    sample.sent = time.perf_counter()
    finished = False
    try:
        with http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                finished = finished or line == "data: [DONE]"
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                usage = chunk.get("usage")
                if usage:
                    sample.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    sample.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                    sample.generated_tokens = int(usage.get("completion_tokens") or 0)
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    piece = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                    if piece:
                        sample.stamps.append(time.perf_counter())
                        pieces.append(piece)
    except Exception as exc:  # noqa: BLE001 - counted and reported
        if stop is None or not stop.is_set():
            sample.error = f"{type(exc).__name__}: {exc}"
    # The row's stop ends a stream with an error or by closing it early: either way it did not finish.
    sample.cut = not finished and sample.error is None and stop is not None and stop.is_set()
    sample.text, sample.ended = "".join(pieces), time.perf_counter()
    return sample


def run_workload(server: Server, clients: int, turns: int, system: str, document: str | None,
                 max_tokens: int, limit: float | None = None) -> tuple[list[Sample], float]:
    """The chats (and, with a ``document``, the document client beside them); the samples and wall seconds.
    After ``limit`` seconds the server is stopped: no request is sent after that, and the running ones are
    cut."""
    import httpx

    samples: list[Sample] = []
    lock = threading.Lock()
    chats_done, stop = threading.Event(), threading.Event()

    def chat(index: int) -> None:
        messages = [{"role": "system", "content": system}]
        with httpx.Client(timeout=3600) as http:
            for turn in range(turns):
                if stop.is_set():
                    return
                messages.append({"role": "user", "content": f"Client {index}, question {turn}: what is "
                                                            f"{index + 3} times {turn + 2}?"})
                sample = stream(http, server, messages, max_tokens, Sample("chat", turn), stop)
                with lock:
                    samples.append(sample)
                messages.append({"role": "assistant", "content": sample.text or "(no reply)"})

    def documents() -> None:
        with httpx.Client(timeout=3600) as http:
            turn = 0
            while not stop.is_set() and (not chats_done.is_set() or turn == 0):
                messages = [{"role": "user", "content": f"Summarize this document ({turn}):\n\n{document}"}]
                sample = stream(http, server, messages, max_tokens, Sample("document", turn), stop)
                with lock:
                    samples.append(sample)
                turn += 1

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(clients)]
    if document is not None:
        threads.append(threading.Thread(target=documents))
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads[:clients]:
        thread.join(None if limit is None else max(0.0, started + limit - time.perf_counter()))
    ended = time.perf_counter()
    if any(thread.is_alive() for thread in threads[:clients]):
        stop.set()
        server.stop()
    chats_done.set()
    for thread in threads:
        thread.join()
    return samples, ended - started


def during_documents(samples: list[Sample]) -> tuple[list[float], list[float]]:
    """The chats' gaps between pieces that overlap a document's prefill (from its request to its first piece,
    or to its end when it streamed nothing), and the others (the chats' own step under the same load)."""
    windows = [(s.sent, s.stamps[0] if s.stamps else s.ended) for s in samples if s.kind == "document"]
    during: list[float] = []
    outside: list[float] = []
    for start, end in (gap for s in samples if s.kind == "chat" for gap in s.gaps):
        overlaps = any(start < until and end > since for since, until in windows)
        (during if overlaps else outside).append(end - start)
    return during, outside


def summary(samples: list[Sample], seconds: float, system_tokens: int) -> dict[str, Any]:
    """The row's figures; requests cut when its time ran out count by their pieces and gaps only."""
    ok = [s for s in samples if s.error is None]
    whole = [s for s in ok if not s.cut]
    chats = [s for s in whole if s.kind == "chat"]
    docs = [s for s in whole if s.kind == "document"]
    gaps = [end - start for s in ok if s.kind == "chat" for start, end in s.gaps]
    overlapping, outside = during_documents(ok)
    prompt = sum(s.prompt_tokens for s in whole)
    cached = sum(s.cached_tokens for s in whole)
    firsts = [s for s in chats if s.turn == 0]

    def ms(values: list[float], q: float) -> float:
        return round(1000 * percentile(values, q), 1)

    return {
        "requests": len(samples), "errors": [s.error for s in samples if s.error is not None],
        "cut": len(ok) - len(whole),
        "seconds": round(seconds, 2),
        "tokens_per_second": round(sum(s.tokens for s in ok) / seconds, 2) if seconds else 0.0,
        "chat_ttft_ms": {"p50": ms([s.ttft for s in chats], 0.5), "p99": ms([s.ttft for s in chats], 0.99)},
        "document_ttft_ms": {"p50": ms([s.ttft for s in docs], 0.5), "p99": ms([s.ttft for s in docs], 0.99)},
        "chat_itl_ms": {"p50": ms(gaps, 0.5), "p99": ms(gaps, 0.99)},
        "chat_itl_during_documents_ms": {"p50": ms(overlapping, 0.5), "p99": ms(overlapping, 0.99),
                                         "gaps": len(overlapping)},
        "chat_itl_outside_documents_ms": {"p50": ms(outside, 0.5), "p99": ms(outside, 0.99), "gaps": len(outside)},
        "documents": len(docs),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "generated_tokens": sum(s.generated_tokens for s in whole),
        "cached_share": round(cached / prompt, 3) if prompt else 0.0,
        "first_turn_cached": sorted(s.cached_tokens for s in firsts),
        "first_turn_system_share": sorted(round(min(1.0, s.cached_tokens / system_tokens), 3) for s in firsts)
        if system_tokens else [],
    }


def measure(engine: str, setup: Setup, clients: int, flags: Sequence[str], workload: dict[str, Any],
            documents: bool) -> dict[str, Any]:
    """One row: a fresh server of ``engine`` under the workload (with the document client or not)."""
    with Server(engine, setup, clients, flags) as server:
        before = scrape_counters(server.url, "chat.completions") if engine == "mlxchat" else None
        samples, seconds = run_workload(server, clients, workload["turns"], workload["system"],
                                        workload["document"] if documents else None, workload["max_tokens"],
                                        workload["limit"])
        result = summary(samples, seconds, workload["system_tokens"])
        result["peak_rss_bytes"] = server.peak_rss()
        if before is not None and server.process is not None:
            ok = [s for s in samples if s.error is None]
            seen = {"requests": len(samples), "prompt_tokens": sum(s.prompt_tokens for s in ok),
                    "cached_tokens": sum(s.cached_tokens for s in ok),
                    "generated_tokens": sum(s.generated_tokens for s in ok)}
            result["metrics"] = counters_check(before, scrape_counters(server.url, "chat.completions"), seen)
    return result


SETTINGS = {"b": "--prefill-step-budget", "s": "--max-decode-slowdown"}
"""mlxchat's settings a row may set, by the short name its label gives them."""


def variants(budgets: Sequence[int | None], slowdowns: Sequence[float | None]) -> list[dict[str, float]]:
    """mlxchat's rows: every budget with every slowdown (``None``: the server's default, left out of the row)."""
    return [{name: value for name, value in (("b", budget), ("s", slowdown)) if value is not None}
            for budget in budgets for slowdown in slowdowns]


def flags_of(settings: dict[str, float]) -> list[str]:
    return [part for name, value in settings.items() for part in (SETTINGS[name], f"{value:g}")]


def label(engine: str, settings: dict[str, float]) -> str:
    return " ".join([engine, *(f"{name}={value:g}" for name, value in settings.items())])


def goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals, from the rows (see the module docstring)."""
    solo = {row["engine"]: row["result"]["chat_itl_ms"]["p50"] for row in rows if row["solo"] and "result" in row}
    measured = [row for row in rows if not row["solo"] and "result" in row]
    eight = {row["label"]: row["result"] for row in measured if row["clients"] == GOAL_CLIENTS}
    itl = []
    for row in measured:
        if row["engine"] != "mlxchat":
            continue
        during, step = row["result"]["chat_itl_during_documents_ms"], solo.get(row["engine"])
        ratio = round(during["p99"] / step, 2) if step and during["gaps"] else None
        itl.append({"label": row["label"], "clients": row["clients"], "solo_step_ms": step,
                    "itl_p99_during_documents_ms": during["p99"], "ratio": ratio,
                    "met": ratio is not None and ratio <= GOAL_ITL_RATIO})
    shared, throughput = [], []
    for name, result in eight.items():
        if not name.startswith("mlxchat"):
            continue
        enough = sum(share >= GOAL_CACHED_SHARE for share in result["first_turn_system_share"])
        shared.append({"label": name, "shares": result["first_turn_system_share"], "chats_at_goal": enough,
                       "met": enough >= GOAL_CACHED_CHATS})
        for other, at_least in GOAL_VS.items():
            theirs = eight[other]["tokens_per_second"] if other in eight else None
            ratio = round(result["tokens_per_second"] / theirs, 2) if theirs else None
            throughput.append({"label": name, "against": other, "ratio": ratio, "goal": at_least, "theirs": theirs,
                               "met": ratio >= at_least if ratio is not None else theirs == 0.0})
    return {"solo_step_ms": solo, "itl_during_documents": itl, "shared_prefix_at_8": shared,
            "throughput_at_8": throughput}


def llama_server() -> Path | None:
    """llama.cpp's ``llama-server``: ``LLAMA_SERVER``, else where ``build_llama_cpp.sh`` puts it, else on PATH."""
    from .gguf import llama_cpp_dirs

    candidates = [os.environ.get("LLAMA_SERVER"), *(str(d / "bin" / "llama-server") for d in llama_cpp_dirs()),
                  shutil.which("llama-server")]
    return next((Path(c) for c in candidates if c and os.access(c, os.X_OK)), None)


def available(engine: str) -> str | None:
    """Why ``engine`` cannot run here (``None``: it can)."""
    import importlib.util

    if engine == "mlx-lm" and importlib.util.find_spec("mlx_lm") is None:
        return "mlx-lm is not installed (pip install -e '.[bench]')"
    if engine == "llama.cpp":
        from . import gguf

        if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llama_cpp.server") is None:
            return "llama-cpp-python[server] is not installed (benchmarks/build_llama_cpp.sh)"
        return gguf.available()
    if engine == "llama-server":
        from . import gguf

        if llama_server() is None:
            return "llama-server not found (LLAMA_CPP_PARTS=server benchmarks/build_llama_cpp.sh, or LLAMA_SERVER)"
        if gguf.converter() is None:
            return "llama.cpp's convert_hf_to_gguf.py not found (benchmarks/build_llama_cpp.sh, or LLAMA_CPP_DIR)"
    return None


def markdown(results: dict[str, Any]) -> str:
    setup = results["setup"]
    lines = [f"# Serving under a mixed workload ({results['when']}, {results['host']['cpu']}, "
             f"{results['host']['cores']} cores{', quick smoke run' if setup['quick'] else ''})", "",
             f"Checkpoint `{setup['model']}`; chats of {setup['turns']} turns sharing a {setup['system_tokens']}-token "
             f"system prompt, plus one client sending {setup['document_tokens']}-token documents; greedy, "
             f"{setup['max_tokens']} tokens at most a reply. `solo`: one chat alone, no documents (its median "
             "gap is the engine's solo step). ITL during documents: the chats' gaps that overlap a document's "
             "prefill (its request to its first token)." + (
                 f" Each row stopped after {setup['row_minutes']:g} minutes: tok/s over that time, requests still "
                 "running then counted by their pieces and gaps only." if setup.get("row_minutes") else ""), "",
             "| engine | clients | tok/s | chat TTFT p50 / p99 ms | chat ITL p50 / p99 ms | ITL p99 during documents "
             "ms (x solo step; x chats' p50 outside documents) | document TTFT p50 / p99 ms | cached share | "
             "first turns' share of the system prompt cached | /metrics = clients | server's peak RSS GB | errors |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    solo = results["goals"]["solo_step_ms"]
    for row in results["rows"]:
        clients = "solo" if row.get("solo") else row["clients"]
        if "result" not in row:
            lines.append(f"| {row['label']} | {clients} | failed: {row['error'][:200]} | | | | | | | | | |")
            continue
        r = row["result"]
        during = r["chat_itl_during_documents_ms"]
        step = solo.get(row["engine"])
        times = f" ({during['p99'] / step:.1f}x" if step and during["gaps"] else ""
        outside = r.get("chat_itl_outside_documents_ms", {})
        if times and outside.get("gaps"):
            times += f"; {during['p99'] / outside['p50']:.1f}x of {outside['p50']}"
        times += ")" if times else ""
        shares = ", ".join(f"{s:.0%}" for s in r["first_turn_system_share"]) or "—"
        rss = "—" if r.get("peak_rss_bytes") is None else f"{r['peak_rss_bytes'] / 1e9:.2f}"
        cut = f" ({r['cut']} cut at {setup['row_minutes']:g} min)" if r.get("cut") else ""
        metrics = ("—" if "metrics" not in r else "yes" if r["metrics"]["equal"] else
                   f"no: {json.dumps(r['metrics']['server'])} vs {json.dumps(r['metrics']['clients'])}")
        lines.append(f"| {row['label']} | {clients} | {r['tokens_per_second']} | {r['chat_ttft_ms']['p50']} / "
                     f"{r['chat_ttft_ms']['p99']} | {r['chat_itl_ms']['p50']} / {r['chat_itl_ms']['p99']} | "
                     f"{during['p99'] if during['gaps'] else '—'}{times} | "
                     f"{r['document_ttft_ms']['p50']} / {r['document_ttft_ms']['p99']} | {r['cached_share']:.0%} | "
                     f"{shares} | {metrics} | {rss} | {len(r['errors'])}{cut} |")
    for engine, why in results["skipped"].items():
        lines.append(f"\nSkipped {engine}: {why}.")
    lines += ["", "## Goals (issue 25)", ""]
    g = results["goals"]

    def mark(item: dict[str, Any]) -> str:
        return "met" if item["met"] else "not measured" if item["ratio"] is None else "NOT met"

    for item in g["itl_during_documents"]:
        ratio = "(no gap overlapped a document)" if item["ratio"] is None else f"{item['ratio']}x"
        lines.append(f"- {item['label']}, {item['clients']} clients: chat ITL p99 while a document is prefilled "
                     f"{item['itl_p99_during_documents_ms']} ms = {ratio} the solo step of {item['solo_step_ms']} ms "
                     f"(goal <= {GOAL_ITL_RATIO:g}x): {mark(item)}")
    for item in g["shared_prefix_at_8"]:
        lines.append(f"- {item['label']}: {item['chats_at_goal']} of {GOAL_CLIENTS} first turns found >= "
                     f"{GOAL_CACHED_SHARE:.0%} of the shared system prompt cached (goal {GOAL_CACHED_CHATS}): "
                     f"{'met' if item['met'] else 'NOT met'}")
    for item in g["throughput_at_8"]:
        ratio = (f"{item['ratio']}x" if item["ratio"] is not None else "(no row of it)" if item.get("theirs") is None
                 else "any multiple of (no token streamed in the row's time)")
        lines.append(f"- {item['label']} at {GOAL_CLIENTS} clients: {ratio} {item['against']}'s tok/s "
                     f"(goal >= {item['goal']}x): {mark(item)}")
    if not g["shared_prefix_at_8"]:
        lines.append(f"- The {GOAL_CLIENTS}-client goals need an mlxchat row at {GOAL_CLIENTS} clients "
                     f"(--clients ...,{GOAL_CLIENTS}).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", help="a benchmark checkpoint key or a folder")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--clients", default="1,4,8,16")
    parser.add_argument("--budgets", default="", help="mlxchat's --prefill-step-budget values to run (a row each; "
                                                      "default: its default only)")
    parser.add_argument("--slowdowns", default="", help="mlxchat's --max-decode-slowdown values to run (0: off; a "
                                                        "row each, with each budget; default: its default only)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--document-tokens", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--row-minutes", type=float, help="stop each row's workload after this long (its running "
                                                          "requests are cut; tok/s over that window)")
    parser.add_argument("--quick", action="store_true", help="smoke test: the demo model, tiny sizes")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        from mlxchat.demo import default_model_path

        folder, args.turns = default_model_path(), 2
        args.system_tokens, args.document_tokens, args.max_tokens = 64, 128, 8
    else:
        from .checkpoints import MODELS, build, folder_of, is_built

        folder = Path(args.model)
        if not folder.exists():
            if args.model not in MODELS:
                parser.error(f"--model: neither a folder nor a benchmark checkpoint ({', '.join(MODELS)})")
            folder = folder_of(args.model) if is_built(args.model) else build(MODELS[args.model])
    out = args.out or RESULTS / ("quick.serve.json" if args.quick else "serve.json")
    try:
        counts = [int(c) for c in args.clients.split(",") if c]
        budgets: list[int | None] = [int(b) for b in args.budgets.split(",") if b] or [None]
        slowdowns: list[float | None] = [float(x) for x in args.slowdowns.split(",") if x] or [None]
    except ValueError:
        parser.error("--clients and --budgets take comma-separated whole numbers, --slowdowns numbers")
    if not counts or min(counts) < 1 or any(b is not None and b < 1 for b in budgets):
        parser.error("--clients and --budgets must be at least 1")
    if any(x is not None and x != 0 and not x > 1 for x in slowdowns):
        parser.error("--slowdowns must be 0 (off) or above 1")
    if args.row_minutes is not None and not args.row_minutes > 0:
        parser.error("--row-minutes must be above 0")

    from tokenizers import Tokenizer

    from mlxchat.runtime import runtime_info

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    system, document = text_of(args.system_tokens, tokenizer, 1), text_of(args.document_tokens, tokenizer, 2)
    workload = {"turns": args.turns, "system": system, "document": document, "max_tokens": args.max_tokens,
                "system_tokens": len(tokenizer.encode(system).ids),
                "limit": None if args.row_minutes is None else 60 * args.row_minutes}
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engines {', '.join(unknown)}; known: {', '.join(ENGINES)}")
    skipped = {e: why for e in engines if (why := available(e)) is not None}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mlxchat-serve-bench-") as work:
        chat_tokens = workload["system_tokens"] + args.turns * (args.max_tokens + 64) + 256
        setup = Setup(folder, Path(work), runtime_info().get("blas_path"), chat_tokens,
                      args.document_tokens + args.max_tokens + 256)
        for engine in [e for e in engines if e not in skipped]:
            rows_of = variants(budgets, slowdowns) if engine == "mlxchat" else [{}]
            plan: list[tuple[int, dict[str, float], bool]] = [(1, {}, False)]
            plan += [(clients, settings, True) for settings in rows_of for clients in counts]
            for clients, settings, documents in plan:
                row: dict[str, Any] = {"engine": engine, "label": label(engine, settings), **settings,
                                       "clients": clients, "solo": not documents}
                try:
                    row["result"] = measure(engine, setup, clients, flags_of(settings), workload, documents)
                except Exception as exc:  # noqa: BLE001 - one engine's failure is a row; the run goes on
                    row["error"] = f"{type(exc).__name__}: {exc}"
                rows.append(row)
                print(f"{row['label']}, {'solo' if row['solo'] else f'{clients} clients'}: "
                      f"{json.dumps(row.get('result', row.get('error')))}", flush=True)
    results = {"when": time.strftime("%Y-%m-%d %H:%M"), "host": describe(),
               "setup": {"model": str(args.model if not args.quick else "demo"), "turns": args.turns,
                         "system_tokens": workload["system_tokens"], "document_tokens": args.document_tokens,
                         "max_tokens": args.max_tokens, "row_minutes": args.row_minutes, "quick": args.quick},
               "rows": rows, "skipped": skipped}
    results["goals"] = goals(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
