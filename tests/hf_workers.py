"""Rank functions for tests/test_hf.py (run inside ``shardwise.launch.spawn``, or in one
process without ``torch.distributed``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.base.config import ModelConfig
from shardwise.base.topology import Topology, init_process_groups
from shardwise.checkpoint.hf import read_config
from shardwise.engine import Engine, EngineConfig
from shardwise.models.description import describe_section
from shardwise.models.hf import section_of
from shardwise.parallel.tensor_parallel import gather_tensor


def imported_logits(dirs: list[str], idx: torch.Tensor, tp: int = 1,
                    ep_dirs: list[str] = ()) -> list[torch.Tensor]:
    """Our forward of ``idx`` (B, T) on the weights of each Hugging Face checkpoint in
    ``dirs``, built by the engine at tp ranks (the world, or one process for tp = 1) with
    ``init_from``; the logits (B, T, V) gathered over tp, one tensor per directory. Then,
    in a world of 2, each of ``ep_dirs`` (mixtures of experts) at dp = ep = 2, every rank
    given the whole ``idx`` (its experts' tokens come from both ranks): appended."""
    if dist.is_initialized():
        topo = init_process_groups(Topology.build(1, 1, tp, rank=dist.get_rank(),
                                                  world_size=dist.get_world_size()))
    else:
        topo = Topology.build(1, 1, 1)
    out = [_logits(d, topo, idx) for d in dirs]
    if ep_dirs:
        topo = init_process_groups(Topology.build(2, 1, 1, rank=dist.get_rank(),
                                                  world_size=2, ep=2))
        out += [_logits(d, topo, idx) for d in ep_dirs]
    return out


def _logits(d: str, topo: Topology, idx: torch.Tensor) -> torch.Tensor:
    model = describe_section(ModelConfig(**section_of(read_config(d))), 0)
    engine = Engine(model, topo, EngineConfig(
        seq_len=idx.shape[1], init_from=d, optimizer={"grad_clip": 0.0},
        training={"global_batch_size": topo.dp}))  # one sequence per dp rank
    with engine.evaluating():
        logits = engine._logits(idx)
    return gather_tensor(logits, -1, engine.tp)[..., :model.vocab_size].clone()
