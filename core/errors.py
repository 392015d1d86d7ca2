"""The library's errors: one base class, a few kinds, messages that say what to do next."""

from __future__ import annotations


class MlxchatError(Exception):
    """Base class of every error mlxchat raises on purpose."""


class CheckpointError(MlxchatError):
    """A checkpoint folder is missing, malformed or does not fit the model (names the file or tensor)."""


class AdapterError(CheckpointError):
    """A LoRA adapter does not fit the model it is put on (its layers' names, shapes or rank), or its files
    are not peft's LoRA layout; the message names the tensor or setting."""


class PluginError(MlxchatError):
    """A plugin cannot be registered: it fails to import, implements a hook that does not exist, or
    claims a ``model_type`` or tool-call format another plugin claims (the message names both)."""


class UnknownModelTypeError(MlxchatError):
    """No registered plugin serves a checkpoint's ``model_type``."""


class UnsupportedQuantizationError(CheckpointError):
    """The checkpoint is quantized in a way mlxchat cannot load."""


class TemplateError(MlxchatError):
    """A chat template failed to render (``raise_exception`` in the template, bad message shape)."""


class InvalidInputError(MlxchatError, ValueError):
    """A value from outside (a user, a request, a tool) is malformed or out of range; nothing was run."""


class ContextLengthError(InvalidInputError):
    """A prompt does not fit the model's context (``max_position_embeddings`` or the user's limit)."""


class ImageError(InvalidInputError):
    """An image could not be read, is not allowed (a remote URL), or does not fit the model's processor."""


class GenerationError(MlxchatError):
    """A generation failed while running; the session that asked keeps its state."""


class TrainingDivergedError(MlxchatError, FloatingPointError):
    """A training step's loss or gradients are not finite: the step is not applied (the weights and the saved
    checkpoints stay those of the step before); lower the learning rate."""


class RewardError(MlxchatError):
    """A reward function raised, or returned something other than a finite number, while scoring a completion
    during GRPO (the message names the reward and the prompt; the original error is its cause)."""


class SessionClosedError(MlxchatError):
    """A closed session was used."""


class ModelClosedError(GenerationError, RuntimeError):
    """A closed model was used, or closed while a reply streamed from it (its worker has stopped)."""


class SessionStateError(MlxchatError):
    """A session call that does not fit the conversation as it stands (e.g. unanswered tool calls)."""


class SavedStateError(MlxchatError):
    """A saved session or prompt cache cannot be loaded: the file is not one, is damaged, or was written
    for another model (the message says which part differs)."""


class StreamConsumedError(MlxchatError):
    """A stream was iterated a second time."""


class DistributedError(MlxchatError):
    """A model cannot be split over the process group (heads or quantization groups that do not divide), the
    process was not launched in a group (``mlx.launch``), or rank 0 lost its group (a rank died or stopped
    answering: see :mod:`mlxchat.distributed.watchdog`); the message says what would work."""
