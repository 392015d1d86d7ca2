"""A turn's plan: what the model is sent, and where its prefill takes snapshots.

A turn is planned on the reader's side (the thread iterating the stream, or a thread beside the event loop)
before its job reaches the model's worker, so rendering, tokenizing and image preprocessing never hold up
the steps other sessions share. The plan renders the whole visible conversation once; the cache then cuts
back to the longest prefix it holds (:class:`~mlxchat.prompt_cache.PromptCache`). Caches that cannot be cut
back (sliding windows, conv and DeltaNet states) restore a snapshot instead, so the plan also says where
snapshots will pay off: where later renders of this conversation part from this prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .constraints import reasoning_section
from .errors import TemplateError
from .generation import GenerationConfig
from .images import ProcessedImage
from .multimodal import MultimodalPrompt, expand_images, split_image_parts
from .prompt_cache import PromptCache, common_prefix_length
from .session_state import SessionState, after_system
from .session_types import SessionCapableModel
from .tools.schema import ToolSpec


@dataclass(frozen=True)
class TurnPlan:
    """One reply's prompt and where its prefill takes snapshots (see :meth:`TurnPlanner.plan`)."""

    config: GenerationConfig
    prompt: list[int] | MultimodalPrompt
    in_reasoning: bool
    """The generation prompt opened a reasoning block: the reply starts inside it."""
    snapshot_at: list[int]
    reasoning: tuple[str, str] | None = None
    """Where the reply may reason, for a constraint that starts after it (see
    :attr:`mlxchat.constraints.Constraint.reasoning`)."""
    hidden: int = 0
    """How many of the oldest messages after the system turn the prompt leaves out (``truncate_oldest``)."""


