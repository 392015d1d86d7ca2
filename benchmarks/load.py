"""``python -m benchmarks.load``: many clients against ``mlxchat serve`` on the demo model.

Each of ``--clients`` threads holds its own conversation of ``--requests`` requests (capitals, arithmetic,
and weather questions answered through the demo's tool, so tool results are requests too), greedy, on one
API (``--api``): ``chat`` sends each request with the whole conversation to ``/v1/chat/completions``;
``responses`` sends only the new input to ``/v1/responses``, continuing the previous response by
``previous_response_id``. Then every request is sent again, alone, one at a time (for ``responses`` with
``store: false``, so the chain stays as it was): each reply must equal the one it got under load. Reported:
errors, mismatches, latency percentiles, the share of prompt tokens served from cache, the idle cache
pool's bytes against its bound, and whether the server's ``/metrics`` counters, scraped before and after the
load, grew by what the clients saw (requests, prompt, cached and generated tokens). Results go to
``benchmarks/results/load.json`` (and ``.md``; ``load-responses.*`` for the Responses API).
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


COUNTERS = {"requests": "mlxchat_requests_total", "prompt_tokens": "mlxchat_prompt_tokens_total",
            "cached_tokens": "mlxchat_cached_prompt_tokens_total", "generated_tokens": "mlxchat_generated_tokens_total"}


def scrape_counters(url: str, endpoint: str) -> dict[str, float]:
    """An mlxchat server's counters of one endpoint (requests of every status), read from ``GET /metrics``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    page = httpx.get(f"{url}/metrics", timeout=60)
    page.raise_for_status()
    counts = dict.fromkeys(COUNTERS, 0.0)
    names = {metric: key for key, metric in COUNTERS.items()}
    for family in text_string_to_metric_families(page.text):
        for sample in family.samples:
            if sample.name in names and sample.labels.get("endpoint") == endpoint:
                counts[names[sample.name]] += sample.value
    return counts


def counters_check(before: dict[str, float], after: dict[str, float], seen: dict[str, int]) -> dict[str, Any]:
    """How much the server's counters grew against what the clients saw, and whether they are equal."""
    server = {key: int(after[key] - before[key]) for key in COUNTERS}
    return {"server": server, "clients": seen, "equal": server == seen}


class Client:
    """One conversation: each request adds the last reply and either the tool results it asked for or a new
    question. Subclasses say how a request is written and a reply read."""

    path = ""

    def __init__(self, index: int, url: str, requests: int, max_tokens: int):
        from mlxchat.demo.world import DEMO_TOOLS

        self.rng = random.Random(index)
        self.url, self.requests, self.max_tokens = url, requests, max_tokens
        self.tools = {t.name: t for t in DEMO_TOOLS}
        self.sent: list[dict[str, Any]] = []
        self.replies: list[Any] = []
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.prompt_tokens = self.cached_tokens = self.generated_tokens = 0

    def run(self) -> None:
        import httpx

        with httpx.Client(timeout=600) as http:
            for _ in range(self.requests):
                body = self.body()
                started = time.monotonic()
                try:
                    response = http.post(f"{self.url}{self.path}", json=body)
                    response.raise_for_status()
                    data = response.json()
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    answer = getattr(exc, "response", None)  # an HTTP error: what the server said, too
                    said = f" ({answer.text[:300]})" if answer is not None else ""
                    self.errors.append(f"{type(exc).__name__}: {exc}{said}")
                    self.replies.append(None)
                    self.sent.append(body)
                    self.restart()
                    continue
                self.latencies.append(time.monotonic() - started)
                self.sent.append(body)
                self.replies.append(self.reply(data))
                self.prompt_tokens += self.prompt_of(data)
                self.cached_tokens += self.cached_of(data)
                self.generated_tokens += self.generated_of(data)
                self.record(data)

    def call(self, name: str, arguments: str) -> str:
        tool = self.tools.get(name)
        return tool(**json.loads(arguments)) if tool else "unknown tool"

    def alone(self, body: dict[str, Any]) -> dict[str, Any]:
        """The request to send again alone."""
        return body

    def body(self) -> dict[str, Any]:
        raise NotImplementedError

    def reply(self, data: dict[str, Any]) -> Any:
        raise NotImplementedError

    def prompt_of(self, data: dict[str, Any]) -> int:
        raise NotImplementedError

    def cached_of(self, data: dict[str, Any]) -> int:
        raise NotImplementedError

    def generated_of(self, data: dict[str, Any]) -> int:
        raise NotImplementedError

    def record(self, data: dict[str, Any]) -> None:
        raise NotImplementedError

    def restart(self) -> None:
        raise NotImplementedError


