"""Models bigger than one machine: tensor- and pipeline-parallel inference over ``mx.distributed``.

``mlxchat.load_model(path, distributed="tensor" | "pipeline")`` in every process ``mlx.launch`` started joins
their group, loads this rank's part of the weights (only the tensors, or slices of tensors, it holds) and
returns a :class:`DistributedModel`; how layers split is :mod:`mlxchat.layers.parallel` and
:mod:`mlxchat.layers.pipeline`, how the ranks keep in step is :mod:`mlxchat.distributed.model`.
"""

from .group import MODES, Mode, group_info, join, launched_backend
from .model import DistributedModel, SharedPromptCache

__all__ = ["MODES", "DistributedModel", "Mode", "SharedPromptCache", "group_info", "join", "launched_backend"]
