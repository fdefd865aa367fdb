"""The composition of every layout: split the model (any ``ModelDescription``),
parallelize each part, one optimizer,
one engine (see ``docs/architecture.md``, "How a layout is composed").

- ``model``: ``build_local_model``: this rank's pipeline chunks, sharded for tp.
- ``sync``: ``ReplicatedSync`` (ZeRO-0); ZeRO-1/2/3 come from ``shardwise.parallel.zero``.
- ``optimizer``: ``DistributedOptimizer``: fp32 masters, one global norm, AdamW.
- ``engine``: ``Engine``: the schedule for training, forward passes for evaluation and
  generation.
- ``state``: the engine's tensors in a checkpoint.
"""

from shardwise.engine.engine import Engine, EngineConfig, settle
from shardwise.engine.model import LocalModel, build_local_model
from shardwise.engine.optimizer import DistributedOptimizer
from shardwise.engine.sync import ReplicatedSync

__all__ = ["Engine", "EngineConfig", "LocalModel", "build_local_model",
           "DistributedOptimizer", "ReplicatedSync", "settle"]
