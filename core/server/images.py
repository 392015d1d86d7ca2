"""Images in requests, on every endpoint: each endpoint turns its own image parts (chat.completions'
``image_url``, Responses' ``input_image``, Anthropic's ``image`` blocks) into OpenAI ``image_url`` parts of
its chat messages, carrying ``data:`` URLs; :func:`check_images` refuses them for a model that reads none
and finds the ``http(s)`` ones, which are fetched only when the server allows remote images
(``--allow-remote-images``) and only once the request has been admitted (:func:`fetch_images`).

A remote fetch never reaches the server's own network: every address the host name resolves to must be
public (no loopback, private, link-local, shared, reserved or multicast address), the connection goes to
the address checked (so a second DNS answer cannot switch it), and every redirect is checked the same way.
A request names at most :data:`MAX_REMOTE_IMAGES` of them; they are fetched together on a small pool of
threads of their own (never the event loop's default pool, which the rest of the server uses), within one
deadline for the whole request (resolving, connecting, redirects and reading of every image), each image
within the body-size cap. The request stops waiting at the deadline; a resolver that hangs keeps only one
of the pool's threads until the system gives up on it. A local file is never read.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import ipaddress
import socket
import ssl
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import ImageError
from ..images import image_url_source
from .errors import ApiError
from .guard import ascii_digits

FETCH_DEADLINE = 10.0
"""Seconds the remote images of one request may take in all (resolving, connecting, redirects, reading)."""
MAX_REMOTE_IMAGES = 8
"""Remote images one request may name."""
MAX_IMAGES = 32
"""The most images a request may carry (each decoded and resized before the turn: 200 tiny files declaring huge
screens took minutes of CPU)."""
MAX_REDIRECTS = 3
FETCH_THREADS = 4
_fetchers = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="mlxchat-image-fetch")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def check_images(messages: list[dict[str, Any]], *, allow_remote: bool, reads_images: bool) -> list[dict[str, Any]]:
    """Check every ``image_url`` part of ``messages``: refuse images for a model that reads none, and URLs
    that are neither ``data:`` nor (when allowed) ``http(s)``. The parts whose remote URL is to be fetched."""
    remote, count = [], 0
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("type") != "image_url":
                continue
            count += 1
            if count > MAX_IMAGES:
                raise ApiError(400, f"a request may carry at most {MAX_IMAGES} images", param="messages")
            if not reads_images:
                raise ApiError(400, "this model reads no images (send text)", param="messages")
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            try:
                source = image_url_source(url, allow_remote=allow_remote)
            except ImageError as exc:
                raise ApiError(400, str(exc), param="messages") from None
            if isinstance(source, str):
                remote.append(part)
    if len(remote) > MAX_REMOTE_IMAGES:
        raise ApiError(400, f"a request may name at most {MAX_REMOTE_IMAGES} remote images ({len(remote)} given); "
                            "send the others as data: URLs", param="messages")
    return remote


async def fetch_images(parts: list[dict[str, Any]], max_bytes: int, deadline: float = FETCH_DEADLINE) -> None:
    """Replace the remote URL of each part by a ``data:`` URL of the image it serves, all of them fetched
    together within ``deadline`` seconds, each within ``max_bytes`` (see the module)."""
    if not parts:
        return
    urls = [part["image_url"]["url"] if isinstance(part["image_url"], dict) else part["image_url"] for part in parts]
    until = time.monotonic() + deadline
    loop = asyncio.get_running_loop()
    fetches = [loop.run_in_executor(_fetchers, _fetch, url, max_bytes, until) for url in urls]
    try:
        async with asyncio.timeout(deadline):
            images = await asyncio.gather(*fetches)
    except TimeoutError:  # the deadline passed here, or in a fetch (a socket's timeout is what was left)
        what = f"the image at {urls[0][:200]}" if len(urls) == 1 else f"the request's {len(urls)} remote images"
        raise ApiError(400, f"{what} took longer than {deadline:g} s to fetch", param="messages") from None
    finally:
        for fetch in fetches:
            fetch.cancel()  # the ones still queued never start
    for part, data in zip(parts, images, strict=True):
        part["image_url"] = {"url": f"data:image/*;base64,{base64.b64encode(data).decode('ascii')}"}


def refusal(address: Address) -> str | None:
    """Why a fetch must not go to ``address`` (``None``: it is a public unicast address)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_multicast:
        return "a multicast address"
    if not address.is_global:
        return "not a public address (loopback, private, link-local, shared or reserved)"
    return None


