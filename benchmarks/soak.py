"""``python -m benchmarks.soak``: mixed traffic through the server's three APIs for ``--minutes`` (default 20)
against ``mlxchat serve`` on the demo model, and image traffic against a second server on a tiny vision
checkpoint (``--vision-model``, by default the Qwen3.5-VL test fixture: the demo model reads no images),
each run as its own process so that what is sampled is the servers'.

Each of ``--clients`` threads picks, request after request: a conversation of a few turns on
chat.completions or on the Responses API (capitals, arithmetic and weather questions, the weather answered
through the demo's tool, so tool calls and their results are requests too; :mod:`benchmarks.load`'s
clients), a long prompt (a few thousand characters of context, then a question) on Anthropic's
``/v1/messages``, a stream left early (a streamed request closed after its first events), or a
conversation about images on one of the three APIs (each turn a picture, new or the last one again, and a
question). Every few seconds each server's resident memory, open files (regular files: the store, spilled
caches), all file descriptors (with the connections in flight: reported, not held to the bar) and threads
are sampled. Then every non-streamed request is sent again, alone (Responses with ``store: false``, so
chains stay as they were): each reply must equal the one it got under load.

Reported (``--out``, default ``benchmarks/results/soak.json`` and ``.md``): requests by kind, errors, replies
that differ from the same request alone, and each sample's growth over the second half of the run for each
server (the median of the last tenth against the median around the half-way mark). The bar: 0 errors, 0
differing replies, growth within 5%. The exit status is 1 when the bar is missed. A 20-minute run says
something only on a quiet machine.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .host import describe
from .load import ChatClient, Client, ResponsesClient, question

RESULTS = Path(__file__).resolve().parent / "results"
VISION = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen3_5_vl"
CONTEXT = ("The archive holds letters from a lighthouse keeper who wrote every evening about the weather, "
           "the ships that passed, and the birds that rested on the gallery rail. ")
GROWTH_BAR = 0.05


class MessagesClient(Client):
    """Anthropic Messages: one long prompt (context, then a question) per request."""

    path = "/v1/messages"

    def body(self) -> dict[str, Any]:
        context = CONTEXT * self.rng.randrange(10, 30)
        return {"model": "demo", "max_tokens": self.max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"{context}\n\n{question(self.rng)}"}]}

    def reply(self, data: dict[str, Any]) -> Any:
        return data["content"]

    def prompt_of(self, data: dict[str, Any]) -> int:
        return int(data["usage"]["input_tokens"])

    def cached_of(self, data: dict[str, Any]) -> int:
        return int(data["usage"].get("cache_read_input_tokens") or 0)

    def generated_of(self, data: dict[str, Any]) -> int:
        return int(data["usage"]["output_tokens"])

    def record(self, data: dict[str, Any]) -> None:
        pass

    def restart(self) -> None:
        pass


def picture(rng: random.Random) -> str:
    """A small PNG as a data URL: a few colored blocks, of a random size (the processor rescales it)."""
    from PIL import Image

    width, height = rng.randrange(16, 97, 8), rng.randrange(16, 97, 8)
    image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    for _ in range(rng.randrange(1, 5)):
        x, y = rng.randrange(width), rng.randrange(height)
        image.paste(tuple(rng.randrange(256) for _ in range(3)), (x, y, min(width, x + 8), min(height, y + 8)))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


class ImageClient(Client):
    """A conversation about pictures on the vision server, on one API: each turn sends a picture (a new one,
    or the last one again, which the server's cache reuses by its pixels) and a question."""

    PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
    QUESTIONS = ("What is in the picture?", "Which colors do you see?", "Describe it in one sentence.")

    def __init__(self, index: int, url: str, requests: int, max_tokens: int, api: str):
        super().__init__(index, url, requests, max_tokens)
        self.api, self.path = api, self.PATHS[api]
        self.messages: list[dict[str, Any]] = []  # chat and messages: the conversation so far
        self.asked: dict[str, Any] = {}
        self.previous: str | None = None  # responses: the response to continue
        self.image = ""

    def body(self) -> dict[str, Any]:
        if not self.image or self.rng.random() < 0.5:
            self.image = picture(self.rng)
        text = self.rng.choice(self.QUESTIONS)
        if self.api == "responses":
            self.asked = {"role": "user", "content": [{"type": "input_image", "image_url": self.image},
                                                      {"type": "input_text", "text": text}]}
            return {"model": "vision", "input": [self.asked], "previous_response_id": self.previous,
                    "temperature": 0, "max_output_tokens": self.max_tokens}
        if self.api == "chat":
            image = {"type": "image_url", "image_url": {"url": self.image}}
        else:
            media, data = self.image.removeprefix("data:").split(";base64,")
            image = {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
        self.asked = {"role": "user", "content": [image, {"type": "text", "text": text}]}
        return {"model": "vision", "messages": [*self.messages, self.asked], "temperature": 0,
                "max_tokens": self.max_tokens}

    def alone(self, body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "store": False} if self.api == "responses" else body

    def reply(self, data: dict[str, Any]) -> Any:
        if self.api == "chat":
            return data["choices"][0]["message"]
        if self.api == "responses":
            return [{k: v for k, v in item.items() if k != "id"} for item in data["output"]]
        return data["content"]

    def prompt_of(self, data: dict[str, Any]) -> int:
        usage = data["usage"]
        return int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0)

    def cached_of(self, data: dict[str, Any]) -> int:
        return 0

    def generated_of(self, data: dict[str, Any]) -> int:
        usage = data["usage"]
        return int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)

    def record(self, data: dict[str, Any]) -> None:
        if self.api == "responses":
            self.previous = data["id"]
        elif self.api == "chat":
            message = self.reply(data)
            self.messages += [self.asked, {"role": "assistant", "content": message["content"] or ""}]
        else:
            text = "".join(block.get("text", "") for block in data["content"])
            self.messages += [self.asked, {"role": "assistant", "content": text or "..."}]

    def restart(self) -> None:
        self.messages, self.previous = [], None