class TurnPlanner:
    """Plans the turns of one session over ``model``; each image is preprocessed once (keyed by its
    ``data:`` URL), however many turns render it."""

    def __init__(self, model: SessionCapableModel):
        self._model = model
        self._images: dict[Any, ProcessedImage] = {}

    def processed(self, source: Any) -> ProcessedImage:
        """An image as the model reads it."""
        if source not in self._images:
            self._images[source] = self._model.process_image(source)
        return self._images[source]

    def plan(self, state: SessionState, cache: PromptCache, override: GenerationConfig | None,
             tools: list[ToolSpec]) -> TurnPlan:
        """What the next reply to ``state``'s conversation sends the model: one rendering of the visible
        conversation (text and ids, images expanded to their placeholders), plus the text of its head to see
        whether the generation prompt opens a reasoning block; and, for caches that cannot be cut back, where
        snapshots pay off: just before the last prompt token (a regenerate returns there), where the next
        turn's render will part from this prompt, before earlier replies the cache does not hold yet, and
        before each image (a changed image then costs only what follows it)."""
        config = state.default_config.merged(override)
        kwargs = dict(config.chat_template_kwargs)
        if config.enable_thinking is not None:
            kwargs["enable_thinking"] = config.enable_thinking
        history, sources, text, prompt, hidden = self._fitted_prompt(state, config, tools, kwargs)
        head = self._model.render_text(history, tools=tools or None, add_generation_prompt=False, **kwargs)
        generation_prompt = text[len(head):] if text.startswith(head) else text
        markers = self._model.reasoning_markers
        inside = markers is not None and generation_prompt.rfind(markers[0]) > generation_prompt.rfind(markers[1])
        snapshot_at: set[int] = set()
        if cache.needs_snapshots:
            ids = _ids(prompt)
            snapshot_at = {len(ids) - 1, *self._next_turn_agrees(history, sources, tools, kwargs, ids),
                           *self._reply_starts(cache, history, sources, tools, kwargs, ids)}
            if isinstance(prompt, MultimodalPrompt):
                snapshot_at |= {span.start for span in prompt.images}
        return TurnPlan(config=config, prompt=prompt, in_reasoning=inside, snapshot_at=sorted(snapshot_at),
                        reasoning=reasoning_section(generation_prompt, markers), hidden=hidden)

    def _fitted_prompt(self, state: SessionState, config: GenerationConfig, tools: list[ToolSpec],
                       kwargs: dict[str, Any]
                       ) -> tuple[list[dict[str, Any]], list[Any], str, list[int] | MultimodalPrompt, int]:
        """The visible history (as the template sees it, images reduced to markers), its images, its prompt
        (text and ids), and how many messages it hides: under ``truncate_oldest``, the oldest whole turns
        after the system turn, until the prompt leaves room for ``max_tokens`` or a quarter of the context."""
        rest = after_system(state.messages)
        head = state.messages[: len(state.messages) - len(rest)]
        hidden = state.hidden
        while True:
            history, sources = split_image_parts([m.template_dict() for m in head + rest[hidden:]])
            text, prompt = self._rendered(history, sources, tools, kwargs, add_generation_prompt=True)
            room = min(config.max_tokens, self._model.context_length // 4)
            later_turn = next((i for i, m in enumerate(rest) if i > hidden and m.role == "user"), None)
            if (state.context_policy == "error" or len(prompt) + room <= self._model.context_length
                    or later_turn is None):
                return history, sources, text, prompt, hidden
            hidden = later_turn

    def _rendered(self, messages: list[dict[str, Any]], sources: list[Any], tools: list[ToolSpec],
                  kwargs: dict[str, Any], add_generation_prompt: bool) -> tuple[str, list[int] | MultimodalPrompt]:
        """Messages (images reduced to ``{"type": "image"}``) as text and as a prompt whose images, the first
        of ``sources``, are expanded to their placeholder tokens as the model's processor does."""
        text, ids = self._model.render_prompt(messages, tools=tools or None,
                                              add_generation_prompt=add_generation_prompt, **kwargs)
        count = sum(isinstance(m.get("content"), list) and sum(p.get("type") == "image" for p in m["content"])
                    for m in messages)
        if not count:
            return text, ids
        images = [self.processed(source) for source in sources[:count]]
        return text, expand_images(ids, images, self._model.image_tokens)

    def _next_turn_agrees(self, history: list[dict[str, Any]], sources: list[Any], tools: list[ToolSpec],
                          kwargs: dict[str, Any], prompt: list[int]) -> list[int]:
        """How far the next turn's render will agree with this prompt: templates re-render a reply once a
        later turn exists (Qwen3.5 drops its reasoning, so the new render parts right after
        ``<|im_start|>assistant\\n``). Probed with a placeholder reply and question."""
        probe = history + [{"role": "assistant", "content": "\ue002"}, {"role": "user", "content": "\ue002"}]
        try:
            rendered = self._rendered(probe, sources, tools, kwargs, add_generation_prompt=False)[1]
        except TemplateError:
            return []
        return [common_prefix_length(_ids(rendered), prompt)]

    def _reply_starts(self, cache: PromptCache, history: list[dict[str, Any]], sources: list[Any],
                      tools: list[ToolSpec], kwargs: dict[str, Any], prompt: list[int]) -> set[int]:
        """Where the turns before earlier replies end in ``prompt``, beyond what the cache holds (a primed
        transcript, an edit): templates re-render a reply differently once a later user turn exists (they
        drop its reasoning), so a cache that cannot be cut back wants a snapshot just before each reply,
        and one after the system prompt, which a reset conversation starts from again.

        One render per reply, latest first, and at most as many as the cache keeps snapshots: it keeps the
        latest positions (and takes more after these: at the prompt's end, at the reply's), so a snapshot at
        an earlier start would be dropped by the end of the turn. A cold cache under a long transcript thus
        costs a bounded number of renders, not one per reply, and keeps the same snapshots."""
        held = common_prefix_length(cache.tokens, prompt)

        def ids(messages: list[dict[str, Any]]) -> list[int]:
            return _ids(self._rendered(messages, sources, tools, kwargs, add_generation_prompt=False)[1])

        starts: set[int] = set()
        for index in range(len(history) - 1, 1, -1):
            if history[index]["role"] != "assistant":
                continue
            try:
                starts.add(common_prefix_length(ids(history[:index]), prompt))
            except TemplateError:  # a prefix this template refuses to render: no snapshot there
                continue
            if min(starts) <= held or len(starts) >= cache.max_snapshots:
                return starts
        if history and history[0]["role"] == "system":
            # Some templates refuse a system turn alone: two probes that differ only in the user's words
            # agree exactly up to where that turn's content starts.
            try:
                probes = [ids(history[:1] + [{"role": "user", "content": text}]) for text in ("a", "b")]
            except TemplateError:
                return starts
            starts.add(min(common_prefix_length(*probes), common_prefix_length(probes[0], prompt)))
        return starts


def _ids(prompt: list[int] | MultimodalPrompt) -> list[int]:
    return list(prompt.ids) if isinstance(prompt, MultimodalPrompt) else prompt
