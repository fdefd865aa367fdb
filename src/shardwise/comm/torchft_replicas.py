"""The cross-replica seam (``comm.replicas.Replicas``: ``size``, ``rank``, ``average_``,
``commit``) over torchft.

The data-parallel wrappers reduce gradients inside a replica group first, then hand the
result to a replicas object that averages it across the replica groups. Here that mean goes
through a torchft ``Manager`` (its managed process group: gloo for CPU tensors, NCCL for
CUDA ones, chosen where the Manager is built, ``training.fault_tolerance``), over the replica
groups of the current quorum only: a lost replica leaves the others averaging among
themselves at the next step. A collective that fails does not raise here: torchft records the
error, the step's ``should_commit`` vote is then False everywhere and the step is redone.
Source: torchft's ``Manager.allreduce`` (https://github.com/pytorch/torchft)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch.distributed import ReduceOp
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from shardwise.comm import accounting
from shardwise.comm.replicas import Replicas

if TYPE_CHECKING:
    from torchft import Manager


class TorchftReplicas(Replicas):
    """Mean of tensors across the live replica groups of a torchft quorum.

    ``size``: replica groups taking part in the current step (blocks until the step's
    quorum is known). ``rank``: 0 (each replica group is its own job: its global norm counts
    every tensor it holds). ``average_(tensors)``: each tensor replaced by its mean over
    them, in place, one all-reduce per dtype and device (the tensors flattened into one
    buffer). ``commit()``: ``vote()`` (default: torchft's ``should_commit``)."""

    def __init__(self, manager: "Manager", vote: Callable[[], bool] | None = None):
        self.manager, self.group, self.rank = manager, None, 0
        self._vote = vote or manager.should_commit

    @property
    def size(self) -> int:
        return self.manager.num_participants()

    def average_(self, tensors: Sequence[torch.Tensor]) -> None:
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for group in groups.values():
            flat = _flatten_dense_tensors(group)
            if accounting.log.enabled:  # the backend moves the bytes: counted as unknown
                rank = self.manager.participating_rank() or 0  # the replica's rank
                accounting.native_record("all_reduce", self.size, rank, rank,
                                         flat.numel() * flat.element_size(), flat.dtype)
            self.manager.allreduce(flat).wait()  # mean: SUM, then / participants
            for t, mean in zip(group, _unflatten_dense_tensors(flat, group)):
                t.copy_(mean)

    def agree(self, values: torch.Tensor) -> bool:
        """True where every live replica group's rank of these coordinates holds the same
        ``values`` (1-d float64, the same length everywhere: one maximum and one minimum
        across the quorum, a single all-reduce); the same answer on each of them."""
        both = torch.cat([values, -values])
        self.manager.allreduce(both, reduce_op=ReduceOp.MAX).wait()
        return bool(torch.equal(both[:values.numel()], values)
                    and torch.equal(-both[values.numel():], values))

    def commit(self) -> bool:
        return self._vote()
