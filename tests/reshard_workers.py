"""Rank function for the resharding tests: save in one layout, resume in another.

``reshard_worker(jobs)`` runs a list of jobs in turn on every rank of one spawn (or in
the test's own process for one rank):

- ``save``: train ``stop`` steps of the run, save a checkpoint, report the losses;
- ``run``: the uninterrupted run (every step) in this layout, its losses;
- ``resume``: a fresh trainer of this layout resumes from ``path`` and finishes the run;
  its losses, and the logical tensors it holds right after loading (``logical_tensors``:
  what it would write back), which must equal the file's bit for bit.
"""

from __future__ import annotations

import torch

from shardwise.base.config import Config


def _job(job: dict) -> dict:
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.engine import state as engine_state

    cfg = Config.from_dict(job["cfg"])
    trainer = build_trainer(cfg)
    if job["kind"] == "save":
        for _ in range(job["stop"]):
            trainer.train_step()
        path = trainer.save_checkpoint()
        return {"losses": list(trainer.history), "path": str(path)}
    if job["kind"] == "run":
        for _ in range(cfg.training.steps):
            trainer.train_step()
        return {"losses": list(trainer.history)}
    trainer.resume(job["path"])
    resumed_at = trainer.step
    with trainer.engine.full_parameters():
        loaded = _full(engine_state.logical_tensors(trainer.engine))
    while trainer.step < cfg.training.steps:
        trainer.train_step()
    return {"losses": list(trainer.history), "resumed_at": resumed_at, "loaded": loaded,
            "coords": trainer.topology.coords}


def _full(tree):
    """DTensor slices (tp-sharded tensors) gathered into whole tensors, for comparison."""
    if isinstance(tree, dict):
        return {k: _full(v) for k, v in tree.items()}
    return tree.full_tensor() if hasattr(tree, "full_tensor") else tree


def reshard_worker(jobs: list[dict]) -> list[dict]:
    torch.set_num_threads(1)
    return [_job(j) for j in jobs]


def fit_worker(configs: list[dict]) -> list[dict]:
    """``Trainer.fit`` for each config in turn (checkpoints every ``checkpoint.every``
    steps, sync or async), then the wait for the last background write; the losses."""
    from shardwise.apps.lm.trainer import build_trainer

    torch.set_num_threads(1)
    out = []
    for c in configs:
        trainer = build_trainer(Config.from_dict(c))
        trainer.fit(progress=False)
        trainer.wait_for_checkpoint()
        out.append({"losses": list(trainer.history)})
    return out
