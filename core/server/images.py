"""Images in requests: OpenAI ``image_url`` content parts carry ``data:`` URLs; ``http(s)`` URLs are
fetched only when the server allows remote images (``--allow-remote-images``), within the body size
limit and a timeout, and never a local file a request names."""

from __future__ import annotations

import asyncio
import base64
import urllib.error
import urllib.request
from typing import Any

from ..errors import ImageError
from ..images import image_url_source
from .errors import ApiError

FETCH_TIMEOUT = 10.0


async def inline_images(messages: list[dict[str, Any]], *, allow_remote: bool, max_bytes: int,
                        reads_images: bool) -> None:
    """Check every ``image_url`` part of ``messages`` (in place): refuse images for a model that reads
    none, and replace an allowed remote URL by a ``data:`` URL of what it served."""
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if part.get("type") != "image_url":
                continue
            if not reads_images:
                raise ApiError(400, "this model reads no images (send text)", param="messages")
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            try:
                source = image_url_source(url, allow_remote=allow_remote)
            except ImageError as exc:
                raise ApiError(400, str(exc), param="messages") from None
            if isinstance(source, str):  # an allowed http(s) URL
                data = await asyncio.to_thread(_fetch, source, max_bytes)
                part["image_url"] = {"url": f"data:image/*;base64,{base64.b64encode(data).decode('ascii')}"}


def _fetch(url: str, max_bytes: int) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": "mlxchat"})
    try:
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT) as response:  # noqa: S310 - http(s) only
            data = response.read(max_bytes + 1)
    except (urllib.error.URLError, TimeoutError, ValueError) as exc:
        raise ApiError(400, f"could not fetch the image at {url[:200]} ({exc})", param="messages") from None
    if len(data) > max_bytes:
        raise ApiError(413, f"the image at {url[:200]} is larger than the body limit", code="body_too_large")
    return data
