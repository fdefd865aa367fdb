"""Convolutional networks with a per-layer choice of data or tensor parallelism (issue 16).

- ``layout``: the four activation layouts (batch / full / feature / rows) and the explicit
  layout changes between them (all-gather forward, its conjugate backward).
- ``cost``: the strategies (dp, replicated, column, row; filters, channels, spatial for
  convolutions), their collectives, bytes and predicted seconds (alpha-beta model of
  ``shardwise.comm.cost``).
- ``conv``, ``conv_mappings``: the convolutions split by filters, input channels or rows,
  and their communication as conjugate autograd pairs (issue 47).
- ``chooser``: dynamic programming over the layer chain; ``plan_main`` is
  ``shardwise plan --model cnn``.
- ``hybrid``: ``HybridCNN``, the model split by a plan (reusing
  ``shardwise.parallel.tensor_parallel``'s column / row layers and operators).
- ``training``: the CNN's step, evaluation and checkpoints behind ``model.kind = "cnn"``
  (driven by ``shardwise.training.loop``).
"""

from shardwise.apps.cnn.chooser import Plan, choose, format_plan, named_plans, resolve
from shardwise.apps.cnn.cost import STRATEGIES, LayerPlan

__all__ = ["Plan", "LayerPlan", "STRATEGIES", "choose", "format_plan", "named_plans",
           "resolve"]
