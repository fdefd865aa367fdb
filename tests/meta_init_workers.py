"""Rank functions for ``test_meta_init.py``: build this rank's part of the GPT (meta
construction + replayed initialisation) and report its parameters or its memory."""

from __future__ import annotations

import resource

import torch
import torch.distributed as dist

from shardwise.base.topology import Topology, init_process_groups
from shardwise.engine.model import build_local_model
from shardwise.models.gpt import GPTConfig
from shardwise.parallel.tensor_parallel.group import RankGroup


def _local(cfg: GPTConfig, dp: int, pp: int, tp: int, v: int, seed: int):
    topo = init_process_groups(Topology.build(dp, pp, tp, rank=dist.get_rank(),
                                              world_size=dist.get_world_size()))
    group = RankGroup.from_topology(topo) if tp > 1 else RankGroup()
    chunk_ids = [c for c in range(pp * v) if c % pp == topo.pp_rank]
    return build_local_model(cfg, pp=pp, pp_rank=topo.pp_rank, chunk_ids=chunk_ids,
                             n_chunks=pp * v, tp=group, seed=seed, dropout_seed=0,
                             device=torch.device("cpu"))


def local_params_worker(layouts: list[dict], seed: int) -> list[dict]:
    """Per layout: this rank's parameters (full GPT names) with their ``tp_dim`` (-1 when
    replicated) and this rank's tp coordinates."""
    out = []
    for lay in layouts:
        cfg = GPTConfig(**lay["gpt"])
        local = _local(cfg, lay["dp"], lay["pp"], lay["tp"], lay.get("v", 1), seed)
        seen, params = set(), {}
        for c in sorted(local.chunks):
            for name, p in local.chunks[c].model_parameters():
                key = name if id(p) not in seen else name + "#shared"
                seen.add(id(p))
                params[key] = (p.detach().clone(), getattr(p, "tp_dim", -1))
        out.append({"params": params, "tp_rank": local.tp.rank, "tp_size": local.tp.size})
    return out


def memory_worker(gpt: dict, dp: int, pp: int, tp: int, seed: int) -> dict:
    """Peak resident memory (``ru_maxrss``, bytes) gained while this rank builds its part,
    the bytes of parameters it holds and the largest full tensor of the model."""
    torch.set_num_threads(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    local = _local(GPTConfig(**gpt), dp, pp, tp, 1, seed)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    held = sum(p.numel() * p.element_size() for _, p in local.named_parameters())
    return {"rise": after - before, "held": held}