def leave_a_stream_early(url: str, rng: random.Random, max_tokens: int) -> None:
    """A streamed request on one of the three APIs, closed after its first few events."""
    import httpx

    user = [{"role": "user", "content": question(rng)}]
    path, body = rng.choice([
        ("/v1/chat/completions", {"model": "demo", "messages": user, "max_tokens": max_tokens, "stream": True}),
        ("/v1/responses", {"model": "demo", "input": user, "max_output_tokens": max_tokens, "stream": True,
                           "store": False}),
        ("/v1/messages", {"model": "demo", "messages": user, "max_tokens": max_tokens, "stream": True}),
    ])
    with httpx.Client(timeout=600) as http, http.stream("POST", f"{url}{path}", json=body) as response:
        response.raise_for_status()
        for seen, _ in enumerate(response.iter_lines()):
            if seen >= rng.randrange(2, 6):
                break


class Worker(threading.Thread):
    """One client thread: a random kind of traffic, request after request, until the deadline (images go to
    ``vision_url``; none without one)."""

    def __init__(self, index: int, url: str, vision_url: str | None, deadline: float, max_tokens: int):
        super().__init__(daemon=True)
        self.rng = random.Random(index)
        self.index, self.url, self.vision_url = index, url, vision_url
        self.deadline, self.max_tokens = deadline, max_tokens
        self.clients: list[Client] = []
        self.counts: dict[str, int] = {}
        self.errors: list[str] = []

    def run(self) -> None:
        kinds = ["chat", "responses", "messages", "stream left early", *(["images"] if self.vision_url else [])]
        while time.monotonic() < self.deadline:
            kind = self.rng.choice(kinds)
            self.counts[kind] = self.counts.get(kind, 0) + 1
            seed = self.index * 100_003 + sum(self.counts.values())
            if kind == "stream left early":
                try:
                    leave_a_stream_early(self.url, self.rng, self.max_tokens)
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    self.errors.append(f"stream: {type(exc).__name__}: {exc}")
                continue
            turns = 1 if kind == "messages" else self.rng.randrange(2, 5)
            client: Client
            if kind == "images":
                assert self.vision_url is not None
                api = self.rng.choice(sorted(ImageClient.PATHS))
                client = ImageClient(seed, self.vision_url, turns, self.max_tokens, api)
            else:
                make = {"chat": ChatClient, "responses": ResponsesClient, "messages": MessagesClient}[kind]
                client = make(seed, self.url, turns, self.max_tokens)
            client.run()
            self.errors += [f"{kind}: {e}" for e in client.errors]
            self.clients.append(client)


def sample(pid: int) -> dict[str, float]:
    import psutil

    process = psutil.Process(pid)
    return {"rss_mb": process.memory_info().rss / 1e6, "open_files": len(process.open_files()),
            "fds": process.num_fds(), "threads": process.num_threads()}


def growth(samples: list[dict[str, float]], key: str) -> float:
    """The median of the last tenth of the run against the median around its half-way mark."""
    n = len(samples)
    if n < 10:
        return 0.0
    middle = statistics.median(s[key] for s in samples[int(0.45 * n): int(0.55 * n) + 1])
    end = statistics.median(s[key] for s in samples[int(0.9 * n):])
    return (end - middle) / middle if middle else 0.0


