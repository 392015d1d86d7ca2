"""``python -m benchmarks.load``: many clients against ``mlxchat serve`` on the demo model.

Each of ``--clients`` threads holds its own conversation of ``--requests`` chat.completions requests
(capitals, arithmetic, and weather questions answered through the demo's tool, so tool results are
requests too), each request carrying the whole conversation, greedy. Then every request is sent again,
alone, one at a time: each reply must equal the one it got under load. Reported: errors, mismatches,
latency percentiles, the share of prompt tokens served from cache, and the idle cache pool's bytes
against its bound. Results go to ``benchmarks/results/load.json`` (and ``.md``).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from .host import describe

RESULTS = Path(__file__).resolve().parent / "results"
COUNTRIES = ("France", "Italy", "Spain", "Japan", "Kenya", "Peru", "Canada", "Norway", "Egypt", "Chile")
CITIES = ("Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Madrid", "Nairobi")


def question(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return f"What is the capital of {rng.choice(COUNTRIES)}?"
    if kind == 1:
        return f"What is {rng.randrange(10, 60)} plus {rng.randrange(10, 40)}?"
    return f"What's the weather in {rng.choice(CITIES)}?"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class Client:
    """One conversation: each request adds the last reply and either the tool results it asked for or
    a new question."""

    def __init__(self, index: int, url: str, requests: int, max_tokens: int):
        from mlxchat.demo.world import DEMO_TOOLS

        self.rng = random.Random(index)
        self.url, self.requests, self.max_tokens = url, requests, max_tokens
        self.tools = {t.name: t for t in DEMO_TOOLS}
        self.schemas = [t.schema for t in DEMO_TOOLS]
        self.messages: list[dict[str, Any]] = []
        self.sent: list[dict[str, Any]] = []
        self.replies: list[dict[str, Any] | None] = []
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.prompt_tokens = self.cached_tokens = 0

    def body(self) -> dict[str, Any]:
        return {"model": "demo", "messages": list(self.messages), "tools": self.schemas, "temperature": 0,
                "max_tokens": self.max_tokens}

    def run(self) -> None:
        import httpx

        with httpx.Client(timeout=600) as http:
            for _ in range(self.requests):
                if not self.messages or self.messages[-1]["role"] == "assistant":
                    self.messages.append({"role": "user", "content": question(self.rng)})
                body = self.body()
                started = time.monotonic()
                try:
                    response = http.post(f"{self.url}/v1/chat/completions", json=body)
                    response.raise_for_status()
                    data = response.json()
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    self.replies.append(None)
                    self.sent.append(body)
                    self.messages = []
                    continue
                self.latencies.append(time.monotonic() - started)
                self.sent.append(body)
                message = data["choices"][0]["message"]
                self.replies.append(message)
                self.prompt_tokens += data["usage"]["prompt_tokens"]
                self.cached_tokens += data["usage"]["prompt_tokens_details"]["cached_tokens"]
                self.messages.append({k: v for k, v in message.items() if v is not None})
                for call in message.get("tool_calls") or []:
                    tool = self.tools.get(call["function"]["name"])
                    arguments = json.loads(call["function"]["arguments"])
                    result = tool(**arguments) if tool else "unknown tool"
                    self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=10, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--caches", type=int, default=4)
    parser.add_argument("--max-cache-gb", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=RESULTS / "load.json")
    args = parser.parse_args(argv)

    import uvicorn

    import mlxchat
    from mlxchat.server import create_app

    model = mlxchat.load_model()
    app = create_app(model, model_name="demo", caches=args.caches, max_cache_gb=args.max_cache_gb,
                     max_queue=max(64, args.clients + 1), max_connections=max(128, 2 * args.clients))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    pool = app.state.mlxchat.pool

    clients = [Client(i, url, args.requests, args.max_tokens) for i in range(args.clients)]
    threads = [threading.Thread(target=c.run) for c in clients]
    started = time.monotonic()
    peak_pool = 0
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak_pool = max(peak_pool, pool.nbytes)
        time.sleep(0.05)
    load_seconds = time.monotonic() - started

    import httpx

    mismatches = []
    with httpx.Client(timeout=600) as http:
        for c in clients:
            for body, reply in zip(c.sent, c.replies, strict=True):
                if reply is None:
                    continue
                alone = http.post(f"{url}/v1/chat/completions", json=body).json()["choices"][0]["message"]
                if alone != reply:
                    mismatches.append({"request": body["messages"][-1], "load": reply, "alone": alone})
    server.should_exit = True
    thread.join()

    latencies = [x for c in clients for x in c.latencies]
    prompt = sum(c.prompt_tokens for c in clients)
    cached = sum(c.cached_tokens for c in clients)
    results = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "host": describe(),
        "clients": args.clients,
        "requests_per_client": args.requests,
        "requests": len(latencies) + sum(len(c.errors) for c in clients),
        "errors": [e for c in clients for e in c.errors],
        "mismatches": mismatches,
        "seconds": round(load_seconds, 2),
        "requests_per_second": round(len(latencies) / load_seconds, 2),
        "latency_s": {"p50": round(percentile(latencies, 0.5), 3), "p90": round(percentile(latencies, 0.9), 3),
                      "p99": round(percentile(latencies, 0.99), 3),
                      "mean": round(statistics.fmean(latencies), 3) if latencies else 0.0},
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "cached_share": round(cached / prompt, 3) if prompt else 0.0,
        "pool": {"caches": args.caches, "max_bytes": int(args.max_cache_gb * 1e9), "peak_bytes": peak_pool,
                 "end_bytes": pool.nbytes, "end_caches": len(pool)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return results


def markdown(r: dict[str, Any]) -> str:
    latency = r["latency_s"]
    pool = r["pool"]
    return (
        f"# Load test ({r['when']}, {r['host']['cpu']}, {r['host']['cores']} cores)\n\n"
        f"{r['clients']} clients x {r['requests_per_client']} chat.completions requests on the demo model, greedy, "
        f"each request carrying its whole conversation (tool results included).\n\n"
        "| requests | errors | mismatches vs alone | req/s | p50 s | p90 s | p99 s | cached prompt share | "
        "pool peak / bound |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
        f"| {r['requests']} | {len(r['errors'])} | {len(r['mismatches'])} | {r['requests_per_second']} | "
        f"{latency['p50']} | {latency['p90']} | {latency['p99']} | {r['cached_share']:.0%} | "
        f"{pool['peak_bytes'] / 1e6:.1f} MB / {pool['max_bytes'] / 1e6:.0f} MB ({pool['caches']} caches) |\n"
    )


if __name__ == "__main__":
    main()
