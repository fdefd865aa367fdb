"""Rank function for the Llama tests: several Llama jobs trained in one spawn of ranks.

``llama_worker(jobs)`` runs each job in turn on every rank of the spawn, each with its own
process groups over the same world; ``run_job(job)`` is one job, in the test's own process
for one rank (no ``torch.distributed``: the single-process reference):

- ``run``: train ``training.steps`` steps (saving a checkpoint after step ``save_at`` on
  the way when given, as ``checkpoint.every`` does); report the losses, every loss finite
  or not, this rank's stage parameters unsharded (full model names: gathered over tp, and
  over dp under ZeRO-3), the last stage's copy of a tied head (pp > 1) as ``tied_head``,
  and the bytes it holds (``Engine.memory_bytes``);
- ``resume``: a fresh trainer of this layout loads ``path`` (saved in another layout) and
  finishes the run; the same report, plus the step it resumed at.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from shardwise.base.config import Config


def _report(trainer) -> dict:
    from shardwise.engine import state as engine_state

    e = trainer.engine
    tied = e.local.description.tied
    out = {}
    with e.full_parameters():
        params = {n: t.float().clone() for n, t in engine_state.model_tensors(e).items()}
        if tied is not None and tied[1] in e.local.tied:  # the last stage's copy of the
            head = dict(e.local.named_parameters())[tied[1]]  # tied matrix (pp > 1)
            out["tied_head"] = e.local.full_tensor(tied[1], head, head.detach()).float().clone()
    local = {n: tuple(p.shape) for n, p in e.named_parameters()}  # this rank's pieces
    return {"coords": trainer.topology.coords, "losses": list(trainer.history),
            "local_shapes": local,
            "finite": all(math.isfinite(x) for x in trainer.history), "params": params,
            "memory": e.memory_bytes(), "kind": trainer.description.kind,
            "model": dataclasses.asdict(trainer.model_cfg), **out}


def run_job(job: dict) -> dict:
    """Train ``job["cfg"]`` (resuming ``job["path"]`` when ``job["kind"] == "resume"``,
    saving at ``job["save_at"]``) and report it; with ``job["measure_memory"]`` the
    executor's activation meter is on and its peak is reported as ``activations``."""
    from shardwise.apps.lm.trainer import build_trainer

    cfg = Config.from_dict(job["cfg"])
    trainer = build_trainer(cfg)
    trainer.engine.executor.measure_memory = bool(job.get("measure_memory"))
    out = {}
    if job["kind"] == "resume":
        trainer.resume(job["path"])
        out["resumed_at"] = trainer.step
    while trainer.step < cfg.training.steps:
        trainer.train_step()
        if trainer.step == job.get("save_at"):
            out["saved"] = str(trainer.save_checkpoint())
    if job.get("measure_memory"):
        out["activations"] = trainer.engine.executor.meter.peak
    return {**_report(trainer), **out}


def llama_worker(jobs: list[dict]) -> list[dict]:
    torch.set_num_threads(1)
    return [run_job(j) for j in jobs]
