"""Tensor- and pipeline-parallel inference: the split math, the pieces a split model is made of, and (marked
slow) models split over 2 and 3 local processes on the ring backend over loopback, compared with one
process: logits, greedy and seeded tokens, 3-turn sessions (hybrids included) with the same replies and
the same reuse, a stream left early, and ranks that follow rank 0 as a server's do.

The slow launches start the ranks themselves, as ``mlx.launch`` does (``MLX_RANK``, ``MLX_HOSTFILE``), without
its polling loop, which takes a core of this 2-core machine; one launch per group size runs every check
(tests/distributed_ranks.py). ``mlx.launch`` itself runs the CLI once.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxchat
import mlxchat.distributed
from mlxchat.cache import KVCache, SlidingWindowCache, StateCache
from mlxchat.checkpoint import read_slice, tensor_locations
from mlxchat.errors import DistributedError
from mlxchat.layers.parallel import balanced, head_split
from mlxchat.layers.pipeline import pipeline_split
from mlxchat.testing import chunked_logits, fixture_info

import distributed_ranks as ranks
from conftest import FIXTURES, loaded

RANKS = Path(ranks.__file__).resolve()

TIMEOUT = 1200


# -- the split math ---------------------------------------------------------------------------------


def test_balanced_splits_are_contiguous_and_even_in_whole_units() -> None:
    assert balanced(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert balanced(160, 3, 32) == [(0, 64), (64, 128), (128, 160)]
    with pytest.raises(DistributedError, match="whole groups of 32"):
        balanced(48, 2, 32)
    with pytest.raises(DistributedError, match="cannot be split over 3 ranks"):
        balanced(2, 3)


def test_head_split_gives_each_rank_whole_kv_groups_or_replicates_a_kv_head() -> None:
    assert head_split(16, 8, 2) == [((0, 8), (0, 4)), ((8, 16), (4, 8))]
    assert head_split(12, 3, 2) == [((0, 8), (0, 2)), ((8, 12), (2, 3))]
    # Fewer KV heads than ranks: the ranks reading one KV head share it, each with its own queries.
    assert head_split(4, 2, 3) == [((0, 1), (0, 1)), ((1, 2), (0, 1)), ((2, 4), (1, 2))]
    assert head_split(4, 1, 3) == [((0, 2), (0, 1)), ((2, 3), (0, 1)), ((3, 4), (0, 1))]
    for heads, kv, size in ((32, 8, 3), (6, 3, 5), (8, 1, 8)):
        split = head_split(heads, kv, size)
        assert [q for q, _ in split] == list(zip([q[0] for q, _ in split], [q[1] for q, _ in split], strict=True))
        assert split[0][0][0] == 0 and split[-1][0][1] == heads
        for (q0, q1), (k0, k1) in split:
            assert k0 == q0 // (heads // kv) and k1 == (q1 - 1) // (heads // kv) + 1
            assert (q1 - q0) % (k1 - k0) == 0
    with pytest.raises(DistributedError, match="2 attention heads cannot be split over 3 ranks"):
        head_split(2, 1, 3)


def test_pipeline_split_balances_bytes_with_rank_zero_holding_the_ends() -> None:
    units = [range(i, i + 1) for i in range(8)]
    assert pipeline_split(units, [10] * 8, 2, 0) == [range(0, 4), range(4, 8)]
    assert pipeline_split(units, [10] * 8, 2, 40) == [range(0, 2), range(2, 8)]
    assert pipeline_split(units, [10] * 8, 3, 0) == [range(0, 2), range(2, 5), range(5, 8)]
    kept = [*units[:3], range(3, 8)]  # Gemma 4: KV-shared layers stay with the layers they read
    assert pipeline_split(kept, [10] * 8, 2, 0) == [range(0, 3), range(3, 8)]
    with pytest.raises(DistributedError, match="2 layers"):
        pipeline_split(units[:2], [10, 10], 3, 0)


class Recorded:
    """A channel that records rank 0's messages and gives them back, in order, to a follower."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.group = mx.distributed.init()

    def post(self, kind: int, payload: object = None) -> None:
        self.sent.append(kind)

    def take(self) -> tuple[int, None]:
        return self.sent.pop(0), None


