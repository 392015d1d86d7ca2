"""A model split over a process group: rank 0 leads, every other rank runs the same forward passes.

Rank 0 owns what needs no MLX (sessions, tokenizer, template, the server). Each piece of MLX work it starts
(a generation, a logits pass, a call on a prompt cache outside a generation) is first sent to the other
ranks as a job on the model's worker thread (see :mod:`.channel`): the prompt ids, the generation config
with ``max_tokens`` already fitted, the snapshot positions, which prompt cache. Every rank then runs the
same generation code on its own copy of that cache, with rank 0's token at every step (see
:func:`~mlxchat.layers.parallel.from_rank_zero`) and rank 0's answer at every cancel check, so the copies
hold the same tokens and snapshots, reuse the same prefixes and stop at the same token.

Rank 0 waits at most ``timeout`` seconds for each step of the group (:mod:`.watchdog`). A rank that died or
stopped answering, or an error inside MLX during rank 0's work with the group (which leaves the ranks out of
step), ends the model on rank 0: the job fails with :class:`~mlxchat.errors.DistributedError`, every later
call raises it at once, and rank 0's connections of the group are shut (see
:func:`~.group.close_connections`). The group cannot be joined again: start every rank again.

Another rank follows in one of two ways. :meth:`DistributedModel.follow` runs rank 0's jobs until rank 0
closes the model (a server's other ranks). Or the same script runs on every rank: each call that does MLX
work (``generate``, ``stream``, ``logits``, a session's turn) runs rank 0's job for the same call and returns
the same result (tokens, text, logits, report counts); its own arguments are only checked as rank 0's are.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import count
from typing import Any, Literal

import mlx.core as mx

from ..cache import LayerCache
from ..constraints import Constraint
from ..errors import DistributedError, GenerationError, ImageError, MlxchatError
from ..generation import GenerationChunk, GenerationConfig
from ..limits import check_token_ids
from ..model import GenerativeModel, ImageInput, _evaluated
from ..multimodal import MultimodalPrompt, VisionModule
from ..prompt_cache import DEFAULT_MAX_SNAPSHOTS, PromptCache
from ..worker import Cancelled, Together
from .channel import END, JOB, Channel, FollowerCancel, LeaderCancel, LeaderEnded
from .group import Mode, close_connections
from .watchdog import DEFAULT_TIMEOUT, Watchdog


class SharedPromptCache(PromptCache):
    """A distributed model's prompt cache: ``snapshot()`` and ``clear()`` called outside a generation (a
    session's turn end) are made on every rank, so that the ranks' copies stay the same (and so it shares no
    prefixes with other caches, which only rank 0 would see)."""

    shares_prefixes = False

    def __init__(self, model: DistributedModel, max_snapshots: int,
                 layers: tuple[Callable[[], list[LayerCache]], tuple[int, int] | None]):
        super().__init__(layers[0], max_snapshots, layers[1])
        self._model = model

    def snapshot(self) -> None:
        self._model._cache_call(self, "snapshot")

    def clear(self) -> None:
        self._model._cache_call(self, "clear")


class DistributedModel(GenerativeModel):
    """A :class:`~mlxchat.model.GenerativeModel` whose module is this rank's part of a model split over
    ``group`` (``mode`` "tensor" or "pipeline"); see the module docstring for how the ranks keep in step and
    what ``timeout`` bounds. Split models read text only."""

    def __init__(self, *, group: mx.distributed.Group, mode: Mode, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any):
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
        self._watchdog = Watchdog(timeout, self._timed_out)  # armed on rank 0 only
        atexit.register(_close, weakref.ref(self))  # runs before the workers' own exit hook

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, {self.mode} parallel, rank {self.rank} of {self.size})"

    @property
    def leads(self) -> bool:
        """Whether this is rank 0, which starts every job."""
        return self.rank == 0

    # -- jobs ---------------------------------------------------------------------------------------

    def make_prompt_cache(self, max_snapshots: int = DEFAULT_MAX_SNAPSHOTS, *, kv_bits: int | None | Literal["model"]
                          = "model", kv_group_size: int | None = None) -> PromptCache:
        return SharedPromptCache(self, max_snapshots, self.layer_caches(kv_bits, kv_group_size))

    def logits(self, token_ids: Sequence[int] | MultimodalPrompt,
               images: Sequence[ImageInput] | None = None) -> mx.array:
        """Rank 0's logits on every rank (see :meth:`GenerativeModel.logits`); text only."""
        ids = check_token_ids(self._text(token_ids, images), self.config.vocab_size, "token id")

        def run() -> mx.array:
            with self._group_work():
                return self._logits_of(self._job({"op": "logits", "ids": ids})["ids"])

        return self.worker.run(run)

    def run_generation(self, prompt: Sequence[int] | MultimodalPrompt, cache: PromptCache, config: GenerationConfig,
                       cancel: Cancelled, snapshot_at: Sequence[int] = (),
                       constraint: Constraint | None = None) -> Iterator[GenerationChunk | Together]:
        """The generation loop on every rank (see :meth:`GenerativeModel.run_generation`): on rank 0 as asked,
        on the others as rank 0 asked, each with its own copy of the prompt cache. Only rank 0 follows a
        ``constraint``: the others take its tokens."""
        ids = check_token_ids(self._text(prompt), self.config.vocab_size, "prompt token id")
        check_token_ids(config.logit_bias, self.config.vocab_size, "logit_bias token id")
        config = self.fit(len(ids), config)
        if not self.leads:
            yield from self._follow_generation(self._job(None, "generate"), cache)
            return
        self._watchdog.arm()
        self._job({"op": "generate", "prompt": ids, "config": config.model_dump(mode="json"),
                   "snapshot_at": list(snapshot_at), **self._cache_key(cache)})
        finished = lost = False
        self._in_job = True
        try:
            for item in super().run_generation(ids, cache, config, LeaderCancel(cancel, self.channel), snapshot_at,
                                               constraint):
                if isinstance(item, GenerationChunk):
                    self._watchdog.disarm()  # with the reader, who takes their time
                yield item
                self._watchdog.arm()
            finished = True
        except GenerationError as exc:  # inside MLX: the ranks are out of step
            lost = True
            raise self._lose(f"MLX failed during a generation ({exc})") from exc
        finally:
            self._in_job = False
            self._watchdog.disarm()
            if not finished and not lost:  # the reader left early: the others stop at their next check
                self.channel.post(END)

    def follow(self) -> None:
        """Run rank 0's jobs until rank 0 closes the model (for a rank with nothing else to do, like a
        server's other ranks); then this model is closed too."""
        if self.leads:
            raise DistributedError("rank 0 leads the other ranks; follow() is for ranks 1 and up")
        self.worker.run(self._follow)
        self.close()

    def close(self) -> None:
        """Close the model on every rank: rank 0 tells the others, which close when they read it (a model whose
        group is lost just closes)."""
        if not self._done:
            self._done = True
            if not self.leads:
                self.worker.run(lambda: self._job(None, "close"))
            else:
                try:
                    self.worker.run(self._close_group)
                except DistributedError:  # the group is lost: there is nobody to tell
                    pass
            self._watchdog.stop()
        super().close()

    # -- a lost group -------------------------------------------------------------------------------

    @contextmanager
    def _group_work(self) -> Iterator[None]:
        """Rank 0's work with the group outside a generation: under the deadline, and lost on a failure inside
        MLX."""
        self._watchdog.arm()
        try:
            yield
        except MlxchatError:
            raise
        except Exception as exc:
            raise self._lose(f"MLX failed ({exc})") from exc
        finally:
            self._watchdog.disarm()

    def _close_group(self) -> None:
        with self._group_work():
            self.channel.post(JOB, {"op": "close"}, wait=True)

    def _timed_out(self) -> None:
        """On the watchdog's thread: no step completed within the deadline."""
        self._lose(f"no answer from the other ranks for {self._watchdog.timeout:g} s (the distributed timeout)")

    def _lose(self, cause: str) -> DistributedError:
        """End this model on rank 0 for good: its jobs fail, later calls are refused, the group's connections
        are shut (the others' collectives with this rank fail). Returns the error the jobs got."""
        error = DistributedError(f"rank 0 lost its process group: {cause}. A rank died or stopped answering, or the "
                                 "ranks fell out of step; this model is closed: start every rank again")
        self.worker.fail(error)
        self._watchdog.stop()
        close_connections(self.group)
        return error

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
                           cache: PromptCache | None) -> Iterator[GenerationChunk | Together]:
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

    def _cache_key(self, cache: PromptCache) -> dict[str, Any]:
        """How the other ranks know ``cache`` (a key rank 0 gives it on first use) and size their copy."""
        key = self._keys.get(cache)
        if key is None:
            key = self._keys[cache] = next(self._new_key)
            weakref.finalize(cache, self._dropped.append, key)
        return {"cache": key, "max_snapshots": cache.max_snapshots, "kv_format": cache.kv_format}

    def _copy(self, job: dict[str, Any], cache: PromptCache | None) -> PromptCache:
        """This rank's copy of rank 0's cache ``job["cache"]``: the one seen before, else ``cache`` (the same
        call's own cache, when every rank runs the same script) or a new one."""
        key = job["cache"]
        if key not in self._copies:
            kv_format = job.get("kv_format")
            copy = cache if cache is not None else self.make_prompt_cache(
                kv_bits=kv_format[0] if kv_format else None, kv_group_size=kv_format[1] if kv_format else None)
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
                with self._group_work():
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
