"""The cross-replica reduction of HSDP, behind one small interface.

Data parallelism in two levels (HSDP: PyTorch FSDP2's hybrid sharding, torchtitan's
``data_parallel_replicate_degree``, ZeRO++'s hpZ and MiCS): the gradient sync reduces (or
reduce-scatters) inside a replica first, then hands what it holds to ``Replicas.average_``,
the mean across the R replicas. ``Replicas`` does it over an in-job ``torch.distributed``
group (the topology's ``dp_replicate`` group) through ``shardwise.comm``, bytes counted like
every collective; ``comm.torchft_replicas.TorchftReplicas`` (each replica group its own job,
torchft's managed process group between them) is the same seam. ``commit()`` is the step's
vote before the optimizer steps. ``NO_REPLICAS`` (R = 1) does nothing.
"""

from __future__ import annotations

from typing import Sequence

import torch

from shardwise.comm.api import all_reduce


class Replicas:
    """The replicas of one place of the grid: ``group`` (a ``torch.distributed`` group of
    ``size`` ranks, one per replica; None with ``size == 1``); ``rank``: this replica's
    index among them (the global norm counts a tensor the replicas share on replica 0)."""

    def __init__(self, group=None, size: int = 1, rank: int = 0):
        self.group, self.size, self.rank = group, size, rank

    @torch.no_grad()
    def average_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replace each tensor (any shape and dtype, on the group's device) with its mean over
        the replicas, in place; one all-reduce per tensor, launched together. Nothing with
        one replica."""
        if self.size == 1:
            return
        handles = [all_reduce(t, op="mean", group=self.group, algorithm="auto", async_op=True,
                              check=False) for t in tensors if t.numel()]
        for h in handles:
            h.wait()

    def commit(self) -> bool:
        """Whether the optimizer steps on this step's gradients: always, in one job (a step
        either completes on every rank or the job fails); torchft's vote across jobs."""
        return True


NO_REPLICAS = Replicas()  # R = 1: every call does nothing