class ChatClient(Client):
    """chat.completions: every request carries the whole conversation."""

    path = "/v1/chat/completions"

    def __init__(self, index: int, url: str, requests: int, max_tokens: int):
        super().__init__(index, url, requests, max_tokens)
        self.messages: list[dict[str, Any]] = []

    def body(self) -> dict[str, Any]:
        if not self.messages or self.messages[-1]["role"] == "assistant":
            self.messages.append({"role": "user", "content": question(self.rng)})
        return {"model": "demo", "messages": list(self.messages), "tools": [t.schema for t in self.tools.values()],
                "temperature": 0, "max_tokens": self.max_tokens}

    def reply(self, data: dict[str, Any]) -> Any:
        return data["choices"][0]["message"]

    def prompt_of(self, data: dict[str, Any]) -> int:
        return int(data["usage"]["prompt_tokens"])

    def cached_of(self, data: dict[str, Any]) -> int:
        return int(data["usage"]["prompt_tokens_details"]["cached_tokens"])

    def generated_of(self, data: dict[str, Any]) -> int:
        return int(data["usage"]["completion_tokens"])

    def record(self, data: dict[str, Any]) -> None:
        message = self.reply(data)
        self.messages.append({k: v for k, v in message.items() if v is not None})
        for call in message.get("tool_calls") or []:
            self.messages.append({"role": "tool", "tool_call_id": call["id"],
                                  "content": self.call(call["function"]["name"], call["function"]["arguments"])})

    def restart(self) -> None:
        self.messages = []


class ResponsesClient(Client):
    """Responses: each request sends the new input and continues the previous response."""

    path = "/v1/responses"

    def __init__(self, index: int, url: str, requests: int, max_tokens: int):
        super().__init__(index, url, requests, max_tokens)
        self.previous: str | None = None
        self.pending: list[dict[str, Any]] = []

    def body(self) -> dict[str, Any]:
        items = self.pending or [{"role": "user", "content": question(self.rng)}]
        tools = [{"type": "function", "name": t.name, "description": t.description,
                  "parameters": t.schema["function"]["parameters"]} for t in self.tools.values()]
        return {"model": "demo", "input": items, "previous_response_id": self.previous, "tools": tools,
                "temperature": 0, "max_output_tokens": self.max_tokens}

    def alone(self, body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "store": False}

    def reply(self, data: dict[str, Any]) -> Any:
        """The output without its item ids (new on every response)."""
        return [{k: v for k, v in item.items() if k != "id"} for item in data["output"]]

    def prompt_of(self, data: dict[str, Any]) -> int:
        return int(data["usage"]["input_tokens"])

    def cached_of(self, data: dict[str, Any]) -> int:
        return int(data["usage"]["input_tokens_details"]["cached_tokens"])

    def generated_of(self, data: dict[str, Any]) -> int:
        return int(data["usage"]["output_tokens"])

    def record(self, data: dict[str, Any]) -> None:
        self.previous = data["id"]
        self.pending = [{"type": "function_call_output", "call_id": item["call_id"],
                         "output": self.call(item["name"], item["arguments"])}
                        for item in data["output"] if item["type"] == "function_call"]

    def restart(self) -> None:
        self.previous, self.pending = None, []