def test_cancel_flags_message_the_ranks_only_at_explicit_checks() -> None:
    """Reading a rank's cancel flag again (an extra ``if cancel:``) sends nothing, so ranks cannot lose step:
    only ``check()`` is the collective, made at the same points on every rank."""
    from mlxchat.distributed.channel import CANCEL, CONTINUE, FollowerCancel, LeaderCancel
    from mlxchat.worker import Cancelled

    channel, flag = Recorded(), Cancelled()
    leader = LeaderCancel(flag, channel)  # type: ignore[arg-type]
    assert not leader.check() and channel.sent == [CONTINUE]
    flag.set()
    assert not leader and not leader and channel.sent == [CONTINUE]  # reads: no message, the last answer
    assert leader.check() and leader and channel.sent == [CONTINUE, CANCEL]
    follower = FollowerCancel(channel)  # type: ignore[arg-type]
    assert not follower and not follower.check() and not follower  # rank 0's first answer: go on
    assert follower.check() and follower and channel.sent == []  # then stop, in step


def test_a_worker_given_up_ends_its_jobs_with_the_error_and_closes_without_waiting() -> None:
    """What rank 0 does when its group is lost (its thread stuck in a collective for good, here in a wait that
    never ends): the stream being read, a job queued behind it and any later call get the error, and closing
    does not wait for the thread."""
    import threading

    from mlxchat.worker import Worker

    worker, stuck, never = Worker(side_by_side=False), threading.Event(), threading.Event()

    def produce(cancel: object) -> Any:
        yield 1
        stuck.set()
        never.wait()
        yield 2

    stream = worker.stream(produce)
    assert next(stream) == 1
    queued = worker.submit(lambda: 3)
    stuck.wait()
    error = DistributedError("lost")
    threading.Thread(target=worker.fail, args=(error,)).start()
    with pytest.raises(DistributedError, match="lost"):
        next(stream)
    with pytest.raises(DistributedError, match="lost"):
        queued.result()
    with pytest.raises(DistributedError, match="lost"):
        worker.run(lambda: 4)
    worker.close()
    never.set()


def test_loading_split_without_a_group_says_how_to_launch() -> None:
    with pytest.raises(DistributedError, match="mlx.launch"):
        mlxchat.load_model(FIXTURES / "qwen3", distributed="tensor")
    with pytest.raises(ValueError, match="tensor, pipeline"):
        mlxchat.load_model(FIXTURES / "qwen3", distributed="expert")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["qwen3", "qwen3_q4", "gemma4"])
