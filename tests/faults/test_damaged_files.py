"""Saved sessions and prompt caches damaged on disk (truncated, a bit flipped) are refused with a clear
error, never loaded as a wrong cache; a disk that fills up during a save keeps the old file whole; a
server whose spilled cache was damaged starts that conversation cold and answers it right."""

from __future__ import annotations

import errno
import json

import mlx.core as mx
import pytest

import mlxchat
from mlxchat.errors import SavedStateError
from mlxchat.persistence import load_prompt_cache, save_prompt_cache
from mlxchat.testing import GREEDY

from conftest import loaded


@pytest.fixture
def saved(tmp_path):
    model = loaded("qwen3")
    session = model.chat_session(system="Be terse.")
    session.send("Hello there", config=GREEDY)
    path = tmp_path / "chat.session"
    session.save(path)
    return model, session, path


def data_offset(path) -> int:
    """Where the arrays begin in a safetensors file (after its 8-byte length and JSON header)."""
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


@pytest.mark.parametrize("where", ["first array byte", "middle", "last byte"])
def test_a_bit_flipped_in_the_arrays_is_refused(saved, where) -> None:
    model, _, path = saved
    data = bytearray(path.read_bytes())
    start = data_offset(path)
    at = {"first array byte": start, "middle": (start + len(data)) // 2, "last byte": len(data) - 1}[where]
    data[at] ^= 0x04
    path.write_bytes(bytes(data))
    with pytest.raises(SavedStateError, match="damaged .*checksum"):
        mlxchat.ChatSession.load(model, path)


@pytest.mark.parametrize("keep", [0.99, 0.5, 0.01])
def test_a_truncated_file_is_refused(saved, keep) -> None:
    model, _, path = saved
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(SavedStateError, match="not a file mlxchat saved|damaged"):
        mlxchat.ChatSession.load(model, path)


def test_a_token_id_changed_in_the_header_is_refused(saved) -> None:
    model, _, path = saved
    data = bytearray(path.read_bytes())
    header = bytes(data[8:data_offset(path)])
    at = 8 + header.index(b'\\"tokens\\": [')  # the cache's token list (the document is a JSON string)
    while not chr(data[at]).isdigit():  # the first digit of the first saved token id
        at += 1
    data[at] ^= 0x01  # another digit: still a well-formed document
    path.write_bytes(bytes(data))
    with pytest.raises(SavedStateError, match="damaged .*checksum"):
        mlxchat.ChatSession.load(model, path)


def test_a_disk_full_during_a_save_keeps_the_old_file(saved, monkeypatch) -> None:
    model, session, path = saved
    before = path.read_bytes()
    session.send("One more", config=GREEDY)

    def full(file: str, *args, **kwargs) -> None:
        with open(file, "wb") as out:
            out.write(b"\0" * 100)  # part of the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mx, "save_safetensors", full)
    with pytest.raises(SavedStateError, match="could not write .*No space left.*unchanged"):
        session.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left behind
    assert len(mlxchat.ChatSession.load(model, path).messages) == 3
    session.save(path)  # the disk has room again
    assert len(mlxchat.ChatSession.load(model, path).messages) == 5


def test_a_prompt_cache_saved_and_loaded_whole_keeps_its_checksum(tmp_path) -> None:
    model = loaded("lfm2")
    cache = model.make_prompt_cache()
    model.generate([1, 2, 3, 4], {"max_tokens": 3}, cache=cache)
    save_prompt_cache(model, cache, tmp_path / "c.cache")
    header = json.loads(mx.load(str(tmp_path / "c.cache"), format="safetensors", return_metadata=True)[1]["mlxchat"])
    assert len(header["digest"]) == 32
    assert load_prompt_cache(model, tmp_path / "c.cache")[0].tokens == cache.tokens
