"""Rank function for the LoRA tests: several layouts trained in one spawn of ranks, each
reporting its losses, its adapters unsharded (full names), whether the base stayed frozen
(no gradient, not one bit changed) and what the optimizer steps."""

from __future__ import annotations

import torch

from shardwise.base.config import Config


def run_lora(cfg_dict: dict) -> dict:
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.engine import state as engine_state

    cfg = Config.from_dict(cfg_dict)
    trainer = build_trainer(cfg)
    e = trainer.engine
    frozen = e.local.frozen_parameters()
    before = [q.detach().clone() for _, q in frozen]
    for _ in range(cfg.training.steps):
        trainer.train_step()
    from shardwise.engine.memory import predict_rank

    p, c = cfg.parallel, trainer.topology.coords
    predicted = predict_rank(e.description, dp=p.dp, pp=p.pp, tp=p.tp, cp=p.cp,
                             dp_rank=c["dp"], pp_rank=c["pp"], tp_rank=c["tp"],
                             cp_rank=c["cp"], zero=p.zero, precision=cfg.training.precision,
                             bucket_mb=p.bucket_mb, sequence_parallel=p.sequence_parallel,
                             ep=p.ep, lora=cfg.lora)
    with e.full_parameters():
        params = {n: t.float() for n, t in engine_state.model_tensors(e).items()}
    return {"coords": trainer.topology.coords, "losses": list(trainer.history), "params": params,
            "frozen": len(frozen),
            "base_unchanged": all(torch.equal(b, q) for b, (_, q) in zip(before, frozen)),
            "base_grads": sum(q.grad is not None for _, q in frozen),
            "base_dtypes": sorted({str(q.dtype) for _, q in frozen}),
            "piece_names": sorted({n.split("[")[0] for n in e.sync.piece_names}),
            "memory": e.memory_bytes(), "predicted": predicted}


def lora_worker(configs: list[dict]) -> list[dict]:
    """``run_lora`` of every config in turn on this rank."""
    torch.set_num_threads(1)
    return [run_lora(c) for c in configs]