def test_a_slice_read_from_the_file_is_the_slice_of_the_tensor(name: str) -> None:
    folder = FIXTURES / name
    full = mx.load(str(folder / "model.safetensors"))
    for tensor, location in tensor_locations(folder).items():
        if not location.shape:
            continue
        axis = len(location.shape) - 1
        size = location.shape[axis]
        ranges = [(0, size // 3), (size // 2, size)] if size > 2 else [(0, size)]
        piece = read_slice(location, axis, ranges)
        assert piece is not None
        want = mx.concatenate([full[tensor][..., a:b] for a, b in ranges], axis=axis)
        assert piece.dtype == want.dtype and np.array_equal(np.array(piece.astype(mx.float32)),
                                                            np.array(want.astype(mx.float32))), tensor


@pytest.mark.parametrize("make", [KVCache, lambda: StateCache(2), lambda: SlidingWindowCache(4)],
                         ids=["kv", "state", "sliding"])
def test_an_advanced_cache_answers_like_one_that_holds_the_tokens(make: Any) -> None:
    """A pipeline rank keeps the caches of other ranks' layers advanced without data: they must decide reuse
    and snapshots exactly as the real ones do, through writes, cuts and restores."""
    real, ghost = make(), make()
    rng = np.random.default_rng(0)
    saved = []
    for length in (3, 1, 1, 5, 1, 2, 7, 1, 1, 4):
        if isinstance(real, StateCache):
            real.update(mx.zeros((1, 2)), mx.zeros((1, 2)), tokens=length)
        else:
            real.update_and_fetch(mx.zeros((1, 1, length, 2)), mx.zeros((1, 1, length, 2)))
        ghost.advance(length)
        saved.append((real.snapshot(), ghost.snapshot()))
        cuts = [p for p in range(real.offset + 1) if real.can_trim_to(p)]
        assert cuts == [p for p in range(ghost.offset + 1) if ghost.can_trim_to(p)]
        if real.trimmable or isinstance(real, SlidingWindowCache):
            target = int(rng.choice(cuts))
            real.trim_to(target)
            ghost.trim_to(target)
        assert (real.offset, getattr(real, "start", 0)) == (ghost.offset, getattr(ghost, "start", 0))
    if saved[4][0] is not None:
        real.restore(saved[4][0])
        ghost.restore(saved[4][1])
        assert (real.offset, getattr(real, "start", 0)) == (ghost.offset, getattr(ghost, "start", 0))


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
@pytest.mark.parametrize("folder", ranks.fixtures()[:16], ids=lambda folder: folder.name)
def test_a_group_of_one_computes_what_the_whole_model_does(folder: Path, mode: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every split code path (lazy slices, row-parallel layers, vocab-parallel embedding and head, slices read
    from the file, the jobs rank 0 sends) on a group of this process alone: what one process computes."""
    monkeypatch.setattr(mlxchat.distributed, "join", lambda mode: mx.distributed.init())
    model = mlxchat.load_model(folder, dtype="float32", distributed=mode)  # type: ignore[arg-type]
    try:
        single = _single(folder.name)
        assert isinstance(model, mlxchat.distributed.DistributedModel) and model.size == 1
        assert np.array_equal(np.array(model.logits(ranks.PROMPT)), np.array(single.logits(ranks.PROMPT)))
        assert model.generate(ranks.PROMPT, ranks.GREEDY).tokens == single.generate(ranks.PROMPT, ranks.GREEDY).tokens
    finally:
        model.close()


# -- split over local processes ---------------------------------------------------------------------


def _ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def launch(size: int, argv: list[str], folder: Path, timeout: float = TIMEOUT) -> list[str]:
    """Run ``argv`` as ``size`` ranks of a ring over loopback (what ``mlx.launch --backend ring`` sets up);
    their outputs, after all of them exited 0."""
    hostfile = folder / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in _ports(size)]))
    logs = [folder / f"rank{rank}.log" for rank in range(size)]
    processes = [subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                  env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)})
                 for rank, log in enumerate(logs)]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in processes):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in processes):
                break
            time.sleep(0.2)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    outputs = [log.read_text() for log in logs]
    codes = [p.wait() for p in processes]
    assert codes == [0] * size, "\n".join(f"-- rank {r} exited {c}:\n{o[-3000:]}" for r, (c, o) in
                                         enumerate(zip(codes, outputs, strict=True)))
    return outputs


@pytest.fixture(scope="module", params=[2, 3])
def split_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every rank's results of one launch of ``size`` ranks running distributed_ranks.py in both modes."""
    size = request.param
    folder = tmp_path_factory.mktemp(f"ranks{size}")
    launch(size, [sys.executable, str(RANKS), str(folder), "tensor,pipeline"], folder)
    yield {"size": size,
           "results": [json.loads((folder / f"rank{r}.json").read_text()) for r in range(size)],
           "logits": [dict(np.load(folder / f"rank{r}.npz")) for r in range(size)]}


def _single(name: str) -> mlxchat.GenerativeModel:
    return loaded(name)


def _loaded(run: dict[str, Any]) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
    for key, record in run["results"][0].items():
        if "error" not in record and not key.startswith("follow/"):
            name, mode = key.split("/")
            yield key, name, mode, record


@pytest.mark.slow
def test_every_rank_returns_the_same_results(split_runs: dict[str, Any]) -> None:
    first = split_runs["results"][0]
    for rank, results in enumerate(split_runs["results"][1:], start=1):
        for key, record in first.items():
            other = results[key]
            if key.startswith("follow/"):
                assert other == {"followed": True}
                continue
            assert {k: v for k, v in record.items() if k != "param_bytes"} == {
                k: v for k, v in other.items() if k != "param_bytes"}, (rank, key)
        for key, logits in split_runs["logits"][0].items():
            assert np.array_equal(logits, split_runs["logits"][rank][key]), (rank, key)


@pytest.mark.slow
def test_split_logits_match_one_process(split_runs: dict[str, Any]) -> None:
    """Pipeline parallel runs the same operations as one process: the same bits. Tensor parallel sums partial
    products across ranks in another order: float32 rounding, within 1e-5 of the logits' scale or, where more,
    what one process's own chunked prefill differs from its full forward (DeltaNet's recurrence: 3.7e-5)."""
    compared = set()
    for key, name, mode, _ in _loaded(split_runs):
        single = _single(name)
        want = np.array(single.logits(ranks.PROMPT))
        got = split_runs["logits"][0][key]
        if mode == "pipeline":
            assert np.array_equal(got, want), key
        else:
            noise = max(np.abs(chunked_logits(single, ranks.PROMPT, chunks) - want).max()
                        for chunks in ((5, 7, 8), (10, 10), (1,) * len(ranks.PROMPT)))
            error = np.abs(got - want).max()
            assert error <= max(1e-5 * np.abs(want).max(), noise), (key, error, noise)
        compared.add((name, mode))
    architectures = {f.name for f in ranks.fixtures() if not fixture_info(f).get("variant_of")
                     and fixture_info(f).get("kind", "text") == "text"}
    assert len(architectures) == 8
    for mode in ("tensor", "pipeline"):
        assert {n for n, m in compared if m == mode} >= architectures, mode


@pytest.mark.slow
def test_split_models_generate_the_same_tokens_as_one_process(split_runs: dict[str, Any]) -> None:
    for key, name, _, record in _loaded(split_runs):
        single = _single(name)
        assert record["greedy"] == single.generate(ranks.PROMPT, ranks.GREEDY).tokens, key
        assert record["sampled"] == single.generate(ranks.PROMPT, ranks.SAMPLED).tokens, key


@pytest.mark.slow
def test_split_sessions_reply_and_reuse_as_one_process(split_runs: dict[str, Any]) -> None:
    sessions = [(key, name, record) for key, name, _, record in _loaded(split_runs) if "session" in record]
    assert {name for _, name, _ in sessions} >= {"qwen3", "qwen3_5", "qwen3_5_moe", "lfm2", "gemma4"}
    for key, name, record in sessions:
        assert record["session"] == ranks.session_turns(_single(name)), key
        assert all(turn["cached"] > 0 for turn in record["session"][1:]), key


@pytest.mark.slow
def test_a_stream_left_early_keeps_every_rank_in_step(split_runs: dict[str, Any]) -> None:
    for key, name, _, record in _loaded(split_runs):
        if "stopped" in record:
            assert record["stopped"] == ranks.stopped_stream(_single(name)), key


@pytest.mark.slow
def test_ranks_that_follow_serve_rank_zeros_session(split_runs: dict[str, Any]) -> None:
    single = _single(ranks.FOLLOWED)
    for mode in ("tensor", "pipeline"):
        record = split_runs["results"][0][f"follow/{mode}"]
        assert record == {"session": ranks.session_turns(single), "stopped": ranks.stopped_stream(single),
                          "kv8": ranks.session_turns(single, kv_bits=8, kv_group_size=32)}


@pytest.mark.slow
def test_each_rank_holds_only_its_share_of_the_weights(split_runs: dict[str, Any]) -> None:
    """Tensor parallel: every rank about 1/N of each split layer (norms, routers and Gemma's per-layer-input
    projections stay whole); pipeline: each layer on one rank, the ends on rank 0 (Gemma 4's embedding tables,
    which every layer's per-layer input reads, on every rank). Split models leave out the vision tower."""
    size = split_runs["size"]
    for key, name, mode, _ in _loaded(split_runs):
        module = _single(name).module
        single = sum(v.nbytes for k, v in dict(tree_flatten(module.parameters())).items()
                     if not k.startswith(tuple(module.vision_parts)))
        held = [results[key]["param_bytes"] for results in split_runs["results"]]
        if mode == "tensor":
            assert max(held) < single / size * 1.35, (key, held, single)
        else:
            assert max(held) < single <= sum(held), (key, held, single)


@pytest.mark.slow
def test_splits_that_cannot_work_say_what_would(split_runs: dict[str, Any]) -> None:
    """Only splits that cannot work fail: heads or layers fewer than ranks, quantization groups cut."""
    errors = {key: record["error"] for key, record in split_runs["results"][0].items() if "error" in record}
    for key, message in errors.items():
        assert "distributed='pipeline'" in message or "fewer ranks" in message, (key, message)
    if split_runs["size"] == 3:
        assert "heads cannot be split over 3 ranks" in errors["qwen3_5_vl/tensor"]
        assert "2 layers" in errors["qwen3_5_vl/pipeline"]
    else:
        assert not [key for key in errors if not key.split("/")[0].endswith("q4")], errors


@pytest.mark.slow
def test_the_cli_runs_split_under_mlx_launch(tmp_path: Path) -> None:
    launcher = Path(sys.executable).parent / "mlx.launch"
    port = _ports(1)[0]
    command = [str(launcher), "--backend", "ring", "-n", "2", "--starting-port", str(port), "--",
               sys.executable, "-m", "mlxchat.cli"]
    info = subprocess.run([*command, "info", "--json"], capture_output=True, text=True, timeout=300)
    assert info.returncode == 0, info.stderr
    groups = [json.loads(part)["distributed"] for part in _json_objects(info.stdout)]
    assert sorted(g["rank"] for g in groups) == [0, 1] and {g["backend"] for g in groups} == {"ring"}
    for mode in ("tensor", "pipeline"):
        run = subprocess.run([*command, "generate", "--distributed", mode, "--model", str(FIXTURES / "qwen3"),
                              "--max-tokens", "5", "--temperature", "0", "--raw", "Hello"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        single = _single("qwen3").generate("Hello", {"max_tokens": 5, "temperature": 0.0})
        assert single.text in run.stdout and "5 generated" in run.stderr, (run.stdout, run.stderr)


def _json_objects(text: str) -> list[str]:
    """The JSON objects printed one after another (each rank prints one)."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while (start := text.find("{", at)) != -1:
        _, end = decoder.raw_decode(text, start)
        found.append(text[start:end])
        at = end
    return found
