"""Rank functions for the pipeline tests (run inside ``shardwise.launch.spawn``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.models import GPT, GPTConfig
from shardwise.pipeline.runner import PipelineConfig, PipelineRunner
from shardwise.topology import Topology, init_process_groups

MODEL = dict(vocab_size=65, block_size=16, n_layer=6, n_head=4, n_embd=32, tie_weights=False)
BATCH, LR, SEED = 8, 3e-3, 1234


def batches(steps: int, batch: int = BATCH, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable toy data: the next token is the current one plus one (mod V)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, MODEL["vocab_size"], (batch, MODEL["block_size"]), generator=g)
        out.append((idx, (idx + 1) % MODEL["vocab_size"]))
    return out


def _model() -> GPT:
    torch.manual_seed(SEED)
    return GPT(GPTConfig(**MODEL))


def _adamw(named):
    return torch.optim.AdamW([p for _, p in named], lr=LR)


def reference(steps: int = 5) -> dict:
    """One process, whole global batch, plain GPT + AdamW."""
    model = _model()
    opt = _adamw(list(model.named_parameters()))
    losses = []
    for idx, tgt in batches(steps):
        _, loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _topology(dp: int, pp: int):
    return init_process_groups(Topology.build(dp, pp, 1, rank=dist.get_rank(),
                                              world_size=dist.get_world_size()))


def run_pipeline(dp: int, pp: int, cfg: dict, steps: int = 5, run_dir: str | None = None) -> dict:
    """Train ``steps`` global batches with the pipeline; report losses, this rank's params
    (GPT names), peak activation bytes and, for PipeDream, the weight versions seen."""
    topo = _topology(dp, pp)
    runner = PipelineRunner(_model(), topo, PipelineConfig(**dict(cfg, measure_memory=True)), BATCH // dp,
                            MODEL["block_size"], _adamw)
    losses = []
    share = BATCH // dp
    for idx, tgt in batches(steps):
        rows = slice(topo.dp_rank * share, (topo.dp_rank + 1) * share)
        losses.append(runner.train_step(idx[rows], tgt[rows]))
    ex = runner.executor
    if run_dir is not None:
        runner.save_timeline(run_dir)
    return {"losses": losses, "dp_rank": topo.dp_rank, "pp_rank": topo.pp_rank,
            "params": {n: p.detach().clone() for n, p in runner.named_parameters()},
            "peak_activation_bytes": ex.meter.peak, "versions": ex.versions,
            "bounds": list(runner.partition.bounds)}


def run_many(dp: int, pp: int, cfgs: list[dict], steps: int = 5,
             run_dir: str | None = None) -> list[dict]:
    """``run_pipeline`` for several configurations in one process group (fewer spawns);
    with ``run_dir``, configuration i saves its last step's timeline under ``run_dir/i``."""
    return [run_pipeline(dp, pp, cfg, steps, None if run_dir is None else f"{run_dir}/{i}")
            for i, cfg in enumerate(cfgs)]
