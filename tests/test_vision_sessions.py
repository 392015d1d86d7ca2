"""Images in sessions: an image turn and its text follow-ups reuse the cache, the same images re-sent cost
only the new turn, a changed earlier image restarts reuse exactly at its first placeholder, and every turn
equals a stateless render of the same history (greedy, token for token)."""

from __future__ import annotations

import ipaddress

import pytest
from PIL import Image, ImageOps

import mlxchat
from mlxchat.multimodal import MultimodalPrompt
from mlxchat.prompt_cache import common_prefix_length
from mlxchat.server import images as server_images

from conftest import fixture_path, loaded
from vision_support import VISION

GREEDY = {"temperature": 0.0, "max_tokens": 6, "repetition_penalty": 1.3}


def images(name: str) -> tuple[Image.Image, Image.Image]:
    a = Image.open(fixture_path(name) / "image_a.png").convert("RGB")
    return a, ImageOps.mirror(a)  # the same size, so the same placeholder tokens; other pixels


def stateless(model: mlxchat.GenerativeModel, session: mlxchat.ChatSession) -> list[int]:
    """Greedy tokens of a fresh render of the session's visible history before its last reply."""
    history = [m.model_dump() for m in session.messages[:-1]]
    return model.generate(history, GREEDY).tokens


def prompt_of(model: mlxchat.GenerativeModel, session: mlxchat.ChatSession, *more: dict) -> MultimodalPrompt:
    return model.image_prompt([*(m.model_dump() for m in session.messages), *more])


@pytest.mark.parametrize("name", VISION)
def test_an_image_turn_and_its_follow_ups_reuse_the_cache_and_equal_stateless_runs(name: str) -> None:
    model = loaded(name)
    a, _ = images(name)
    session = model.chat_session(system="Be brief.")
    first = session.send("What is in the picture?", images=[a], config=GREEDY)
    assert session.has_images and first.tokens == stateless(model, session)
    user = session.messages[1]
    assert [p["type"] for p in user.content] == ["image", "text"] and user.content[0]["image"].startswith("data:")
    second = session.send("And its colours?", config=GREEDY)
    image_end = prompt_of(model, session).images[0].end
    assert second.report.cached_prompt_tokens > image_end  # the image is not prefilled again
    assert second.tokens == stateless(model, session)


@pytest.mark.parametrize("name", VISION)
def test_a_reply_that_wrote_an_image_placeholder_is_text_when_sent_back(name: str) -> None:
    """Random weights write an image's control tokens in replies (the soak's 400s: "4 image markers for 2
    images"); sent back as the assistant's content they stay text, so a prompt holds one image per image part
    and a session primed with that history (its images as PIL images, stored as data: URLs) answers as a
    stateless run of it."""
    model = loaded(name)
    a, b = images(name)
    written = "".join(model.chat_template.placeholders)
    history = [{"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "What?"}]},
               {"role": "assistant", "content": f"It is {written}."},
               {"role": "user", "content": [{"type": "image", "image": b}, {"type": "text", "text": "And this?"}]}]
    prompt = model.image_prompt(history)
    assert len(prompt.images) == 2
    marker = model.image_tokens.marker
    assert prompt.ids.count(marker) == sum(span.image.tokens for span in prompt.images)
    session = model.chat_session()
    session.prime_history(history)
    assert session.start_from_history(config=GREEDY).tokens == model.generate(history, GREEDY).tokens


@pytest.mark.parametrize("name", VISION)
def test_the_same_images_resent_cost_only_the_new_turn(name: str) -> None:
    model = loaded(name)
    a, _ = images(name)
    first = model.chat_session()
    first.send("What is in the picture?", images=[a], config=GREEDY)
    asked = model.image_prompt([m.model_dump() for m in first.messages[:-1]]).ids
    # A client that sends the whole conversation again (images as data: URLs) onto the same cache.
    again = model.chat_session(cache=first.cache)
    again.prime_history([m.model_dump() for m in first.messages] + [{"role": "user", "content": "Again?"}])
    result = again.start_from_history(config=GREEDY)
    now = prompt_of(model, again)
    # everything up to where this render parts from the first turn's prompt (past the image) is reused
    assert result.report.cached_prompt_tokens >= min(common_prefix_length(asked, now.ids), len(asked) - 1)
    assert result.report.cached_prompt_tokens > now.images[0].end
    assert result.tokens == stateless(model, again)


@pytest.mark.parametrize("name", VISION)
def test_a_changed_earlier_image_restarts_reuse_exactly_at_its_first_placeholder(name: str) -> None:
    model = loaded(name)
    a, flipped = images(name)
    session = model.chat_session(system="Be brief.")
    session.send("Look at this.", images=[a], config=GREEDY)
    session.send("Now this one.", images=[a], config=GREEDY)
    history = [m.model_dump() for m in session.messages]
    history[3]["content"][0]["image"] = mlxchat.images.as_data_url(flipped)  # the second image changes
    changed = model.chat_session(cache=session.cache)
    changed.prime_history(history + [{"role": "user", "content": "Which differ?"}])
    result = changed.start_from_history(config=GREEDY)
    second = prompt_of(model, changed).images[1]
    assert result.report.cached_prompt_tokens == second.start  # a snapshot waited right there
    assert result.tokens == stateless(model, changed)


def test_the_server_reads_data_url_images_and_fetches_remote_ones_only_when_allowed(tmp_path, monkeypatch) -> None:
    import base64
    import functools
    import http.server
    import threading

    import httpx

    from server_support import serving

    png = (fixture_path("qwen3_5_vl") / "image_a.png").read_bytes()
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    (tmp_path / "a.png").write_bytes(png)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    remote = f"http://127.0.0.1:{files.server_address[1]}/a.png"

    def ask(served, url: str) -> httpx.Response:
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
        return httpx.post(f"{served.url}/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0})

    model = loaded("qwen3_5_vl")
    expected = model.generate([{"role": "user", "content": [{"type": "image", "image": png},
                                                           {"type": "text", "text": "What is it?"}]}],
                              {"max_tokens": 4, "temperature": 0.0}).text
    with serving("qwen3_5_vl") as served:
        reply = ask(served, data_url)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == expected
        refused = ask(served, remote)
        assert refused.status_code == 400 and "remote image URLs are not allowed" in refused.json()["error"]["message"]
        assert ask(served, "file:///etc/passwd").status_code == 400
    with serving("qwen3_5_vl", allow_remote_images=True) as served:
        refused = ask(served, remote)  # allowed remote images come only from public addresses
        assert refused.status_code == 400 and "public addresses" in refused.json()["error"]["message"]
        real = server_images.refusal  # the test's own site on 127.0.0.1 stands for a public one
        monkeypatch.setattr(server_images, "refusal",
                            lambda address: None if address == ipaddress.ip_address("127.0.0.1") else real(address))
        fetched = ask(served, remote)
        assert fetched.status_code == 200 and fetched.json()["choices"][0]["message"]["content"] == expected
        assert ask(served, "file:///etc/passwd").status_code == 400
    files.shutdown()