def start_server(folder: Path, name: str, model: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """``mlxchat serve`` of ``model`` (the demo model when ``None``) as ``name``, its store in ``folder``."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "mlxchat.cli", "serve", "--port", str(port), "--served-model-name", name,
         *(["--model", str(model)] if model is not None else []),
         "--store", str(folder / f"{name}.sqlite3"), "--caches", "4", "--max-cache-gb", "0.05", "--max-spill-gb",
         "0.2", "--max-queue", "64"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 300
    while True:
        try:
            httpx.get(f"{url}/health", timeout=5)
            return server, url
        except httpx.TransportError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("soak: the server did not start") from None
            time.sleep(0.5)


def replay_alone(workers: list[Worker]) -> tuple[int, list[dict[str, Any]]]:
    """Every non-streamed request sent again, one at a time: (how many, those whose reply differs)."""
    import httpx

    replayed, differ = 0, []
    with httpx.Client(timeout=600) as http:
        for worker in workers:
            for client in worker.clients:
                for body, reply in zip(client.sent, client.replies, strict=True):
                    if reply is None:
                        continue
                    alone = client.reply(http.post(f"{client.url}{client.path}", json=client.alone(body)).json())
                    replayed += 1
                    if alone != reply:
                        differ.append({"path": client.path, "request": body, "load": reply, "alone": alone})
    return replayed, differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sample-every", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--vision-model", type=Path, default=VISION,
                        help="the checkpoint the image traffic goes to (a second server)")
    parser.add_argument("--no-images", action="store_true", help="send no image traffic (no second server)")
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="mlxchat-soak-") as folder:
        servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
        try:
            servers["demo"] = start_server(Path(folder), "demo")
            if not args.no_images:
                servers["vision"] = start_server(Path(folder), "vision", args.vision_model)
            vision_url = servers["vision"][1] if "vision" in servers else None
            started = time.monotonic()
            deadline = started + 60 * args.minutes
            workers = [Worker(i, servers["demo"][1], vision_url, deadline, args.max_tokens)
                       for i in range(args.clients)]
            for worker in workers:
                worker.start()
            samples: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
            while any(w.is_alive() for w in workers):
                for name, (server, _) in servers.items():
                    samples[name].append({"t": round(time.monotonic() - started, 1), **sample(server.pid)})
                time.sleep(args.sample_every)
            seconds = time.monotonic() - started
            replayed, differ = replay_alone(workers)
        finally:
            for server, _ in servers.values():
                server.terminate()
                server.wait(timeout=60)

    counts: dict[str, int] = {}
    for worker in workers:
        for kind, n in worker.counts.items():
            counts[kind] = counts.get(kind, 0) + n
    results = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "host": describe(),
        "minutes": round(seconds / 60, 2),
        "clients": args.clients,
        "vision_model": None if args.no_images else str(args.vision_model),
        "requests": sum(len(c.sent) for w in workers for c in w.clients) + counts.get("stream left early", 0),
        "by_kind": counts,
        "errors": [e for w in workers for e in w.errors],
        "replayed_alone": replayed,
        "differ_from_alone": differ,
        "growth_second_half": {name: {key: round(growth(kept, key), 4) for key in ("rss_mb", "open_files", "threads")}
                               for name, kept in samples.items()},
        "fds_growth_second_half": {name: round(growth(kept, "fds"), 4) for name, kept in samples.items()},
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    passed = (not results["errors"] and not differ
              and all(g <= GROWTH_BAR for server in results["growth_second_half"].values() for g in server.values()))
    return 0 if passed else 1


def markdown(r: dict[str, Any]) -> str:
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(r["by_kind"].items()))
    vision = f"; images to {Path(r['vision_model']).name}" if r["vision_model"] else ""
    rows = []
    for name, kept in r["samples"].items():
        g, first, last = r["growth_second_half"][name], kept[0], kept[-1]
        rows.append(f"| {name} | {first['rss_mb']:.0f} / {last['rss_mb']:.0f}, {g['rss_mb']:+.1%} | "
                    f"{first['open_files']:.0f} / {last['open_files']:.0f}, {g['open_files']:+.1%} | "
                    f"{first['threads']:.0f} / {last['threads']:.0f}, {g['threads']:+.1%} |")
    return (
        f"# Soak ({r['when']}, {r['host']['cpu']}, {r['host']['cores']} cores)\n\n"
        f"{r['minutes']} minutes, {r['clients']} clients on the demo model{vision}: {kinds}.\n\n"
        f"{r['requests']} requests, {len(r['errors'])} errors, {len(r['differ_from_alone'])} of "
        f"{r['replayed_alone']} replayed replies differ from the same request alone.\n\n"
        "| server | RSS MB start/end, growth 2nd half | open files | threads |\n| --- | --- | --- | --- |\n"
        + "\n".join(rows) + "\n"
    )


if __name__ == "__main__":
    sys.exit(main())
