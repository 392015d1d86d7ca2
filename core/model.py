"""``GenerativeModel``: a loaded checkpoint, its tokenizer and chat template, and the worker that runs it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from .architecture import Architecture, ModelModule
from .chat_template import ChatTemplate
from .config import ModelConfig
from .errors import MlxchatError, TemplateError
from .generation import GenerationChunk, GenerationConfig, GenerationResult, stream_generation
from .prompt_cache import DEFAULT_MAX_SNAPSHOTS, PromptCache
from .tokenizer import Tokenizer
from .worker import Cancelled, Worker

if TYPE_CHECKING:
    from .session import ChatSession
    from .tools.parsing import ToolCallParser
    from .tools.schema import ToolSpec

Prompt = str | Sequence[int]


class GenerativeModel:
    """A model ready to generate. Sessions over it take turns on its single worker thread.

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
    ):
        self.module = module
        self.config = config
        self.architecture = architecture
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.defaults = defaults
        self.eos_ids = eos_ids
        self.path = path
        self.dtype = dtype
        self.quantization = quantization
        self.worker = worker

    def __repr__(self) -> str:
        return f"GenerativeModel({self.architecture.name}, {self.path}, dtype={self.dtype})"

    # -- capabilities -------------------------------------------------------------------------------

    @property
    def supports_tools(self) -> bool:
        """Whether tools can be offered: the template renders them and the family has a call format."""
        return bool(self.chat_template and self.chat_template.takes_tools and self.architecture.chat.tool_format)

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
        text, ids = self.render_prompt(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                       **template_kwargs)
        return ids if tokenize else text

    def render_prompt(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> tuple[str, list[int]]:
        """The chat prompt as text and as safe token ids (one rendering)."""
        if self.chat_template is None:
            raise TemplateError(f"{self.path or 'this model'} has no chat template (chat_template.jinja or "
                                "tokenizer_config.json)")
        from .tools.schema import tool_schemas

        schemas = tool_schemas(tools) if tools else None
        kwargs = {**self.architecture.chat.template_kwargs, **template_kwargs}
        return self.chat_template.render_encoded(messages, tools=schemas,
                                                 add_generation_prompt=add_generation_prompt, **kwargs)

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

    @property
    def reasoning_markers(self) -> tuple[str, str] | None:
        return self.architecture.chat.reasoning

    @property
    def renders_tool_calls(self) -> bool:
        return self.chat_template is not None and self.chat_template.renders_tool_calls

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a raw text prompt (with the BOS the tokenizer adds), or the ids given."""
        ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else [
            int(t) for t in prompt]
        if not ids:
            raise ValueError("cannot generate from an empty prompt")
        return ids

    # -- running ------------------------------------------------------------------------------------

    def make_prompt_cache(self, max_snapshots: int = DEFAULT_MAX_SNAPSHOTS) -> PromptCache:
        """A fresh prompt cache, made on the worker (a plugin's layer caches may start with arrays)."""
        return self.worker.run(PromptCache, self.module.make_cache, max_snapshots)

    def logits(self, token_ids: Sequence[int]) -> mx.array:
        """Float32 logits ``[len, vocab]`` of one cache-free forward pass (research and parity tests)."""
        ids = [[int(t) for t in token_ids]]
        # Arrays are built on the worker: MLX ops belong to the stream of the thread that creates them.
        return self.worker.run(lambda: _evaluated(self.module(mx.array(ids))[0].astype(mx.float32)))

    def stream(
        self, prompt: Prompt, config: GenerationConfig | dict[str, Any] | None = None, *,
        cache: PromptCache | None = None,
    ) -> Iterator[GenerationChunk]:
        """Stream a generation: text chunks, the last one with the report. ``cache`` (a prompt cache of
        this model) carries state between calls; without one every call starts fresh."""
        tokens = self.encode(prompt)
        merged = self.defaults.merged(config)
        return self.worker.stream(lambda cancel: self._produce(tokens, merged, cache, cancel))

    async def astream(
        self, prompt: Prompt, config: GenerationConfig | dict[str, Any] | None = None, *,
        cache: PromptCache | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        tokens = self.encode(prompt)
        merged = self.defaults.merged(config)
        async for chunk in self.worker.astream(lambda cancel: self._produce(tokens, merged, cache, cancel)):
            yield chunk

    def generate(
        self, prompt: Prompt, config: GenerationConfig | dict[str, Any] | None = None, *,
        cache: PromptCache | None = None,
    ) -> GenerationResult:
        return _collect(self.stream(prompt, config, cache=cache))

    async def agenerate(
        self, prompt: Prompt, config: GenerationConfig | dict[str, Any] | None = None, *,
        cache: PromptCache | None = None,
    ) -> GenerationResult:
        chunks = [chunk async for chunk in self.astream(prompt, config, cache=cache)]
        return _collect(iter(chunks))

    def _produce(self, tokens: list[int], config: GenerationConfig, cache: PromptCache | None,
                 cancel: Cancelled) -> Iterator[GenerationChunk]:
        cache = cache if cache is not None else self.make_prompt_cache()
        yield from self.run_generation(tokens, cache, config, cancel)

    def run_generation(self, tokens: Sequence[int], cache: PromptCache, config: GenerationConfig,
                       cancel: Cancelled, checkpoints: Sequence[int] = ()) -> Iterator[GenerationChunk]:
        """The generation loop, on the worker thread (sessions call it from their own jobs).

        A set ``cancel`` ends it at the next token with ``finish_reason="cancelled"``. An error inside MLX
        clears the cache (its state is unknown) and is raised as :class:`MlxchatError`.
        """
        try:
            yield from stream_generation(self.module, self.tokenizer, tokens, cache, config, self.eos_ids,
                                         self.config.vocab_size, checkpoints=checkpoints, cancel=cancel)
        except MlxchatError:
            cache.clear()
            raise
        except Exception as exc:
            cache.clear()
            raise MlxchatError(f"generation failed: {exc}") from exc

    def chat_session(
        self,
        system: str | None = None,
        default_config: GenerationConfig | dict[str, Any] | None = None,
        tools: Sequence[Any] | None = None,
        cache: PromptCache | None = None,
    ) -> ChatSession:
        """A new conversation over this model (it owns its cache; the model stays shared)."""
        from .session import ChatSession

        return ChatSession(self, system=system, default_config=default_config, tools=tools, cache=cache)

    def close(self) -> None:
        """Stop the worker thread (sessions over this model stop working)."""
        self.worker.close()

    def __enter__(self) -> GenerativeModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
