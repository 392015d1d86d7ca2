"""``GenerativeModel``: a loaded checkpoint, its tokenizer and chat template, and the worker that runs it."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from pydantic import BaseModel, ConfigDict

from . import profiling
from .architecture import Architecture, ModelModule
from .batching import DEFAULT_PREFILL_STEP_BUDGET, lockstep
from .cache import KV_HALF, LayerCache, check_kv_format, kv_formatted
from .chat_template import ChatTemplate
from .config import ModelConfig
from .constraints import (
    Constraint,
    RowMatcher,
    TokenTable,
    markup,
    reasoning_section,
    response_constraint,
    token_table,
)
from .errors import (
    CheckpointError,
    ContextLengthError,
    GenerationError,
    ImageError,
    InvalidInputError,
    MlxchatError,
    TemplateError,
)
from .generation import GenerationChunk, GenerationConfig, GenerationResult, stream_generation
from .images import ImageProcessor, ImageSource, ProcessedImage
from .layers.rope import context_limit
from .limits import check_text, check_token_ids
from .multimodal import (
    ImageTokens,
    MultimodalPrompt,
    VisionModule,
    chunk_bounds,
    encode_images,
    expand_images,
    split_image_parts,
)
from .pacing import DEFAULT_DECODE_SLOWDOWN, StepPace
from .prefix_cache import PromptCachePool
from .prompt_cache import DEFAULT_MAX_SNAPSHOTS, PromptCache
from .speculative import Drafter, ModelDrafter, MtpDrafter
from .tokenizer import Tokenizer
from .worker import Cancelled, Together, Worker

if TYPE_CHECKING:
    from .session import ChatSession
    from .tools.parsing import ToolCallParser
    from .tools.schema import ToolSpec

Prompt = str | Sequence[int]
ImageInput = ImageSource | ProcessedImage
"""An image as a path, encoded bytes, a ``PIL.Image``, a ``data:`` URL, or already preprocessed."""
AnyPrompt = Prompt | Sequence[Any] | MultimodalPrompt
"""Raw text or ids, chat messages, or a prompt with images."""


class Capabilities(BaseModel):
    """What a loaded model can do."""

    model_config = ConfigDict(frozen=True)

    supports_tools: bool
    """Tools can be offered: the chat template renders them and the family has a call format."""
    supports_images: bool
    """Images can be sent: the checkpoint has a vision tower."""
    supports_reasoning: bool
    """The model reasons between markers the chat template knows; replies keep it apart."""
    context_length: int
    """The most tokens (prompt and reply) a generation may hold: the checkpoint's limit (scaled RoPE
    included, :func:`mlxchat.layers.rope.context_limit`) unless ``load_model(context_length=...)`` set less."""
    context_reason: str
    """Where ``context_length`` comes from, e.g. ``"yarn RoPE: factor 4 x original_max_position_embeddings
    32768"``."""
    default_generation: GenerationConfig
    """The generation settings a request starts from (the checkpoint's generation_config.json)."""


