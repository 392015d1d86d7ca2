"""``load_model``: a checkpoint folder or Hub repo id in, a ready :class:`GenerativeModel` out;
``build_model``: the same from a config alone, with random (or given) weights."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .architecture import Architecture, ModelModule
from .batching import DEFAULT_PREFILL_STEP_BUDGET
from .cache import check_kv_format
from .chat_template import ChatTemplate, read_template_source
from .checkpoint import (
    TensorLocation,
    read_json,
    read_slice,
    read_weights,
    resolve_checkpoint,
    tensor_locations,
    tensor_names,
)
from .config import ModelConfig
from .distributed.watchdog import DEFAULT_TIMEOUT
from .errors import CheckpointError, DistributedError, InvalidInputError, UnsupportedQuantizationError
from .generation import GenerationConfig
from .images import ImageProcessor
from .layers.fused import fuse_projections
from .layers.parallel import Slice, shard_slices
from .layers.quantized import quantize
from .layers.rope import context_limit
from .model import GenerativeModel
from .multimodal import VisionModule
from .pacing import DEFAULT_DECODE_SLOWDOWN
from .registry import registry
from .runtime import default_dtype
from .tokenizer import NoTokenizer, Tokenizer
from .worker import Worker

if TYPE_CHECKING:
    from .session import ChatSession

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_QUANT_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")
_BITS = (2, 3, 4, 5, 6, 8)
_SHOWN = 6
T = TypeVar("T")
U = TypeVar("U")


def load_model(
    path_or_repo: str | os.PathLike[str] | None = None,
    *,
    dtype: str | mx.Dtype | None = None,
    revision: str | None = None,
    context_length: int | None = None,
    distributed: Literal["tensor", "pipeline"] | None = None,
    distributed_timeout: float = DEFAULT_TIMEOUT,
    draft: str | os.PathLike[str] | GenerativeModel | None = None,
    draft_tokens: int = 4,
    prefill_step_budget: int = DEFAULT_PREFILL_STEP_BUDGET,
    max_decode_slowdown: float | None = DEFAULT_DECODE_SLOWDOWN,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    adapter: str | os.PathLike[str] | None = None,
) -> GenerativeModel:
    """Load a checkpoint (local folder or Hugging Face repo id; by default the demo model shipped in the
    package, :mod:`mlxchat.demo`) with the plugin its config.json names.

    ``draft`` turns on speculative decoding (:meth:`GenerativeModel.with_draft`): a smaller checkpoint
    sharing this one's tokenizer (a folder or repo id, loaded in the same dtype and closed with this model,
    or a loaded model), or ``"mtp"`` for the checkpoint's own multi-token-prediction head; it proposes
    ``draft_tokens`` tokens per pass by default. A checkpoint with an MTP head drafts with it whenever a
    request sets ``draft_tokens`` and no draft is given.

    ``dtype`` is what floating-point weights are computed in; by default the checkpoint's own on a GPU
    and float32 on the CPU (see :func:`mlxchat.runtime.default_dtype`). Quantized weights stay quantized.
    ``context_length`` sets the tokens a generation may hold (prompt and reply): at most, and by default,
    the checkpoint's limit, ``max_position_embeddings`` stretched by a linear, dynamic or yarn RoPE scaling
    as vLLM derives it (:func:`~mlxchat.layers.rope.context_limit`).

    ``kv_bits`` (2-8, typically 8 or 4; ``kv_group_size`` 32, 64 or 128): the model's prompt caches store
    full-attention keys and values group-wise quantized (:class:`~mlxchat.cache.QuantizedKVCache`), a
    quarter or an eighth of float32's memory; ``kv_bits=16``: as float16, half of it (no groups); a session
    can choose its own (``ChatSession(kv_bits=...)``).

    ``prefill_step_budget``: the most prompt tokens one step of the worker prefills beside a decode token for
    every running generation, so a long prompt goes in a chunk a step while other streams keep decoding
    (:class:`~mlxchat.batching.PrefillChunk`). ``max_decode_slowdown``: while other streams decode, a step
    takes fewer prompt tokens than the budget, as many as keep it within this many times the cost of the
    streams' own step, a cost learnt from the worker's steps (:mod:`mlxchat.pacing`; ``None``: the budget
    alone bounds a step).

    ``adapter``: a LoRA adapter folder (or Hub repo) in peft's layout, applied unfused
    (:meth:`GenerativeModel.load_adapter`; :meth:`GenerativeModel.fuse_adapter` bakes it in).

    ``distributed`` ("tensor" or "pipeline"), in every process ``mlx.launch`` started: join their group and load
    only this rank's part of the weights; the model (a :class:`~mlxchat.distributed.DistributedModel`) then
    behaves as on one process and gives the same results on every rank (see :mod:`mlxchat.distributed`).
    ``distributed_timeout``: the seconds rank 0 waits for one step of the group (a decode step, a prefill chunk
    of ``prefill_step_budget`` tokens, a logits pass) before it gives the group up as lost
    (:class:`~mlxchat.errors.DistributedError`; see :mod:`mlxchat.distributed.watchdog`).

    Everything that needs no MLX (config, tokenizer, template) is read here, the tokenizer and template while
    the module is built, loaded and evaluated on the model's own worker thread, which runs all of its MLX work
    from then on.
    """
    if kv_bits is not None:
        check_kv_format(kv_bits, kv_group_size)
    group = None
    if distributed is not None:
        from .distributed import join

        if not distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be a positive number of seconds, got {distributed_timeout!r}")
        group = join(distributed)
    if path_or_repo is None:
        from .demo import default_model_path

        path_or_repo = default_model_path()
    folder = resolve_checkpoint(path_or_repo, revision)
    raw = read_json(folder / "config.json")
    arch = registry().architecture_for_config(raw)
    names = tensor_names(folder)
    if not any(name.endswith("lm_head.weight") for name in names):
        raw = _tied(raw)
    config = arch.config_class.from_hf(raw)
    if config.num_hidden_layers > len(names):  # (building that many layers would take minutes, or all memory)
        raise CheckpointError(f"{folder}/config.json: num_hidden_layers is {config.num_hidden_layers}, but the weights "
                              f"hold {len(names)} tensors, fewer than one a layer")
    quantization = _quantization(raw)

    def prepare(module: Any, weights: dict[str, mx.array]) -> tuple[dict[str, mx.array], mx.Dtype]:
        weights = module.sanitize(weights)
        if quantization is not None:
            _quantize(module, weights, quantization)
        _check_tensors(module, weights, str(folder))
        return weights, _target_dtype(dtype, _stored_dtype(weights))

    def build(evaluating: Callable[[], None]) -> tuple[ModelModule, mx.Dtype]:
        module = _module(arch, config, f"{folder}/config.json")
        weights, target = prepare(module, read_weights(folder))
        _materialize(module, weights, target, stored=None, evaluating=evaluating)
        return module, target

    def build_part(evaluating: Callable[[], None]) -> tuple[ModelModule, mx.Dtype]:
        assert group is not None and distributed is not None
        evaluating()
        module = _module(arch, config, f"{folder}/config.json")
        files = read_weights(folder)
        weights, target = prepare(module, dict(files))
        _split(module, arch, group, distributed)
        plan = _part_plan(module, weights, files)
        del files, weights  # what this rank does not hold is never read
        _materialize_part(module, plan, tensor_locations(folder), target)
        fuse_projections(module)
        mx.eval(mx.distributed.all_sum(mx.array(1), group=group))  # every rank is ready
        return module, target

    def read_text_side() -> tuple[Tokenizer, ChatTemplate | None, dict[str, Any]]:
        tokenizer = Tokenizer.from_folder(folder)
        source = read_template_source(folder)
        generation = read_json(folder / "generation_config.json", required=False)
        return tokenizer, ChatTemplate(source, tokenizer) if source else None, generation

    worker = Worker(f"mlxchat-{arch.name}", side_by_side=group is None)
    (module, target), (tokenizer, template, generation) = _on(worker, build if group is None else build_part,
                                                              read_text_side)
    image_processor = _image_processor(module, folder)
    kind: type[GenerativeModel] = GenerativeModel
    extra: dict[str, Any] = {}
    if group is not None:
        from .distributed import DistributedModel

        kind, extra = DistributedModel, {"group": group, "mode": distributed, "timeout": distributed_timeout}
    model = kind(
        **extra,
        module=module,
        config=config,
        architecture=arch,
        tokenizer=tokenizer,
        chat_template=template,
        defaults=_defaults(generation, folder / "generation_config.json"),
        eos_ids=_eos_ids(raw, generation, tokenizer, arch, config.vocab_size),
        worker=worker,
        path=folder,
        dtype=target,
        quantization=quantization,
        context_length=context_length,
        image_processor=image_processor,
        prefill_step_budget=prefill_step_budget,
        max_decode_slowdown=max_decode_slowdown,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
    )
    if adapter is not None:
        try:
            model.load_adapter(adapter)
        except BaseException:
            model.close()
            raise
    return model if draft is None else _with_draft(model, draft, draft_tokens)


def checkpoint_context(path_or_repo: str | os.PathLike[str], revision: str | None = None) -> tuple[int, str]:
    """The most tokens a checkpoint serves and why (:func:`~mlxchat.layers.rope.context_limit`), from its
    config.json alone."""
    raw = read_json(resolve_checkpoint(path_or_repo, revision) / "config.json")
    return context_limit(registry().architecture_for_config(raw).config_class.from_hf(raw))


def _module(arch: Architecture, config: ModelConfig, where: str) -> Any:
    """The architecture's module for ``config``: one whose sizes build no model (zero heads, a negative scaling
    factor: a division by zero or an impossible shape) is a :class:`CheckpointError` naming ``where``."""
    try:
        return arch.model_class(config)
    except (ArithmeticError, ValueError, TypeError, IndexError) as exc:  # (OverflowError: a size past MLX's int32)
        raise CheckpointError(f"{where} describes a model that cannot be built ({type(exc).__name__}: {exc})") from exc


def _with_draft(model: GenerativeModel, draft: str | os.PathLike[str] | GenerativeModel,
                draft_tokens: int) -> GenerativeModel:
    loaded: GenerativeModel | None = None
    try:
        if isinstance(draft, GenerativeModel) or draft == "mtp":
            return model.with_draft(draft, draft_tokens)  # type: ignore[arg-type]
        loaded = load_model(draft, dtype=model.dtype)
        speculative = model.with_draft(loaded, draft_tokens)
    except BaseException:  # (what was loaded for it is closed: its worker threads would outlive the error)
        if loaded is not None:
            loaded.close()
        model.close()
        raise
    speculative._owns_draft = True
    return speculative


def build_model(
    config: str | Mapping[str, Any] | ModelConfig,
    weights: Literal["random"] | Mapping[str, mx.array] = "random",
    seed: int = 0,
    dtype: str | mx.Dtype | None = None,
    tokenizer: str | os.PathLike[str] | Tokenizer | None = None,
    *,
    chat_template: str | None = None,
) -> GenerativeModel:
    """A model of any registered architecture from its config alone, for research and benchmarks.

    ``config`` is a name from :mod:`mlxchat.configs` (``"qwen3-0.6b"``), a ``config.json`` dict or a plugin's
    :class:`ModelConfig`. ``weights="random"`` initialises every layer as MLX does (seeded by ``seed``); a
    mapping of checkpoint tensor names to arrays is sanitized and checked like a checkpoint's. ``dtype`` as
    in :func:`load_model`, the config's own ``torch_dtype`` standing for the stored dtype. ``tokenizer`` (a
    checkpoint folder, whose chat template comes along, or a :class:`~mlxchat.tokenizer.Tokenizer` with an
    optional ``chat_template`` source) makes text prompts and ``chat_session`` work; without one, prompts
    are token ids and replies have no text.
    """
    from . import configs

    if isinstance(config, str):
        config = configs.get(config)
    if isinstance(config, ModelConfig):
        arch = registry().architecture_for(config.model_type)
        raw: dict[str, Any] = config.model_dump()
        model_config = config
    else:
        raw = dict(config)
        arch = registry().architecture_for_config(raw)
        model_config = arch.config_class.from_hf(raw)
    stored = _declared_dtype(raw)
    tok, template = _given_tokenizer(tokenizer, chat_template)
    if not (isinstance(weights, Mapping) or weights == "random"):
        raise ValueError(f'weights must be "random" or a mapping of tensor names to arrays, got {weights!r}')
    if isinstance(weights, Mapping):
        given = dict(weights)
        mx.eval(list(given.values()))  # evaluated here, so that no graph of this thread reaches the worker

    def build(evaluating: Callable[[], None]) -> tuple[ModelModule, mx.Dtype]:
        mx.random.seed(seed)
        module = _module(arch, model_config, "the config")
        if weights == "random":
            tensors = dict(tree_flatten(module.parameters()))
        else:
            tensors = module.sanitize(given)
            _check_tensors(module, tensors, "the given weights")
        target = _target_dtype(dtype, stored)
        _materialize(module, tensors, target, stored=stored)
        return module, target

    worker = Worker(f"mlxchat-{arch.name}")
    (module, target), _ = _on(worker, build, lambda: None)
    return GenerativeModel(
        module=module,
        config=model_config,
        architecture=arch,
        tokenizer=tok,
        chat_template=template,
        defaults=GenerationConfig(),
        eos_ids=_eos_ids(raw, {}, tok, arch, model_config.vocab_size, strict=False),
        worker=worker,
        dtype=target,
    )


def load_session(path_or_repo: str | os.PathLike[str] | None = None, *,
                 resume: str | os.PathLike[str] | None = None, **options: Any) -> ChatSession:
    """Load a model and open a chat session over it in one step. ``options`` are
    :class:`~mlxchat.session.ChatSession`'s where it takes them (``system``, ``tools``, ``auto_tools``,
    ``context_policy``, ...), the session's default generation settings where they are
    :class:`~mlxchat.generation.GenerationConfig` fields (``max_tokens``, ``temperature``, ...), and
    :func:`load_model`'s otherwise (``dtype``, ``context_length``, ...).

    ``resume``: a file :meth:`ChatSession.save` wrote; the session goes on from it (its transcript, system
    prompt included, and its prompt cache); session options given here replace the saved ones.
    """
    import inspect

    from .session import ChatSession

    session_names = set(inspect.signature(ChatSession.__init__).parameters) - {"self", "model"}
    session_options = {k: v for k, v in options.items() if k in session_names}
    settings = {k: v for k, v in options.items() if k in GenerationConfig.model_fields}
    if settings:
        given = session_options.get("default_config")
        base = given if isinstance(given, GenerationConfig) else GenerationConfig.model_validate(given or {})
        session_options["default_config"] = base.merged(settings)
    loader_options = {k: v for k, v in options.items() if k not in session_names and k not in settings}
    model = load_model(path_or_repo, **loader_options)
    if resume is not None:
        return ChatSession.load(model, resume, **session_options)
    return model.chat_session(**session_options)


def _image_processor(module: Any, folder: Path) -> ImageProcessor | None:
    """The preprocessing of a module that loaded a vision tower: the plugin's, with the settings of
    ``preprocessor_config.json`` (or the ``image_processor`` entry of ``processor_config.json``)."""
    if not isinstance(module, VisionModule) or not module.supports_images:
        return None
    settings = read_json(folder / "preprocessor_config.json", required=False)
    if not settings:
        nested = read_json(folder / "processor_config.json", required=False).get("image_processor")
        settings = nested if isinstance(nested, dict) else {}
    return module.image_processor(settings)


def _quantization(raw: dict[str, Any]) -> dict[str, Any] | None:
    text = raw.get("text_config")
    for source in [raw, *([text] if isinstance(text, dict) else [])]:
        for key in ("quantization", "quantization_config"):
            value = source.get(key)
            if value is None:
                continue
            if not isinstance(value, dict) or "bits" not in value or "group_size" not in value:
                method = value.get("quant_method") if isinstance(value, dict) else value
                raise UnsupportedQuantizationError(
                    f"config.json: {key} {method!r} is not supported; mlxchat loads MLX-format quantized "
                    f"checkpoints (as `mlx_lm.convert -q` writes them: \"quantization\": {{\"group_size\", \"bits\"}})"
                )
            mode = value.get("mode", "affine")
            if mode not in _QUANT_MODES or value["bits"] not in _BITS:
                raise UnsupportedQuantizationError(
                    f"config.json: quantization mode {mode!r} with {value['bits']} bits is not supported "
                    f"(modes: {', '.join(_QUANT_MODES)}; bits 2-6 or 8)"
                )
            return value
    return None


def _quantize(module: nn.Module, weights: dict[str, mx.array], quantization: dict[str, Any]) -> None:
    """Quantize the layers the checkpoint stores quantized, each with the bits and group size its own
    tensors imply (per-layer overrides in config.json use the converter's module names, which need not
    be ours, so the shapes are the reliable record)."""
    mode = quantization.get("mode", "affine")

    def predicate(path: str, layer: nn.Module) -> bool | dict[str, Any]:
        scales = weights.get(f"{path}.scales")
        packed = weights.get(f"{path}.weight")
        if scales is None or packed is None or not hasattr(layer, "to_quantized"):
            return False
        in_dims = layer.weight.shape[-1]
        bits, group_size = packed.shape[-1] * 32 // in_dims, in_dims // scales.shape[-1]
        if bits not in _BITS or packed.shape[-1] * 32 != bits * in_dims or group_size * scales.shape[-1] != in_dims:
            raise UnsupportedQuantizationError(
                f"{path}: quantized tensors of shapes {tuple(packed.shape)} and {tuple(scales.shape)} do not fit "
                f"a layer with {in_dims} inputs"
            )
        return {"group_size": group_size, "bits": bits, "mode": mode}

    quantize(module, predicate)


def _check_tensors(module: nn.Module, weights: dict[str, mx.array], source: str) -> None:
    expected = dict(tree_flatten(module.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    wrong = sorted(
        f"{k} {tuple(weights[k].shape)} (expected {tuple(expected[k].shape)})"
        for k in set(expected) & set(weights)
        if tuple(weights[k].shape) != tuple(expected[k].shape)
    )
    # An integer tensor where the module computes in floats (int8 weights with no quantization the config names)
    # would load as its raw integers.
    kinds = sorted(
        f"{k} {str(weights[k].dtype).split('.')[-1]} (expected {str(expected[k].dtype).split('.')[-1]})"
        for k in set(expected) & set(weights)
        if mx.issubdtype(weights[k].dtype, mx.floating) != mx.issubdtype(expected[k].dtype, mx.floating)
    )
    problems = []
    for label, names in (("missing tensors", missing), ("unexpected tensors", extra), ("wrong shapes", wrong),
                         ("wrong dtypes", kinds)):
        if names:
            shown = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
            problems.append(f"{label}: {shown}")
    if problems:
        raise CheckpointError(f"{source}: weights do not fit the model config ({'; '.join(problems)})")


def _materialize(module: nn.Module, weights: dict[str, mx.array], target: mx.Dtype, stored: mx.Dtype | None,
                 evaluating: Callable[[], None] = lambda: None) -> None:
    """Load ``weights`` (emptied: the module holds them now) into ``module`` with floating tensors in
    ``target``, except those its ``cast_predicate`` keeps as stored (in ``stored`` when given), join its
    projections (:func:`~mlxchat.layers.fused.fuse_projections`, straight from the tensors as read and cast:
    no separate copy is made first), and evaluate them in one call: each stored copy is referenced by its
    cast (or joined) copy's graph alone, so MLX frees it as soon as that exists, and the whole load runs
    without the GIL (``evaluating()`` says so, just before)."""
    cast = getattr(module, "cast_predicate", lambda name: True)

    def converted(name: str, value: mx.array) -> mx.array:
        if not mx.issubdtype(value.dtype, mx.floating):
            return value
        if cast(name):
            return value.astype(target)
        return value if stored is None else value.astype(stored)

    module.load_weights([(name, converted(name, weights.pop(name))) for name in list(weights)], strict=True)
    module.eval()
    fuse_projections(module)
    evaluating()
    mx.eval(module.parameters())


def _split(module: ModelModule, arch: Architecture, group: mx.distributed.Group, mode: str) -> None:
    method = "shard" if mode == "tensor" else "pipeline"
    split = getattr(module, method, None)
    if split is None:
        raise DistributedError(f"{arch.name} ({type(module).__name__}) cannot run distributed={mode!r}: its module "
                               f"has no {method}(group) method (mlxchat.layers.CausalLM provides one)")
    split(group)


Part = tuple[str, mx.array, str | None, Slice | None]
"""A parameter of this rank: its name, the sanitized tensor it comes from, the checkpoint tensor that is (when
sanitize only renamed it), and the slice of it this rank holds (``None``: all of it)."""


def _part_plan(module: nn.Module, weights: dict[str, mx.array], files: dict[str, mx.array]) -> list[Part]:
    """What each parameter of a split module is made of (``files``: the checkpoint's tensors as read, before
    sanitize, which tells the tensors it only renamed by identity)."""
    names = {id(value): name for name, value in files.items()}
    slices = shard_slices(module)
    plan = []
    for name in dict(tree_flatten(module.parameters())):
        value = weights.pop(name)
        source = names.get(id(value))
        plan.append((name, value, source if source is not None and files[source] is value else None,
                     slices.get(name)))
    return plan


def _materialize_part(module: nn.Module, plan: list[Part], locations: dict[str, TensorLocation],
                      target: mx.Dtype) -> None:
    """Load a split module's parameters one at a time: a slice of a checkpoint tensor is read from the file
    alone (only the bytes it holds); a slice of a tensor sanitize computed is computed, then cut; a whole
    tensor is read as is. Each is cast as in :func:`_materialize` and evaluated before the next."""
    cast = getattr(module, "cast_predicate", lambda name: True)
    loaded = []
    plan.reverse()
    while plan:
        name, value, source, piece = plan.pop()
        array = None
        if piece is not None and source is not None:
            array = read_slice(locations[source], piece.axis, piece.ranges)
        if array is None:
            array = piece.take(value) if piece is not None else value
        del value
        if mx.issubdtype(array.dtype, mx.floating) and cast(name):
            array = array.astype(target)
        mx.eval(array)
        loaded.append((name, array))
    module.load_weights(loaded, strict=True)
    module.eval()


def _on(worker: Worker, build: Callable[[Callable[[], None]], T], meanwhile: Callable[[], U]) -> tuple[T, U]:
    """Run ``build`` on the model's worker and ``meanwhile`` here, from when ``build`` calls the function it is
    given (its MLX evaluation, which releases the GIL, starts; the tokenizer's loading holds the GIL
    throughout, so before that point the two would only take turns). A failure of either stops the worker
    (no model will own it)."""
    evaluating = threading.Event()
    built = worker.submit(build, evaluating.set)
    while not evaluating.wait(0.005) and not built.done():
        pass
    try:
        other = meanwhile()
    except BaseException:
        wait([built])
        worker.close()
        raise
    try:
        return built.result(), other
    except BaseException:
        worker.close()
        raise


def _tied(raw: dict[str, Any]) -> dict[str, Any]:
    """A config that says its head is tied (checkpoints without ``lm_head.weight`` are, whatever they say)."""
    raw = {**raw, "tie_word_embeddings": True}
    if isinstance(raw.get("text_config"), dict):
        raw["text_config"] = {**raw["text_config"], "tie_word_embeddings": True}
    return raw


def _target_dtype(dtype: str | mx.Dtype | None, stored: mx.Dtype) -> mx.Dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    if dtype is not None:
        return dtype
    return default_dtype(stored)


def _stored_dtype(weights: dict[str, mx.array]) -> mx.Dtype:
    """The dtype most floating tensors of a checkpoint are stored in."""
    floating = [v.dtype for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)]
    return max(set(floating), key=floating.count) if floating else mx.float32


def _declared_dtype(raw: Mapping[str, Any]) -> mx.Dtype:
    """The dtype a config says its weights are stored in (``torch_dtype``, or transformers 5's ``dtype``)."""
    text = raw.get("text_config")
    for source in (raw, text if isinstance(text, Mapping) else {}):
        for key in ("torch_dtype", "dtype"):
            if source.get(key) in _DTYPES:
                return _DTYPES[source[key]]
    return mx.float32


def _given_tokenizer(
    tokenizer: str | os.PathLike[str] | Tokenizer | None, chat_template: str | None
) -> tuple[Tokenizer, ChatTemplate | None]:
    if tokenizer is None:
        if chat_template is not None:
            raise ValueError("a chat template needs a tokenizer: pass tokenizer= as well")
        return NoTokenizer(), None
    if isinstance(tokenizer, Tokenizer):
        tok, source = tokenizer, chat_template
    else:
        folder = Path(tokenizer)
        tok = Tokenizer.from_folder(folder)
        source = chat_template if chat_template is not None else read_template_source(folder)
    return tok, ChatTemplate(source, tok) if source else None


def _eos_list(value: Any, where: str, vocab_size: int, strict: bool) -> list[int]:
    """An ``eos_token_id`` (one id or a list of them) as a list of the model's token ids; anything but integers is a
    :class:`CheckpointError` naming ``where``, and so is an id past the vocabulary when ``strict`` (it would index
    the logits' masks out of range; :func:`build_model` drops those of a named config whose vocabulary was cut)."""
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and (0 <= v < vocab_size or not strict) for v in values):
        raise CheckpointError(f"{where}: eos_token_id {value!r} is not a token id of this model (an integer from 0 "
                              f"to {vocab_size - 1}, or a list of them)")
    return [v for v in values if 0 <= v < vocab_size]


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any], tokenizer: Tokenizer, arch: Architecture,
             vocab_size: int, strict: bool = True) -> set[int]:
    ids = set(_eos_list(generation.get("eos_token_id"), "generation_config.json", vocab_size, strict))
    ids |= set(_eos_list(raw.get("eos_token_id"), "config.json", vocab_size, strict))
    text = raw.get("text_config")
    if isinstance(text, dict):
        ids |= set(_eos_list(text.get("eos_token_id"), "config.json", vocab_size, strict))
    for token in (tokenizer.eos_token, *arch.chat.stop_tokens):
        token_id = tokenizer.token_id(token) if token else None
        if token_id is not None and token_id < vocab_size:  # (a tokenizer's token past the logits is never sampled)
            ids.add(token_id)
    return ids


def _defaults(generation: dict[str, Any], where: Path) -> GenerationConfig:
    """The sampling settings of ``generation_config.json``; one out of range is a :class:`CheckpointError` naming
    the file (not the caller's settings)."""
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    values = {k: generation[k] for k in keys if generation.get(k) is not None}
    if generation.get("do_sample") is False:
        values["temperature"] = 0.0
    try:
        return GenerationConfig().merged(values)
    except InvalidInputError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
