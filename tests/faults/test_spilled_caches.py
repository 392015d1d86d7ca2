"""A server's spilled prompt caches when the disk misbehaves: a spill file damaged since it was written
(truncated, a bit flipped) or a spill that failed (disk full) starts that conversation cold, re-primed
from the stored chain, with the reply a server that never spilled gives; the server keeps serving."""

from __future__ import annotations

import errno
from typing import Any

import mlx.core as mx
import pytest

openai = pytest.importorskip("openai")

from server_support import DEMO, Served, serving  # noqa: E402

GREEDY: dict[str, Any] = {"model": DEMO, "temperature": 0}


def client(served: Served) -> Any:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)


def expected_follow_up() -> str:
    with serving("demo") as plain:
        api = client(plain)
        first = api.responses.create(input="What is the capital of Chile?", **GREEDY)
        return str(api.responses.create(input="And of Peru?", previous_response_id=first.id, **GREEDY).output_text)


def damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[-5] ^= 0x10  # inside the last array
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "bit flipped", "disk full"])
def test_a_spill_damaged_or_never_written_starts_cold_and_answers_right(tmp_path, monkeypatch, how) -> None:
    expected = expected_follow_up()
    if how == "disk full":
        def full(file: str, *args: Any, **kwargs: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(mx, "save_safetensors", full)
    with serving("demo", store=str(tmp_path / "store.sqlite3"), caches=1) as served:
        api = client(served)
        first = api.responses.create(input="What is the capital of Chile?", **GREEDY)
        api.responses.create(input="What is 40 plus 12?", **GREEDY)  # takes the only slot: the first spills
        (spilled,) = served.state.pool._spilled
        if how == "disk full":
            assert isinstance(spilled.written.exception(timeout=30), Exception)
            assert not list((tmp_path / "store.sqlite3.spill").iterdir())  # nothing half-written left
        else:
            spilled.written.result(timeout=30)
            damage(spilled.path, how)
        follow = api.responses.create(input="And of Peru?", previous_response_id=first.id, **GREEDY)
        assert follow.output_text == expected
        # Cold, primed from the stored chain: at most the template's opening is shared with the other
        # conversation (mlxchat.prefix_cache); a restored spill would hold the whole first prompt.
        assert follow.usage.input_tokens_details.cached_tokens < first.usage.input_tokens
        again = api.responses.create(input="Thanks!", previous_response_id=follow.id, **GREEDY)
        assert again.status == "completed"  # still serving