CLIENTS: dict[str, type[Client]] = {"chat": ChatClient, "responses": ResponsesClient}
ENDPOINTS = {"chat": "chat.completions", "responses": "responses"}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.split("\n")[0])
    parser.add_argument("--api", choices=sorted(CLIENTS), default="chat")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=10, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--caches", type=int, default=4)
    parser.add_argument("--max-cache-gb", type=float, default=0.05)
    parser.add_argument("--out", type=Path, help="results file (default: results/load.json, or "
                                                  "load-responses.json for --api responses)")
    args = parser.parse_args(argv)
    args.out = args.out or RESULTS / ("load.json" if args.api == "chat" else f"load-{args.api}.json")

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

    clients = [CLIENTS[args.api](i, url, args.requests, args.max_tokens) for i in range(args.clients)]
    threads = [threading.Thread(target=c.run) for c in clients]
    before = scrape_counters(url, ENDPOINTS[args.api])
    started = time.monotonic()
    peak_pool = 0
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak_pool = max(peak_pool, pool.nbytes)
        time.sleep(0.05)
    load_seconds = time.monotonic() - started
    seen = {"requests": sum(c.requests for c in clients), "prompt_tokens": sum(c.prompt_tokens for c in clients),
            "cached_tokens": sum(c.cached_tokens for c in clients),
            "generated_tokens": sum(c.generated_tokens for c in clients)}
    metrics = counters_check(before, scrape_counters(url, ENDPOINTS[args.api]), seen)

    import httpx

    mismatches = []
    with httpx.Client(timeout=600) as http:
        for c in clients:
            for body, reply in zip(c.sent, c.replies, strict=True):
                if reply is None:
                    continue
                alone = c.reply(http.post(f"{url}{c.path}", json=c.alone(body)).json())
                if alone != reply:
                    mismatches.append({"request": body, "load": reply, "alone": alone})
    server.should_exit = True
    thread.join()

    latencies = [x for c in clients for x in c.latencies]
    prompt = sum(c.prompt_tokens for c in clients)
    cached = sum(c.cached_tokens for c in clients)
    results = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "host": describe(),
        "api": args.api,
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
        "metrics": metrics,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return results


API_NAMES = {"chat": "chat.completions", "responses": "Responses"}
API_WAYS = {"chat": "each request carrying its whole conversation",
            "responses": "each request sending its new input with previous_response_id"}


def markdown(r: dict[str, Any]) -> str:
    latency = r["latency_s"]
    pool = r["pool"]
    return (
        f"# Load test ({r['when']}, {r['host']['cpu']}, {r['host']['cores']} cores)\n\n"
        f"{r['clients']} clients x {r['requests_per_client']} {API_NAMES[r.get('api', 'chat')]} requests on the demo "
        f"model, greedy, {API_WAYS[r.get('api', 'chat')]} (tool results included).\n\n"
        "| requests | errors | mismatches vs alone | req/s | p50 s | p90 s | p99 s | cached prompt share | "
        "pool peak / bound | /metrics = clients |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
        f"| {r['requests']} | {len(r['errors'])} | {len(r['mismatches'])} | {r['requests_per_second']} | "
        f"{latency['p50']} | {latency['p90']} | {latency['p99']} | {r['cached_share']:.0%} | "
        f"{pool['peak_bytes'] / 1e6:.1f} MB / {pool['max_bytes'] / 1e6:.0f} MB ({pool['caches']} caches) | "
        f"{metrics_cell(r)} |\n"
    )


def metrics_cell(r: dict[str, Any]) -> str:
    if "metrics" not in r:  # a result from before the counters were checked
        return "—"
    check = r["metrics"]
    return "yes" if check["equal"] else f"no: {json.dumps(check['server'])} vs {json.dumps(check['clients'])}"


if __name__ == "__main__":
    main()
