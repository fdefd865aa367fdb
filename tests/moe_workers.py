"""Rank function for the mixture-of-experts tests: several MoE Llama jobs in one spawn.

``moe_worker(jobs)`` runs each job in turn on every rank of the spawn (each with its own
process groups over the same world); ``run_job(job)`` is one job, in the test's own process
for one rank (the single-process reference). A job trains ``training.steps`` steps (saving
after step ``save_at`` when given), or (``resume``) loads ``path`` first; it reports the
losses, each step's router statistics (``aux_loss``, ``expert_load``), this rank's stage
parameters unsharded (gathered over tp and ep: full model names and shapes), the local shapes
of its expert weights, the bytes it holds, and with ``record`` the all-to-all calls of one
more step (``comm.accounting``).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from shardwise.base.config import Config


def _report(trainer, stats: list[dict]) -> dict:
    from shardwise.engine import state as engine_state

    e = trainer.engine
    with e.full_parameters():
        params = {n: t.float().clone() for n, t in engine_state.model_tensors(e).items()}
    local = {n: tuple(p.shape) for n, p in e.named_parameters() if ".experts." in n}
    return {"coords": {**trainer.topology.coords, "ep": trainer.topology.ep_rank},
            "losses": list(trainer.history),
            "finite": all(math.isfinite(x) for x in trainer.history), "params": params,
            "local_shapes": local, "stats": stats, "memory": e.memory_bytes(),
            "model": dataclasses.asdict(trainer.model_cfg)}


def run_job(job: dict) -> dict:
    from shardwise import checkpoint
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.comm import accounting

    cfg = Config.from_dict(job["cfg"])
    trainer = build_trainer(cfg)
    out, stats = {}, []
    if job["kind"] == "resume":  # a path, or the newest checkpoint of a run of this spawn
        trainer.resume(job.get("path") or checkpoint.latest_checkpoint(job["from_dir"]))
        out["resumed_at"] = trainer.step
    while trainer.step < cfg.training.steps:
        info = trainer.train_step()
        stats.append({"aux_loss": info["aux_loss"], "expert_load": info["expert_load"]})
        if trainer.step == job.get("save_at"):
            out["saved"] = str(trainer.save_checkpoint())
    report = _report(trainer, stats)
    if job.get("record"):
        with accounting.recording() as rec:
            trainer.train_step()
        out["a2a"] = [r for r in accounting.table(rec.records) if r["collective"] == "all_to_all"]
    return {**report, **out}


def moe_worker(jobs: list[dict]) -> list[dict]:
    torch.set_num_threads(1)
    return [run_job(j) for j in jobs]
