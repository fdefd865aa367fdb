"""Rank function for the per-rank memory gather (run inside ``shardwise.launch.spawn``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.training.memory import gather_per_rank


def gather(values_of_rank: list[list[float]]) -> list[list[float]]:
    """This rank's row of ``values_of_rank`` gathered over the world, on the CPU."""
    return gather_per_rank(values_of_rank[dist.get_rank()], None, torch.device("cpu"))
