"""Images on every endpoint (issue 25, items 7 and 8): chat.completions' ``image_url``, Responses'
``input_image`` and Anthropic's ``image`` blocks are one prompt, reused by their pixels when resent; a
remote image (only with ``allow_remote_images``) is fetched after admission, never from a loopback,
private, link-local or multicast address (checked after resolving, and on every redirect), within one
deadline for the whole request, a size cap and a bounded number per request, on threads of its own."""

from __future__ import annotations

import asyncio
import base64
import http.server
import ipaddress
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

from mlxchat.server import images  # noqa: E402
from mlxchat.server.errors import ApiError  # noqa: E402

from conftest import fixture_path  # noqa: E402
from server_support import Served, serving  # noqa: E402

PNG = (fixture_path("qwen3_5_vl") / "image_a.png").read_bytes()
DATA_URL = f"data:image/png;base64,{base64.b64encode(PNG).decode()}"
QUESTION = "what is in the picture?"


def ask(served: Served, path: str, image: dict[str, Any], **extra: Any) -> httpx.Response:
    if path == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}],
                "max_tokens": 4}
    elif path == "/v1/responses":
        body = {"input": [{"role": "user", "content": [image, {"type": "input_text", "text": QUESTION}]}],
                "max_output_tokens": 4}
    else:
        body = {"messages": [{"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}],
                "max_tokens": 4}
    return httpx.post(served.url + path, json={"model": "tiny", "temperature": 0, **body, **extra}, timeout=120)


def usage(path: str, answer: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) as each API reports them."""
    u = answer["usage"]
    if path == "/v1/chat/completions":
        return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]
    if path == "/v1/responses":
        return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
    return u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]


def text(path: str, answer: dict[str, Any]) -> str:
    if path == "/v1/chat/completions":
        return str(answer["choices"][0]["message"]["content"])
    if path == "/v1/responses":
        return "".join(p["text"] for item in answer["output"] if item["type"] == "message" for p in item["content"])
    return "".join(b["text"] for b in answer["content"] if b["type"] == "text")


IMAGE_PARTS = {"/v1/chat/completions": {"type": "image_url", "image_url": {"url": DATA_URL}},
               "/v1/responses": {"type": "input_image", "image_url": DATA_URL},
               "/v1/messages": {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                            "data": DATA_URL.split(",", 1)[1]}}}


def test_an_image_is_the_same_prompt_on_every_endpoint_and_free_when_resent() -> None:
    with serving("qwen3_5_vl", caches=1) as served:
        seen = {}
        for path, part in IMAGE_PARTS.items():
            first = ask(served, path, part)
            assert first.status_code == 200, first.text
            again = ask(served, path, part, **({"store": False} if path == "/v1/responses" else {}))
            prompt, cached = usage(path, again.json())
            assert prompt == usage(path, first.json())[0] and cached >= prompt - 1  # the image came from the cache
            seen[path] = (prompt, text(path, first.json()))
        assert len(set(seen.values())) == 1, seen


@pytest.mark.parametrize("path", list(IMAGE_PARTS))
def test_images_are_refused_for_a_model_that_reads_none(path: str) -> None:
    with serving("qwen3") as served:
        answer = ask(served, path, IMAGE_PARTS[path])
        assert answer.status_code == 400 and "reads no images" in answer.text


@pytest.mark.parametrize("path", list(IMAGE_PARTS))
def test_a_request_carries_at_most_so_many_images(path: str) -> None:
    """Each image is decoded and resized before the turn: a request of hundreds of tiny files declaring large
    screens cost minutes of CPU before its context check refused it."""
    with serving("qwen3_5_vl") as served:
        answer = ask(served, path, IMAGE_PARTS[path])
        assert answer.status_code == 200
        many = {"/v1/chat/completions": "messages", "/v1/responses": "input", "/v1/messages": "messages"}[path]
        content = [IMAGE_PARTS[path]] * (images.MAX_IMAGES + 1) + [
            {"type": "input_text" if path == "/v1/responses" else "text", "text": QUESTION}]
        answer = httpx.post(served.url + path, json={"model": "tiny", many: [{"role": "user", "content": content}],
                                                     "max_tokens" if path != "/v1/responses" else
                                                     "max_output_tokens": 4}, timeout=120)
        assert answer.status_code == 400 and f"at most {images.MAX_IMAGES} images" in answer.text


# -- remote images -------------------------------------------------------------------------------------

class Site:
    """A local HTTP server whose answers the test sets (path -> status, headers, body), counting requests."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
        self.hits: list[str] = []
        self.hold = threading.Event()
        site = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                site.hits.append(self.path)
                if self.path == "/slow":
                    site.hold.wait(30)
                status, headers, body = site.routes.get(self.path, (404, {}, b""))
                self.send_response(status)
                for key, value in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"


@contextmanager
def site() -> Iterator[Site]:
    served = Site()
    thread = threading.Thread(target=served.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        served.hold.set()
        served.server.shutdown()
        served.server.server_close()


@pytest.fixture
def loopback_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let fetches reach 127.0.0.1 (the test's own site) and nothing else the real check refuses."""
    real = images.refusal
    monkeypatch.setattr(images, "refusal",
                        lambda address: None if address == ipaddress.ip_address("127.0.0.1") else real(address))


def fetch_all(urls: list[str], max_bytes: int = 1 << 20, deadline: float = images.FETCH_DEADLINE) -> list[bytes]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    asyncio.run(images.fetch_images(parts, max_bytes, deadline))
    return [base64.b64decode(part["image_url"]["url"].split(",", 1)[1]) for part in parts]


def fetch(url: str, max_bytes: int = 1 << 20, deadline: float = images.FETCH_DEADLINE) -> bytes:
    return fetch_all([url], max_bytes, deadline)[0]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "10.1.2.3", "169.254.169.254", "224.0.0.1",
                                  "[::ffff:127.0.0.1]"])
def test_a_remote_image_is_never_fetched_from_a_non_public_address(host: str) -> None:
    with site() as local:
        with pytest.raises(ApiError, match="remote images are fetched only from public addresses"):
            fetch(f"http://{host}:{local.port}/image.png")
        assert local.hits == []


@pytest.mark.parametrize("target", ["http://[::1]:{port}/secret", "http://10.1.2.3/secret",
                                    "http://0.0.0.0:{port}/secret"])
def test_every_redirect_is_checked_again(target: str, loopback_allowed: None) -> None:
    with site() as local:
        local.routes["/image.png"] = (302, {"Location": target.format(port=local.port)}, b"")
        with pytest.raises(ApiError, match="only from public addresses"):
            fetch(local.url + "/image.png")
        assert local.hits == ["/image.png"]


def test_a_remote_image_has_a_size_cap_and_one_deadline(loopback_allowed: None) -> None:
    with site() as local:
        local.routes["/image.png"] = (200, {}, PNG)
        local.routes["/moved"] = (301, {"Location": "/image.png"}, b"")
        assert fetch(local.url + "/moved") == PNG
        with pytest.raises(ApiError) as large:
            fetch(local.url + "/image.png", max_bytes=len(PNG) - 1)
        assert large.value.status == 413
        with pytest.raises(ApiError) as slow:
            fetch(local.url + "/slow", deadline=0.2)  # the site holds this one until the test ends
        assert "took longer than 0.2 s" in slow.value.message


def test_the_remote_images_of_a_request_share_one_deadline_on_threads_of_their_own(
        loopback_allowed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[float, str]] = []
    real = images._fetch

    def noted(url: str, max_bytes: int, until: float) -> bytes:
        seen.append((until, threading.current_thread().name))
        return real(url, max_bytes, until)

    monkeypatch.setattr(images, "_fetch", noted)
    with site() as local:
        local.routes["/image.png"] = (200, {}, PNG)
        assert fetch_all([local.url + "/image.png"] * 3) == [PNG] * 3
        assert len(seen) == 3 and len({until for until, _ in seen}) == 1  # one deadline for the request
        assert all(name.startswith("mlxchat-image-fetch") for _, name in seen)
        with pytest.raises(ApiError) as slow:
            fetch_all([local.url + "/image.png", local.url + "/slow"], deadline=0.2)
        assert "the request's 2 remote images took longer than 0.2 s" in slow.value.message


def test_a_request_names_a_bounded_number_of_remote_images() -> None:
    remote = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    messages = [{"role": "user", "content": [remote] * images.MAX_REMOTE_IMAGES}]
    assert len(images.check_images(messages, allow_remote=True, reads_images=True)) == images.MAX_REMOTE_IMAGES
    with pytest.raises(ApiError, match=f"at most {images.MAX_REMOTE_IMAGES} remote images"):
        images.check_images([{"role": "user", "content": [remote] * (images.MAX_REMOTE_IMAGES + 1)}],
                            allow_remote=True, reads_images=True)


def test_a_remote_image_is_fetched_after_admission(loopback_allowed: None) -> None:
    with site() as local, serving("qwen3_5_vl", allow_remote_images=True, max_queue=1) as served:
        local.routes["/image.png"] = (200, {"Content-Type": "image/png"}, PNG)
        remote = {"type": "image_url", "image_url": {"url": local.url + "/image.png"}}
        served.state.queued = 1  # the queue is full
        try:
            refused = ask(served, "/v1/chat/completions", remote)
        finally:
            served.state.queued = 0
        assert refused.status_code == 429 and local.hits == []
        inline = ask(served, "/v1/chat/completions", IMAGE_PARTS["/v1/chat/completions"]).json()
        fetched = ask(served, "/v1/chat/completions", remote)
        assert fetched.status_code == 200 and local.hits == ["/image.png"]
        assert text("/v1/chat/completions", fetched.json()) == text("/v1/chat/completions", inline)
        closed = ask(served, "/v1/messages", {"type": "image", "source": {"type": "url", "url": local.url + "/x"}})
        assert closed.status_code == 400 and "HTTP 404" in closed.text
        assert served.state.queued == 0
