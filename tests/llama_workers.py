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

``train`` and ``report`` are the two halves of ``run_job``; ``moe_workers`` builds its
jobs from them.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from shardwise.base.config import Config


def report(trainer) -> dict:
    """What every job reports: the losses (and whether all are finite), this rank's stage
    parameters unsharded (full model names: gathered over tp and ep, and over dp under
    ZeRO-3), the last stage's copy of a tied head (pp > 1) as ``tied_head``, the shapes of
    this rank's own pieces (``local_shapes``), the bytes it holds, the model's config."""
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


def train(job: dict) -> tuple:
    """Build the trainer of ``job["cfg"]`` and train it to ``training.steps``: when
    ``job["kind"] == "resume"`` it first loads ``job["path"]`` (or, without one, the newest
    checkpoint under ``job["from_dir"]``: a run of the same spawn); it saves after step
    ``job["save_at"]``; with ``job["measure_memory"]`` the executor's activation meter is
    on. Returns ``(trainer, out, infos)``: ``out`` holds ``resumed_at``, ``saved`` and
    ``activations`` (the meter's peak) where they apply, ``infos`` what each
    ``train_step`` returned."""
    from shardwise import checkpoint
    from shardwise.apps.lm.trainer import build_trainer

    cfg = Config.from_dict(job["cfg"])
    trainer = build_trainer(cfg)
    trainer.engine.executor.measure_memory = bool(job.get("measure_memory"))
    out, infos = {}, []
    if job["kind"] == "resume":
        trainer.resume(job.get("path") or checkpoint.latest_checkpoint(job["from_dir"]))
        out["resumed_at"] = trainer.step
    while trainer.step < cfg.training.steps:
        infos.append(trainer.train_step())
        if trainer.step == job.get("save_at"):
            out["saved"] = str(trainer.save_checkpoint())
    if job.get("measure_memory"):
        out["activations"] = trainer.engine.executor.meter.peak
    return trainer, out, infos


def run_job(job: dict) -> dict:
    """One job (see ``train``) and its report."""
    trainer, out, _ = train(job)
    return {**report(trainer), **out}


def llama_worker(jobs: list[dict]) -> list[dict]:
    torch.set_num_threads(1)
    return [run_job(j) for j in jobs]
