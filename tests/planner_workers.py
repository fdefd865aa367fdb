"""Rank function for the planner tests: several layouts in one spawn, each trained one step
with the executor's activation meter on; every rank reports its measured bytes."""

from __future__ import annotations

import dataclasses

import torch

from shardwise.base.config import Config


def measure_worker(configs: list[dict]) -> list[dict]:
    from shardwise.apps.lm.trainer import build_trainer

    torch.set_num_threads(1)
    out = []
    for c in configs:
        trainer = build_trainer(Config.from_dict(c))
        trainer.engine.executor.measure_memory = True  # meter saved-for-backward bytes
        trainer.train_step()
        out.append({"coords": trainer.topology.coords, "memory": trainer.engine.memory_bytes(),
                    "activations": trainer.engine.executor.meter.peak,
                    "gpt": dataclasses.asdict(trainer.model_cfg)})
    return out