def _fetch(url: str, max_bytes: int, until: float) -> bytes:
    try:
        return _follow(url, max_bytes, until)
    except TimeoutError:
        raise
    except (OSError, http.client.HTTPException) as exc:  # the connection broke while reading
        raise _unfetched(url, str(exc) or type(exc).__name__) from None


def _follow(url: str, max_bytes: int, until: float) -> bytes:
    for _ in range(MAX_REDIRECTS + 1):
        response, connection = _get(url, until)
        try:
            if response.status in (301, 302, 303, 307, 308):
                location = response.getheader("Location")
                if not location:
                    raise _unfetched(url, f"a redirect ({response.status}) without a Location")
                url = urllib.parse.urljoin(url, location)
                continue
            if response.status != 200:
                raise _unfetched(url, f"HTTP {response.status}")
            length = response.getheader("Content-Length")
            if length is not None and ascii_digits(length) and int(length) > max_bytes:
                raise _too_large(url)
            data = bytearray()
            while chunk := response.read(min(64 * 1024, max_bytes + 1 - len(data))):
                data += chunk
                if len(data) > max_bytes:
                    raise _too_large(url)
                _remaining(url, until)
            return bytes(data)
        finally:
            connection.close()
    raise _unfetched(url, f"more than {MAX_REDIRECTS} redirects")


def _get(url: str, until: float) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection]:
    """GET ``url`` from a checked address of its host (the connection is the caller's to close)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _unfetched(url, "only http(s) URLs with a host name are fetched")
    _remaining(url, until)  # a fetch that waited for a thread past the deadline resolves nothing
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        found = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:
        raise _unfetched(url, f"cannot resolve its host: {exc}") from None
    addresses = [ipaddress.ip_address(str(entry[4][0]).split("%")[0]) for entry in found]
    for address in addresses:
        reason = refusal(address)
        if reason is not None:
            raise ApiError(400, f"the image URL {url[:200]} is refused: its host resolves to {address}, {reason}; "
                                "remote images are fetched only from public addresses", param="messages")
    timeout = _remaining(url, until)
    connection: http.client.HTTPConnection
    if parts.scheme == "https":
        connection = _CheckedHTTPS(str(addresses[0]), port, parts.hostname, timeout)
    else:
        connection = http.client.HTTPConnection(str(addresses[0]), port, timeout=timeout)
    target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    try:
        connection.request("GET", target, headers={"Host": parts.netloc.rsplit("@", 1)[-1], "User-Agent": "mlxchat"})
        return connection.getresponse(), connection
    except TimeoutError:
        connection.close()
        raise
    except (OSError, http.client.HTTPException) as exc:
        connection.close()
        raise _unfetched(url, str(exc) or type(exc).__name__) from None


class _CheckedHTTPS(http.client.HTTPSConnection):
    """HTTPS to a given address, with the certificate checked against the URL's host name."""

    def __init__(self, address: str, port: int, hostname: str, timeout: float):
        super().__init__(address, port, timeout=timeout)
        self.hostname, self.tls = hostname, ssl.create_default_context()

    def connect(self) -> None:
        self.sock = self.tls.wrap_socket(socket.create_connection((self.host, self.port), self.timeout),
                                         server_hostname=self.hostname)


def _remaining(url: str, until: float) -> float:
    left = until - time.monotonic()
    if left <= 0:
        raise TimeoutError(url)
    return left


def _unfetched(url: str, why: str) -> ApiError:
    return ApiError(400, f"could not fetch the image at {url[:200]} ({why})", param="messages")


def _too_large(url: str) -> ApiError:
    return ApiError(413, f"the image at {url[:200]} is larger than the body limit", code="body_too_large")
