"""A model split over a process group: rank 0 leads, every other rank runs the same forward passes.

Rank 0 owns what needs no MLX (sessions, tokenizer, template, the server). Each piece of MLX work it starts
(a generation, a logits pass, a call on a prompt cache outside a generation) is first sent to the other
ranks as a job on the model's worker thread (see :mod:`.channel`): the prompt ids, the generation config
with ``max_tokens`` already fitted, the snapshot positions, which prompt cache. Every rank then runs the
same generation code on its own copy of that cache, with rank 0's token at every step (see
:func:`~mlxchat.layers.parallel.from_rank_zero`) and rank 0's answer at every cancel check, so the copies
hold the same tokens and snapshots, reuse the same prefixes and stop at the same token.

Another rank follows in one of two ways. :meth:`DistributedModel.follow` runs rank 0's jobs until rank 0
closes the model (a server's other ranks). Or the same script runs on every rank: each call that does MLX
work (``generate``, ``stream``, ``logits``, a session's turn) runs rank 0's job for the same call and returns
the same result (tokens, text, logits, report counts); its own arguments are only checked as rank 0's are.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable, Iterator, Sequence
from itertools import count
from typing import Any

import mlx.core as mx

from ..batching import DecodeRow
from ..errors import DistributedError, ImageError
from ..generation import GenerationChunk, GenerationConfig
from ..limits import check_token_ids
from ..model import GenerativeModel, ImageInput, _evaluated
from ..multimodal import MultimodalPrompt, VisionModule
from ..prompt_cache import DEFAULT_MAX_SNAPSHOTS, PromptCache
from ..worker import Cancelled
from .channel import END, JOB, Channel, FollowerCancel, LeaderCancel, LeaderEnded
from .group import Mode


class SharedPromptCache(PromptCache):
    """A distributed model's prompt cache: ``snapshot()`` and ``clear()`` called outside a generation (a
    session's turn end) are made on every rank, so that the ranks' copies stay the same."""

    def __init__(self, model: DistributedModel, max_snapshots: int):
        super().__init__(model.module.make_cache, max_snapshots)
        self._model = model

    def snapshot(self) -> None:
        self._model._cache_call(self, "snapshot")

    def clear(self) -> None:
        self._model._cache_call(self, "clear")


class DistributedModel(GenerativeModel):
    """A :class:`~mlxchat.model.GenerativeModel` whose module is this rank's part of a model split over
    ``group`` (``mode`` "tensor" or "pipeline"); see the module docstring for how the ranks keep in step.
    Split models read text only."""

    def __init__(self, *, group: mx.distributed.Group, mode: Mode, **kwargs: Any):
        super().__init__(**kwargs)
        self.group, self.mode = group, mode
        self.rank, self.size = group.rank(), group.size()
        self.channel = Channel(group)
        self._keys: weakref.WeakKeyDictionary[PromptCache, int] = weakref.WeakKeyDictionary()
        self._new_key = count(1)
        self._dropped: list[int] = []
        self._copies: dict[int, PromptCache] = {}
        self._in_job = False
        self._done = False
        atexit.register(_close, weakref.ref(self))  # runs before the workers' own exit hook

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, {self.mode} parallel, rank {self.rank} of {self.size})"

    @property
    def leads(self) -> bool:
        """Whether this is rank 0, which starts every job."""
        return self.rank == 0

    # -- jobs ---------------------------------------------------------------------------------------

    def make_prompt_cache(self, max_snapshots: int = DEFAULT_MAX_SNAPSHOTS) -> PromptCache:
        return SharedPromptCache(self, max_snapshots)

    def logits(self, token_ids: Sequence[int] | MultimodalPrompt,
               images: Sequence[ImageInput] | None = None) -> mx.array:
        """Rank 0's logits on every rank (see :meth:`GenerativeModel.logits`); text only."""
        ids = check_token_ids(self._text(token_ids, images), self.config.vocab_size, "token id")
        return self.worker.run(lambda: self._logits_of(self._job({"op": "logits", "ids": ids})["ids"]))

    def run_generation(self, prompt: Sequence[int] | MultimodalPrompt, cache: PromptCache, config: GenerationConfig,
                       cancel: Cancelled, snapshot_at: Sequence[int] = ()) -> Iterator[GenerationChunk | DecodeRow]:
        """The generation loop on every rank (see :meth:`GenerativeModel.run_generation`): on rank 0 as asked,
        on the others as rank 0 asked, each with its own copy of the prompt cache."""
        ids = check_token_ids(self._text(prompt), self.config.vocab_size, "prompt token id")
        check_token_ids(config.logit_bias, self.config.vocab_size, "logit_bias token id")
        config = self.fit(len(ids), config)
        if not self.leads:
            yield from self._follow_generation(self._job(None, "generate"), cache)
            return
        self._job({"op": "generate", "prompt": ids, "config": config.model_dump(mode="json"),
                   "snapshot_at": list(snapshot_at), **self._cache_key(cache)})
        finished = False
        self._in_job = True
        try:
            yield from super().run_generation(ids, cache, config, LeaderCancel(cancel, self.channel), snapshot_at)
            finished = True
        finally:
            self._in_job = False
            if not finished:  # the reader left early: the others stop at their next check
                self.channel.post(END)

    def follow(self) -> None:
        """Run rank 0's jobs until rank 0 closes the model (for a rank with nothing else to do, like a
        server's other ranks); then this model is closed too."""
        if self.leads:
            raise DistributedError("rank 0 leads the other ranks; follow() is for ranks 1 and up")
        self.worker.run(self._follow)
        self.close()

    def close(self) -> None:
        """Close the model on every rank: rank 0 tells the others, which close when they read it."""
        if not self._done:
            self._done = True
            if self.leads:
                self.worker.run(lambda: self.channel.post(JOB, {"op": "close"}, wait=True))
            else:
                self.worker.run(lambda: self._job(None, "close"))
        super().close()

    # -- rank 0 and the others ----------------------------------------------------------------------

    def _job(self, job: dict[str, Any] | None, op: str | None = None) -> dict[str, Any]:
        """On rank 0, send ``job`` (with the caches dropped since the last one); elsewhere, the next job from
        rank 0, which must be an ``op`` (each rank makes the same calls)."""
        if self.leads:
            assert job is not None
            job["drop"] = []
            while self._dropped:  # finalizers append from any thread; pop is atomic
                job["drop"].append(self._dropped.pop())
            self.channel.post(JOB, job)
            return job
        kind, received = self.channel.take()
        while kind == END:  # an early end that came after this rank had finished anyway
            kind, received = self.channel.take()
        if kind != JOB or (op is not None and received.get("op") != op):
            raise DistributedError(f"rank {self.rank} expected rank 0's {op or 'next job'} but got "
                                   f"{received.get('op') if kind == JOB else f'message {kind}'}: every rank must "
                                   "make the same calls, or run model.follow()")
        for key in received.get("drop", ()):
            self._copies.pop(key, None)
        if received["op"] == "close":
            self._done = True
        return received

    def _follow(self) -> None:
        while not self._done:
            job = self._job(None)
            if job["op"] == "generate":
                for _ in self._follow_generation(job, None):
                    pass
            elif job["op"] == "logits":
                self._logits_of(job["ids"])
            elif job["op"] == "cache":
                getattr(PromptCache, job["call"])(self._copy(job, None))

    def _follow_generation(self, job: dict[str, Any],
                           cache: PromptCache | None) -> Iterator[GenerationChunk | DecodeRow]:
        config = GenerationConfig.model_validate(job["config"])
        self._in_job = True
        try:
            yield from super().run_generation(job["prompt"], self._copy(job, cache), config,
                                              FollowerCancel(self.channel), job["snapshot_at"])
        except LeaderEnded:
            return
        finally:
            self._in_job = False

    def _logits_of(self, ids: list[int]) -> mx.array:
        out = self.module(mx.array([ids]))[0].astype(mx.float32)
        mine = out if self.leads else mx.depends(mx.zeros_like(out), out)
        return _evaluated(mx.distributed.all_sum(mine, group=self.group))

    def _cache_key(self, cache: PromptCache) -> dict[str, int]:
        """How the other ranks know ``cache`` (a key rank 0 gives it on first use) and size their copy."""
        key = self._keys.get(cache)
        if key is None:
            key = self._keys[cache] = next(self._new_key)
            weakref.finalize(cache, self._dropped.append, key)
        return {"cache": key, "max_snapshots": cache.max_snapshots}

    def _copy(self, job: dict[str, Any], cache: PromptCache | None) -> PromptCache:
        """This rank's copy of rank 0's cache ``job["cache"]``: the one seen before, else ``cache`` (the same
        call's own cache, when every rank runs the same script) or a new one."""
        key = job["cache"]
        if key not in self._copies:
            copy = cache if cache is not None else self.make_prompt_cache()
            copy.max_snapshots = job["max_snapshots"]
            self._copies[key] = copy
        return self._copies[key]

    def _cache_call(self, cache: SharedPromptCache, call: str) -> None:
        """``cache.<call>()`` on every rank's copy (only here, inside a generation, which every rank runs)."""
        local: Callable[[PromptCache], None] = getattr(PromptCache, call)
        if self._in_job or (call == "snapshot" and not cache.needs_snapshots):
            local(cache)
            return

        def run() -> None:
            if self.leads:
                self._job({"op": "cache", "call": call, **self._cache_key(cache)})
                local(cache)
            else:
                job = self._job(None, "cache")
                getattr(PromptCache, job["call"])(self._copy(job, cache))

        self.worker.run(run)

    # -- text only ----------------------------------------------------------------------------------

    def _text(self, prompt: Any, images: Sequence[ImageInput] | None = None) -> Sequence[int]:
        if images or (isinstance(prompt, MultimodalPrompt) and prompt.images):
            self._vision()
        return list(prompt.ids) if isinstance(prompt, MultimodalPrompt) else prompt

    def _vision(self) -> VisionModule:
        raise ImageError(f"a model split over processes (distributed={self.mode!r}) reads text only")


def _close(model: weakref.ref[DistributedModel]) -> None:
    alive = model()
    if alive is not None:
        alive.close()