class GenerativeModel:
    """A model ready to generate. Sessions over it share its worker thread, which decodes them together.

    The worker owns the module: it built and evaluated it (:func:`mlxchat.load_model`), and every MLX
    operation on it runs there, so no lazy array ever crosses threads.
    """

    def __init__(
        self,
        *,
        module: ModelModule,
        config: ModelConfig,
        architecture: Architecture,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate | None,
        defaults: GenerationConfig,
        eos_ids: set[int],
        worker: Worker,
        path: Path | None = None,
        dtype: mx.Dtype = mx.float32,
        quantization: dict[str, Any] | None = None,
        context_length: int | None = None,
        image_processor: ImageProcessor | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        prefill_step_budget: int = DEFAULT_PREFILL_STEP_BUDGET,
        max_decode_slowdown: float | None = DEFAULT_DECODE_SLOWDOWN,
    ):
        """``context_length``: the most tokens (prompt and reply) a generation may hold; by default, and at
        most, the checkpoint's limit: ``max_position_embeddings``, stretched by a linear, dynamic or yarn RoPE
        scaling (:func:`~mlxchat.layers.rope.context_limit`); more is a :class:`ContextLengthError`.
        ``prefill_step_budget`` and ``max_decode_slowdown``: see the attributes."""
        self.module = module
        self.config = config
        self.architecture = architecture
        self.tokenizer = tokenizer
        if chat_template is not None and image_processor is not None and isinstance(module, VisionModule):
            chat_template = ChatTemplate(chat_template.source, tokenizer, _placeholders(tokenizer, module))
        self.chat_template = chat_template
        self.defaults = defaults
        self.eos_ids = eos_ids
        self.path = path
        self.dtype = dtype
        self.quantization = quantization
        if context_length is not None and context_length < 2:
            raise ValueError(f"context_length must be at least 2, got {context_length}")
        limit, reason = context_limit(config)
        if context_length is not None and context_length > limit:
            raise ContextLengthError(f"context_length {context_length} is more than this model serves: {limit} "
                                     f"({reason})")
        self.context_length = limit if context_length is None else context_length
        self.context_reason = reason if context_length is None or context_length == limit else \
            f"context_length={context_length} (the model serves {limit}: {reason})"
        if kv_bits is not None:
            check_kv_format(kv_bits, kv_group_size)
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.image_processor = image_processor
        """Preprocessing for the vision tower (``None``: the model reads no images)."""
        self.worker = worker
        if isinstance(prefill_step_budget, bool) or not isinstance(prefill_step_budget, int) \
                or prefill_step_budget < 1:
            raise ValueError(f"prefill_step_budget must be a positive number of tokens, got {prefill_step_budget!r}")
        self.prefill_step_budget = prefill_step_budget
        """Most prompt tokens one worker step prefills (beside a decode token for every running generation): a
        long prompt goes in a chunk a step, so the streams already running wait at most about that many tokens'
        prefill for each of their tokens (:class:`~mlxchat.batching.PrefillChunk`)."""
        pace = StepPace(max_decode_slowdown) if max_decode_slowdown is not None else None  # checked on any model
        self.step_pace = pace if getattr(module, "runs_ragged", False) else None
        """What keeps a step that prefills beside running streams within ``max_decode_slowdown`` times the cost
        of their own step, learnt from the worker's steps (:mod:`mlxchat.pacing`; ``None``: only the budget
        bounds a step, or the model's steps are not one pass)."""
        self.prefix_cache: PromptCachePool | None = None
        """A pool every session :meth:`chat_session` makes shares its prompt prefixes through (``None``: each
        session keeps its own; see :mod:`mlxchat.prefix_cache`)."""
        self.draft: GenerativeModel | Literal["mtp"] | None = None
        """What drafts for speculative decoding (:meth:`with_draft`): a smaller model, the checkpoint's own
        multi-token-prediction head (``"mtp"``), or nothing."""
        self._drafter: Drafter | None = MtpDrafter(module) if getattr(module, "has_mtp", False) else None
        self._owns_draft = False
        self.adapter: str | None = None
        """The LoRA adapter applied unfused (its folder or repo), if any (:meth:`load_adapter`)."""
        self.weights_version = 0
        """Counts changes of the weights the model computes with (an adapter made, loaded, removed or fused, a
        training run): prompt caches filled under another version are not reused (their prefixes would hold
        another model's keys and values)."""
        self._adapter_digest: tuple[int, str] = (-1, "none")

    def __repr__(self) -> str:
        return f"GenerativeModel({self.architecture.name}, {self.path}, dtype={self.dtype})"

    # -- capabilities -------------------------------------------------------------------------------

    @property
    def supports_tools(self) -> bool:
        """Whether tools can be offered: the template renders them and the family has a call format."""
        return bool(self.chat_template and self.chat_template.takes_tools and self.architecture.chat.tool_format)

    @property
    def supports_images(self) -> bool:
        return self.image_processor is not None

    @property
    def capabilities(self) -> Capabilities:
        markers = self.reasoning_markers
        reasoning = bool(markers and self.chat_template and markers[0].strip() in self.chat_template.source)
        return Capabilities(supports_tools=self.supports_tools, supports_images=self.supports_images,
                            supports_reasoning=reasoning, context_length=self.context_length,
                            context_reason=self.context_reason,
                            default_generation=self.defaults.model_copy(deep=True))

    # -- prompts ------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[ToolSpec | dict[str, Any] | Any] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """Render OpenAI-style messages through the checkpoint's chat template, as transformers does.

        ``tokenize=True`` gives token ids in which message content is data (control-token text typed by a
        user stays text); ``tokenize=False`` gives the rendered string.
        """
        if not tokenize:
            return self.render_text(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    **template_kwargs)
        return self.render_prompt(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                  **template_kwargs)[1]

    def render_prompt(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> tuple[str, list[int]]:
        """The chat prompt as text and as safe token ids (one rendering)."""
        template, schemas, kwargs = self._template_call(tools, template_kwargs)
        return template.render_encoded(messages, tools=schemas, add_generation_prompt=add_generation_prompt,
                                       **kwargs)

    def render_text(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The chat prompt as text only (no tokenizing)."""
        template, schemas, kwargs = self._template_call(tools, template_kwargs)
        return template.render(messages, tools=schemas, add_generation_prompt=add_generation_prompt, **kwargs)

    def generation_prompt(self, messages: Sequence[Any], *, tools: Sequence[Any] | None = None,
                          **template_kwargs: Any) -> str:
        """The text the chat template writes after ``messages`` to open the reply (``<|im_start|>assistant``,
        say, with a reasoning block it opened, or opened and closed)."""
        text = self.render_text(messages, tools=tools, add_generation_prompt=True, **template_kwargs)
        head = self.render_text(messages, tools=tools, add_generation_prompt=False, **template_kwargs)
        return text[len(head):] if text.startswith(head) else text

    def _template_call(self, tools: Sequence[Any] | None,
                       template_kwargs: dict[str, Any]) -> tuple[ChatTemplate, list[Any] | None, dict[str, Any]]:
        if self.chat_template is None:
            raise TemplateError(f"{self.path or 'this model'} has no chat template (chat_template.jinja or "
                                "tokenizer_config.json)")
        from .tools.schema import tool_schemas

        schemas = tool_schemas(tools) if tools else None
        return self.chat_template, schemas, {**self.architecture.chat.template_kwargs, **template_kwargs}

    def tool_parser(self, tools: Sequence[ToolSpec]) -> ToolCallParser | None:
        """A fresh parser for this family's tool-call format, knowing the offered tools."""
        from .registry import registry

        name = self.architecture.chat.tool_format
        if not tools or name is None:
            return None
        parsers = registry().tool_parsers()
        if name not in parsers:
            raise MlxchatError(f"tool-call format {name!r} is not registered (known: {', '.join(parsers)})")
        return parsers[name](tools)

    def call_markup(self, text: str) -> str:
        """A piece of tool-call markup in a grammar: its control token when ``text`` is one."""
        return markup(self.tokenizer, text)

    @property
    def token_table(self) -> TokenTable:
        """The vocabulary as the grammar engine reads it, built on first use and kept (see
        :mod:`mlxchat.constraints`)."""
        return token_table(self, self.tokenizer, self.config.vocab_size, sorted(self.eos_ids))

    @property
    def reasoning_markers(self) -> tuple[str, str] | None:
        return self.architecture.chat.reasoning

    @property
    def renders_tool_calls(self) -> bool:
        return self.chat_template is not None and self.chat_template.renders_tool_calls

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a raw text prompt (with the BOS the tokenizer adds), or the ids given (checked)."""
        if isinstance(prompt, str):
            with profiling.span("tokenize"):
                ids = self.tokenizer.encode(check_text(prompt, "the prompt"), add_special_tokens=True)
        else:
            ids = check_token_ids(prompt, self.config.vocab_size, "prompt token id")
        if not ids:
            raise InvalidInputError("cannot generate from an empty prompt")
        return ids

    def fit(self, prompt_length: int, config: GenerationConfig) -> GenerationConfig:
        """``config`` with ``max_tokens`` lowered to what the context leaves after the prompt; a prompt that
        leaves no room for a single token is a :class:`ContextLengthError`."""
        room = self.context_length - prompt_length
        if room < 1:
            raise ContextLengthError(
                f"the prompt has {prompt_length} tokens, but this model's context holds {self.context_length} "
                f"(prompt and reply together); shorten the conversation"
            )
        return config if config.max_tokens <= room else config.model_copy(update={"max_tokens": room})

    # -- images -------------------------------------------------------------------------------------

    def process_image(self, image: ImageInput) -> ProcessedImage:
        """An image as this model's vision tower reads it (an image already processed passes through)."""
        self._vision()
        assert self.image_processor is not None
        return image if isinstance(image, ProcessedImage) else self.image_processor(image)

    def image_prompt(self, prompt: Prompt | Sequence[Any], images: Sequence[ImageInput] = (), *,
                     tools: Sequence[Any] | None = None, **template_kwargs: Any) -> MultimodalPrompt:
        """Token ids with each image's placeholders in place, from a raw prompt (text or ids) holding one
        image marker per image (``<|image_pad|>``, ``<|image|>``), or from chat messages whose image
        content parts carry the images (parts without one take the next of ``images``), rendered through
        the chat template with a generation prompt."""
        if _is_messages(prompt):
            messages, sources = split_image_parts(prompt, images)
            ids = self.render_prompt(messages, tools=tools, **template_kwargs)[1]
        else:
            ids, sources = self.encode(prompt), list(images)  # type: ignore[arg-type]
        processed = [self.process_image(image) for image in sources]
        if not processed:
            return MultimodalPrompt(tuple(ids))
        return expand_images(ids, processed, self._vision().image_tokens)

    @property
    def image_tokens(self) -> ImageTokens:
        """How this model's prompts write an image in token ids (models with a vision tower only)."""
        return self._vision().image_tokens

    def _vision(self) -> VisionModule:
        module = self.module
        if self.image_processor is None or not isinstance(module, VisionModule):
            raise ImageError(f"{self.architecture.name} checkpoint {self.path} reads no images (it has no "
                             "vision tower)")
        return module

    def _checked(self, prompt: MultimodalPrompt) -> MultimodalPrompt:
        if prompt.images:
            prompt.check(self._vision().image_tokens.marker)
        return prompt

    # -- speculative decoding -------------------------------------------------------------------------

    @property
    def has_mtp(self) -> bool:
        """Whether the checkpoint has a multi-token-prediction head (it drafts when ``draft_tokens`` is set
        and no draft model is given)."""
        return bool(getattr(self.module, "has_mtp", False))

    @property
    def drafter(self) -> Drafter | None:
        """What proposes tokens when a request sets ``draft_tokens``: :attr:`draft`'s, or the checkpoint's
        multi-token-prediction head (``None``: nothing drafts)."""
        return self._drafter

    def with_draft(self, draft: GenerativeModel | Literal["mtp"], draft_tokens: int = 4) -> GenerativeModel:
        """This model (same weights, worker and sessions' caches) decoding speculatively: ``draft`` proposes
        ``draft_tokens`` tokens per pass (the default ``GenerationConfig.draft_tokens`` from now on; a
        request may change it, 0 turns it off). ``draft`` is a smaller model sharing this one's tokenizer,
        or ``"mtp"``, this checkpoint's multi-token-prediction head.

        The draft runs on this model's worker; its own worker stays idle (close it with this model's by
        loading it through :func:`mlxchat.load_model`'s ``draft=``).
        """
        defaults = self.defaults.merged({"draft_tokens": draft_tokens})  # (checked first: 0 to 16)
        if draft == "mtp":
            if not self.has_mtp:
                raise CheckpointError(f"{self.path or 'this model'} has no multi-token-prediction head (mtp.* "
                                      "weights); give a draft model instead")
            drafter: Drafter = MtpDrafter(self.module)
        elif isinstance(draft, GenerativeModel):
            self._check_draft(draft)
            drafter = ModelDrafter(draft.module, self.config.vocab_size, draft.config.vocab_size)
        else:
            raise InvalidInputError(f'draft must be a GenerativeModel or "mtp", got {draft!r}')
        model = copy.copy(self)
        model.draft, model._drafter = draft, drafter
        model.defaults = defaults
        return model

    def _check_draft(self, draft: GenerativeModel) -> None:
        mine = self.tokenizer.backend.get_vocab(with_added_tokens=True)
        theirs = draft.tokenizer.backend.get_vocab(with_added_tokens=True)
        if mine != theirs:
            differ = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
            raise CheckpointError(
                f"the draft {draft.path or draft} does not share this model's tokenizer ({len(theirs)} tokens "
                f"against {len(mine)}; e.g. {', '.join(f'{t!r}: {i}' for t, i in differ)}): a draft must "
                "tokenize exactly as the model does")

    def _drafter_for(self, config: GenerationConfig, prompt_length: int) -> Drafter | None:
        if not config.draft_tokens:
            return None
        if self._drafter is None:
            raise InvalidInputError("draft_tokens needs a draft: load_model(..., draft=...) or "
                                    "model.with_draft(draft_model), or a checkpoint with an MTP head")
        window = self.config.max_position_embeddings
        if getattr(getattr(self.config, "rope", None), "rope_type", None) == "dynamic" \
                and prompt_length + config.max_tokens > window:
            raise InvalidInputError(
                f"speculative decoding cannot run past this model's dynamic-NTK window ({window} tokens; this "
                f"generation may reach {prompt_length + config.max_tokens}): it verifies drafted tokens in one "
                "forward, whose keys dynamic NTK rotates with one base where plain decoding uses one per token, so "
                "the output would differ; decode without draft_tokens, or keep within the window")
        return self._drafter

    # -- running ------------------------------------------------------------------------------------

    def make_prompt_cache(self, max_snapshots: int = DEFAULT_MAX_SNAPSHOTS, *, kv_bits: int | None | Literal["model"]
                          = "model", kv_group_size: int | None = None) -> PromptCache:
        """A fresh, empty prompt cache (made on the caller's thread: it holds no arrays until a prefill, so it
        never waits for the worker). ``kv_bits``: its KV format, by default the model's (``load_model``'s
        ``kv_bits``); ``None`` is float keys and values in the compute dtype, 16 float16, 2-8 bits quantized
        (``kv_group_size``, by default the model's)."""
        make_layers, kv_format = self.layer_caches(kv_bits, kv_group_size)
        return PromptCache(make_layers, max_snapshots, kv_format, lambda: self.weights_version)

    def layer_caches(self, kv_bits: int | None | Literal["model"] = "model", kv_group_size: int | None = None
                     ) -> tuple[Callable[[], list[LayerCache]], tuple[int, int] | None]:
        """What makes a prompt cache's layer caches in a KV format (see :meth:`make_prompt_cache`), and the
        format (``(bits, group_size)``, ``None`` for float)."""
        bits = self.kv_bits if kv_bits == "model" else kv_bits
        if bits is None:
            return self.module.make_cache, None
        group_size = self.kv_group_size if kv_group_size is None else kv_group_size
        if bits == KV_HALF:
            group_size = 0  # no groups: one format whatever the group size asked (prefixes shared across it)
        return kv_formatted(self.module.make_cache, bits, group_size), (bits, group_size)

    def logits(self, token_ids: Sequence[int] | MultimodalPrompt,
               images: Sequence[ImageInput] | None = None) -> mx.array:
        """Float32 logits ``[len, vocab]`` of one cache-free forward pass (research and parity tests).

        With ``images`` the ids hold one image marker per image (see :meth:`image_prompt`); the logits
        are those of the expanded prompt.
        """
        if images is None and not isinstance(token_ids, MultimodalPrompt):
            ids = [check_token_ids(token_ids, self.config.vocab_size, "token id")]
            # Arrays are built on the worker: MLX ops belong to the stream of the thread that creates them.
            return self.worker.run(lambda: _evaluated(self.module(mx.array(ids))[0].astype(mx.float32)))
        if isinstance(token_ids, MultimodalPrompt):
            check_token_ids(token_ids.ids, self.config.vocab_size, "token id")
            prompt = self._checked(token_ids)
        else:
            prompt = self.image_prompt(token_ids, images or [])
        module = self.module

        def run() -> mx.array:
            inputs = {}
            if prompt.images:
                vision = self._vision()
                inputs = vision.image_inputs(prompt, 0, len(prompt), encode_images(vision, prompt.images))
            return _evaluated(module(mx.array(prompt.ids)[None], None, **inputs)[0].astype(mx.float32))

        return self.worker.run(run)

    def stream(
        self, prompt: AnyPrompt, config: GenerationConfig | dict[str, Any] | None = None,
        *, images: Sequence[ImageInput] | None = None, cache: PromptCache | None = None,
    ) -> Iterator[GenerationChunk]:
        """Stream a generation: text chunks, the last one with the report. ``cache`` (a prompt cache of
        this model) carries state between calls; without one every call starts fresh.

        ``prompt`` is raw text or token ids, chat messages (rendered with a generation prompt), or a
        :class:`~mlxchat.multimodal.MultimodalPrompt`; ``images`` go with a raw prompt's image markers
        or the messages' image parts (see :meth:`image_prompt`).
        """
        return self._stream(prompt, config, images, cache, paced=True)

    def _stream(self, prompt: AnyPrompt, config: GenerationConfig | dict[str, Any] | None,
                images: Sequence[ImageInput] | None, cache: PromptCache | None, *, paced: bool
                ) -> Iterator[GenerationChunk]:
        merged = self.defaults.merged(config)
        return self.worker.stream(self._work(prompt, images, merged, cache), paced=paced)

    async def astream(
        self, prompt: AnyPrompt, config: GenerationConfig | dict[str, Any] | None = None,
        *, images: Sequence[ImageInput] | None = None, cache: PromptCache | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        merged = self.defaults.merged(config)
        async for chunk in self.worker.astream(self._work(prompt, images, merged, cache)):
            yield chunk

    def generate(
        self, prompt: AnyPrompt, config: GenerationConfig | dict[str, Any] | None = None,
        *, images: Sequence[ImageInput] | None = None, cache: PromptCache | None = None,
    ) -> GenerationResult:
        return _collect(self._stream(prompt, config, images, cache, paced=False))  # taken to the end: unpaced

    def generate_batch(self, prompts: Sequence[AnyPrompt],
                       config: GenerationConfig | dict[str, Any] | Sequence[GenerationConfig | dict[str, Any]] | None
                       = None) -> list[GenerationResult]:
        """One result per prompt (raw text or token ids, chat messages, or a prompt with images), the
        prompts decoded together: all of them are prefilled first, then each step is one pass over the weights
        for every prompt still generating (:func:`~mlxchat.batching.lockstep`). The same results as
        :meth:`generate` on each prompt alone (greedy: token for token). ``config`` may be a list, one per
        prompt (a temperature and seed per row, say)."""
        if isinstance(config, Sequence):
            if len(config) != len(prompts):
                raise InvalidInputError(f"{len(config)} generation configs for {len(prompts)} prompts")
            configs = [self.defaults.merged(c) for c in config]
        else:
            configs = [self.defaults.merged(config)] * len(prompts)
        works = [self._work(prompt, None, each, None) for prompt, each in zip(prompts, configs, strict=True)]

        def produce(cancel: Cancelled) -> Iterator[Any]:
            outputs = yield from lockstep([work(cancel) for work in works])
            yield [_collect(iter(chunks)) for chunks in outputs]

        if not works:
            return []
        (results,) = self.worker.stream(produce)
        return results

    async def agenerate(
        self, prompt: AnyPrompt, config: GenerationConfig | dict[str, Any] | None = None,
        *, images: Sequence[ImageInput] | None = None, cache: PromptCache | None = None,
    ) -> GenerationResult:
        chunks = [chunk async for chunk in self.astream(prompt, config, images=images, cache=cache)]
        return _collect(iter(chunks))

    def _work(self, prompt: Any, images: Sequence[ImageInput] | None, config: GenerationConfig,
              cache: PromptCache | None) -> Any:
        """The job that generates from ``prompt``; what needs no MLX (rendering, preprocessing) is done now."""
        prepared: Sequence[int] | MultimodalPrompt
        kwargs = dict(config.chat_template_kwargs)
        if config.enable_thinking is not None:
            kwargs["enable_thinking"] = config.enable_thinking
        if isinstance(prompt, MultimodalPrompt) or images or _is_messages(prompt):
            multimodal = prompt if isinstance(prompt, MultimodalPrompt) else self.image_prompt(
                prompt, images or (), **(kwargs if _is_messages(prompt) else {}))
            prepared = multimodal if multimodal.images else list(multimodal.ids)
        else:
            prepared = self.encode(prompt)
        # Snapshots before each image: a changed image then costs only what follows it.
        snapshot_at = [s.start for s in prepared.images] if isinstance(prepared, MultimodalPrompt) else []
        timed = profiling.take_pending()  # rendering and tokenizing, done here, belong to the worker's reply
        constraint = response_constraint(config.response_format)  # a schema that does not compile fails here
        if constraint is not None:
            self.token_table  # noqa: B018 - built here (once per model), not on the worker other generations share
            if _is_messages(prompt) and not images:  # the constraint starts after the reasoning it may write
                opening = self.generation_prompt(prompt, **kwargs)
                constraint = dataclasses.replace(constraint, reasoning=reasoning_section(
                    opening, self.reasoning_markers), reasoning_budget=config.budget)

        def produce(cancel: Cancelled) -> Iterator[GenerationChunk | Together]:
            profiling.give_pending(timed)
            used = cache if cache is not None else self.make_prompt_cache()
            yield from self.run_generation(prepared, used, config, cancel, snapshot_at, constraint)

        return produce

    def run_generation(self, prompt: Sequence[int] | MultimodalPrompt, cache: PromptCache, config: GenerationConfig,
                       cancel: Cancelled, snapshot_at: Sequence[int] = (),
                       constraint: Constraint | None = None) -> Iterator[GenerationChunk | Together]:
        """The generation loop, on the worker thread (sessions call it from their own jobs). Its
        :class:`~mlxchat.batching.DecodeRow` and :class:`~mlxchat.batching.PrefillChunk` items are decode
        steps and prefill chunks the worker runs, with other generations' when it can; whoever runs the loop
        passes them on to the worker.

        The prompt's ids (and images), ``logit_bias`` and the prompt's length are checked before any work;
        ``max_tokens`` is lowered to what the context leaves. A set ``cancel`` ends it at the next prefill
        chunk or token with ``finish_reason="cancelled"``. An error inside MLX clears the cache (its state is
        unknown) and is raised as :class:`GenerationError`. A ``constraint`` (see :mod:`mlxchat.constraints`)
        masks every token of the reply.
        """
        if isinstance(prompt, MultimodalPrompt):
            check_token_ids(prompt.ids, self.config.vocab_size, "prompt token id")
            prompt = self._checked(prompt)
        else:
            prompt = check_token_ids(prompt, self.config.vocab_size, "prompt token id")
        check_token_ids(config.logit_bias, self.config.vocab_size, "logit_bias token id")
        config = self.fit(len(prompt), config)
        # A constrained reply is never drafted (see stream_generation).
        drafter = self._drafter_for(config, len(prompt)) if constraint is None else None
        matcher = RowMatcher(self.token_table, constraint) if constraint is not None else None
        try:
            yield from stream_generation(self.module, self.tokenizer, prompt, cache, config, self.eos_ids,
                                         self.config.vocab_size, snapshot_at=snapshot_at, cancel=cancel,
                                         drafter=drafter, prefill_budget=self.prefill_step_budget, pace=self.step_pace,
                                         constraint=matcher)
        except MlxchatError:
            cache.clear()
            raise
        except Exception as exc:
            cache.clear()
            raise GenerationError(f"generation failed: {exc}") from exc

    def reply_logprobs(self, cache: PromptCache, start: int, tokens: Sequence[int],
                       top: int = 0) -> list[tuple[float, list[tuple[int, float]]]]:
        """Log-probabilities of a reply that just ran on ``cache``, whose ``tokens`` followed its first ``start``
        tokens: for each, its own and the ``top`` likeliest tokens' there, under the model's distribution
        (before temperature, penalties and biases).

        One pass over the reply: the cache goes back to ``start - 1`` (by trimming, or through the snapshot a
        turn takes before its last prompt token) and runs the reply again (and the stop token it held),
        taking its snapshots again where it had them and at the end, so the next turn reuses it as before.
        """
        reply = check_token_ids(tokens, self.config.vocab_size, "reply token id")
        if isinstance(start, bool) or not isinstance(start, int) or not 1 <= start <= len(cache):
            raise InvalidInputError(f"start must be a position in the cache (1 to {len(cache)}), got {start!r}")
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= self.config.vocab_size:
            raise InvalidInputError(f"top must be an integer from 0 to the vocabulary's size, got {top!r}")

        def run() -> list[tuple[float, list[tuple[int, float]]]]:
            held = list(cache.tokens)
            ids = held[:start] + reply
            if held[start : start + len(reply)] == reply:
                ids += held[start + len(reply):]  # the stop token the cache also held
            snapshots = cache.snapshot_positions  # taken again on the way (the next turn may return to them)
            at = cache.reuse(ids[:start])
            if any(first + length > at for first, length, _ in cache.images):
                raise InvalidInputError("log-probabilities of a reply are not computed across an image")
            scored: list[tuple[float, list[tuple[int, float]]]] = []
            for a, b in chunk_bounds(at, len(ids), 256, snapshots):
                chunk = ids[a:b]
                logits = self.module(mx.array(chunk)[None], cache.layers)[0].astype(mx.float32)
                cache.feed(chunk)
                if b in snapshots:
                    cache.snapshot()
                first, last = max(start - 1, a), min(start - 1 + len(reply), b)
                if first >= last:
                    continue
                rows = logits[first - a : last - a]
                logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
                chosen = mx.take_along_axis(logprobs, mx.array(reply[first + 1 - start : last + 1 - start])[:, None],
                                            axis=-1)[:, 0]
                best = mx.argsort(-logprobs, axis=-1)[:, :top] if top else mx.zeros((len(rows), 0), mx.int32)
                best_lp = mx.take_along_axis(logprobs, best, axis=-1)
                mx.eval(chosen, best, best_lp)
                values: list[float] = chosen.tolist()  # type: ignore[assignment]
                alternatives: list[list[int]] = best.tolist()  # type: ignore[assignment]
                their: list[list[float]] = best_lp.tolist()  # type: ignore[assignment]
                for value, ids_row, lp_row in zip(values, alternatives, their, strict=True):
                    scored.append((value, list(zip(ids_row, lp_row, strict=True))))
            cache.snapshot()
            return scored

        return self.worker.run(run)

    # -- adapters -----------------------------------------------------------------------------------

    def load_adapter(self, path_or_repo: str | os.PathLike[str]) -> list[str]:
        """Apply a LoRA adapter in peft's layout, unfused, in place of the current one (the base weights stay as
        they are, so adapters swap in a moment); returns the checkpoint names of the layers it adapts. Prompt
        caches filled under another adapter are not reused (:attr:`weights_version`): a session's next turn
        prefills its whole prompt again."""
        from .train.adapters import load_adapter

        try:
            names = load_adapter(self, path_or_repo)
        finally:
            self.weights_version += 1
        self.adapter = str(path_or_repo)
        return names

    @property
    def adapter_digest(self) -> str:
        """A digest of the unfused adapter weights the model computes with now (``"none"`` without one): what a
        saved cache records beside the model's fingerprint, so a cache is never resumed under another adapter."""
        from .train.lora import adapters

        if self._adapter_digest[0] != self.weights_version:
            def digest() -> str:
                layers = adapters(self)
                if not layers:
                    return "none"
                hashed = hashlib.sha256()
                for path, layer in sorted(layers.items()):
                    flat = cast(list[tuple[str, mx.array]], tree_flatten(layer.parameters()))
                    params = {name: array for name, array in flat if not name.startswith("base.")}
                    for name in sorted(params):
                        array = params[name]
                        hashed.update(f"{path}.{name}:{array.dtype}:{array.shape}".encode())
                        hashed.update(memoryview(mx.contiguous(array.astype(mx.float32))))  # type: ignore[arg-type]
                return hashed.hexdigest()[:16]

            self._adapter_digest = (self.weights_version, self.worker.run(digest))
        return self._adapter_digest[1]

    def remove_adapter(self) -> None:
        """Back to the base model."""
        from .train.lora import module_of, remove

        self.worker.run(lambda: remove(module_of(self)))
        self.weights_version += 1
        self.adapter = None

    def fuse_adapter(self) -> int:
        """Add the adapter into the base weights (quantized layers are re-quantized as they were), so the model
        runs as a plain one and :func:`mlxchat.train.save_checkpoint` writes the fused weights. Returns how many
        layers were fused. The projections that run as one product are joined again from the new weights
        (:mod:`mlxchat.layers.fused`)."""
        from .layers.fused import fuse_projections
        from .train.lora import fuse, module_of

        def run() -> int:
            count = fuse(module_of(self))
            fuse_projections(module_of(self))
            return count

        fused = self.worker.run(run)
        self.weights_version += 1
        self.adapter = None
        return fused

    def chat_session(self, system: str | None = None, **options: Any) -> ChatSession:
        """A new conversation over this model (it owns its cache; the model stays shared). ``options`` are
        :class:`~mlxchat.session.ChatSession`'s (``default_config``, ``tools``, ``context_policy``, ...)."""
        from .session import ChatSession

        return ChatSession(self, system=system, **options)

    def close(self) -> None:
        """Stop the worker thread (sessions over this model stop working), and a draft loaded with it."""
        self.worker.close()
        if self._owns_draft and isinstance(self.draft, GenerativeModel):
            self.draft.close()

    def __enter__(self) -> GenerativeModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _placeholders(tokenizer: Tokenizer, module: VisionModule) -> list[str]:
    """The control tokens that write an image in this model's prompts, as text."""
    tokens = module.image_tokens
    names = {i: text for text, i in tokenizer.added_tokens.items()}
    return [names[i] for i in (tokens.marker, *tokens.begin, *tokens.end) if i in names]


def _is_messages(prompt: Any) -> bool:
    """Whether a prompt is a list of chat messages (not text, ids or a prepared prompt)."""
    if isinstance(prompt, str | MultimodalPrompt) or not isinstance(prompt, Sequence) or not prompt:
        return False
    return isinstance(prompt[0], Mapping) or hasattr(prompt[0], "model_dump")


def _evaluated(array: mx.array) -> mx.array:
    mx.eval(array)
    return array


def _collect(chunks: Iterator[GenerationChunk]) -> GenerationResult:
    text, tokens = [], []
    for chunk in chunks:
        text.append(chunk.text)
        if chunk.token is not None:
            tokens.append(chunk.token)
        if chunk.report is not None:
            return GenerationResult(text="".join(text), tokens=tokens, finish_reason=chunk.report.finish_reason,
                                    report=chunk.report)
    raise MlxchatError("generation ended without a report")
