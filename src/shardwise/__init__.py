"""shardwise: distributed training on PyTorch, each technique proven by parity with one process.

The public API, one name each (``docs/api.md`` documents every one)::

    import shardwise
    shardwise.launch.spawn(fn, 2)                     # 2 local ranks, gloo on the CPU
    model = shardwise.DistributedDataParallel(net)    # or ZeroDataParallel(net, stage=2)
    tp = shardwise.RankGroup(group, size, rank)       # Megatron's column / row layers
    shardwise.register_model("mine", MyConfig, describe, from_section)  # any layout, the CLI

Names are loaded lazily (PEP 562: a module ``__getattr__`` and ``__dir__`` over
``_EXPORTS``), so ``import shardwise`` imports neither torch nor any subpackage: the CLI's
``--help`` stays fast, and this front door can never close an import cycle (every layer
below it is reached only when a name is first used).
"""

from __future__ import annotations

import importlib

# public name -> "module" (the module itself) or "module:attribute"
_EXPORTS: dict[str, str] = {
    # topology & config (base)
    "Topology": "shardwise.base.topology:Topology",
    "TopologyError": "shardwise.base.topology:TopologyError",
    "init_process_groups": "shardwise.base.topology:init_process_groups",
    "Config": "shardwise.base.config:Config",
    "ConfigError": "shardwise.base.config:ConfigError",
    "RunError": "shardwise.base.errors:RunError",
    # communication: every byte that crosses ranks, counted
    "comm": "shardwise.comm",
    # launch
    "launch": "shardwise.launch",
    "spawn": "shardwise.launch:spawn",
    "init_distributed": "shardwise.launch:init_distributed",
    "RankEnv": "shardwise.launch:RankEnv",
    "WorkerError": "shardwise.launch:WorkerError",
    # models
    "GPT": "shardwise.models.gpt:GPT",
    "GPTConfig": "shardwise.models.gpt:GPTConfig",
    "Llama": "shardwise.models.llama:Llama",
    "LlamaConfig": "shardwise.models.llama:LlamaConfig",
    # your own model: describe it, register it, train it in any layout (docs/models.md)
    "ModelDescription": "shardwise.models.description:ModelDescription",
    "register_model": "shardwise.models.description:register_model",
    "decoder_layers": "shardwise.models.description:decoder_layers",
    "model_kinds": "shardwise.models.description:model_kinds",
    "TP_STYLES": "shardwise.models.description:STYLES",
    # data: the text and its characters
    "load_text": "shardwise.data:load_text",
    "CharTokenizer": "shardwise.data:CharTokenizer",
    # data parallel & ZeRO
    "DistributedDataParallel": "shardwise.parallel.data_parallel.ddp:DistributedDataParallel",
    "ZeroDataParallel": "shardwise.parallel.zero.optimizer:ZeroDataParallel",
    "ZeroStage3": "shardwise.parallel.zero.stage3:ZeroStage3",
    "DynamicLossScaler": "shardwise.parallel.precision:DynamicLossScaler",
    # tensor parallel (Megatron-LM, sequence parallel)
    "RankGroup": "shardwise.parallel.tensor_parallel.group:RankGroup",
    "ColumnParallelLinear": "shardwise.parallel.tensor_parallel.layers:ColumnParallelLinear",
    "RowParallelLinear": "shardwise.parallel.tensor_parallel.layers:RowParallelLinear",
    "VocabParallelEmbedding": "shardwise.parallel.tensor_parallel.layers:VocabParallelEmbedding",
    "vocab_parallel_cross_entropy":
        "shardwise.parallel.tensor_parallel.loss:vocab_parallel_cross_entropy",
    "copy_to_region": "shardwise.parallel.tensor_parallel.mappings:copy_to_region",          # f
    "reduce_from_region": "shardwise.parallel.tensor_parallel.mappings:reduce_from_region",  # g
    "scatter_to_region": "shardwise.parallel.tensor_parallel.mappings:scatter_to_region",
    "gather_from_region": "shardwise.parallel.tensor_parallel.mappings:gather_from_region",
    "scatter_to_sequence": "shardwise.parallel.tensor_parallel.mappings:scatter_to_sequence",
    "gather_from_sequence": "shardwise.parallel.tensor_parallel.mappings:gather_from_sequence",
    "reduce_scatter_to_sequence":
        "shardwise.parallel.tensor_parallel.mappings:reduce_scatter_to_sequence",
    # pipeline: schedules as data, checked without processes
    "pipeline": "shardwise.parallel.pipeline",
    "schedule": "shardwise.parallel.pipeline.schedules:schedule",
    "forward_only": "shardwise.parallel.pipeline.schedules:forward_only",
    "Schedule": "shardwise.parallel.pipeline.schedules:Schedule",
    "ScheduleError": "shardwise.parallel.pipeline.schedules:ScheduleError",
    "check_schedule": "shardwise.parallel.pipeline.check:check",
    # engine & training
    "Engine": "shardwise.engine.engine:Engine",
    "EngineConfig": "shardwise.engine.engine:EngineConfig",
    # the LM trainer is moving to shardwise.apps.lm; the merge repoints this line
    "build_trainer": "shardwise.apps.lm.trainer:build_trainer",
    # checkpoints
    "checkpoint": "shardwise.checkpoint",
    "latest_checkpoint": "shardwise.checkpoint:latest_checkpoint",
    "CheckpointError": "shardwise.base.errors:CheckpointError",
    # planner
    "plan": "shardwise.planner.search:plan",
    "simulate": "shardwise.planner.simulate:simulate",
    "get_cluster": "shardwise.planner.hardware:get_cluster",
    "per_op": "shardwise.planner.hardware:per_op",
    "load_model": "shardwise.planner.specs:load_model",
    "ModelSpec": "shardwise.planner.specs:ModelSpec",
    "Cluster": "shardwise.planner.hardware:Cluster",
    "Layout": "shardwise.planner.simulate:Layout",
    "Candidate": "shardwise.planner.search:Candidate",
    "Pruned": "shardwise.planner.search:Pruned",
    "SpecError": "shardwise.planner.specs:SpecError",
}

__all__ = ["__version__", *_EXPORTS]


def _version() -> str:
    from shardwise.base.version import version

    return version()


def __getattr__(name: str):
    if name == "__version__":
        value = _version()
    elif name in _EXPORTS:
        module, _, attr = _EXPORTS[name].partition(":")
        value = importlib.import_module(module)
        if attr:
            value = getattr(value, attr)
    else:
        raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
    globals()[name] = value  # cached: __getattr__ runs once per name
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
