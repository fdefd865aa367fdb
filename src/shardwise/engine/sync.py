"""Wrap this rank's chunks for data parallelism: one object per ZeRO stage, one interface.

Every gradient sync the engine uses answers the same calls, so the engine never asks
which one it holds:

- ``final_backward()``: a context; backwards inside it make gradients final, so their
  buckets' collectives start at once (overlapping the rest of the schedule);
- ``finish()``: launch what is left, wait, average over dp;
- ``zero_grad()``;
- ``pieces`` (fp32 master tensors the optimizer steps), ``piece_grads()`` (their fp32
  gradients), ``piece_params`` / ``piece_names`` (which parameter each is part of, and its
  checkpoint key), ``counted`` (see ``zero.precision.fp32_step``), ``after_step()``
  (masters back into the compute-dtype parameters);
- ``full_parameters()``: a context in which every parameter is whole (ZeRO-3 gathers;
  the others hold them whole already);
- ``buckets_overlapped()``: our DDP's ``[buckets launched before the schedule's end,
  buckets]`` of the last step, None for the others;
- ``param_shards()`` / ``grad_shards()`` and ``future_grad_bytes()``: memory held beyond
  the model's parameters, and gradient bytes that will be kept once the first backward
  has made them (for the memory report).

``ReplicatedSync`` (ZeRO-0: our DDP's buckets, all-reduced; fp32 masters only when the
compute dtype is bf16/fp16), ``zero.ZeroDataParallel`` (ZeRO-1/2: the same buckets,
reduce-scattered; masters of this rank's shard; all-gather after the step) and
``zero.ZeroStage3`` (parameters sharded too, gathered per unit) are the three.

Under ZeRO-3 each chunk of the rank is a ``ZeroStage3`` of its own (its own units and flat
buffers: with the interleaved schedule, v per rank), joined with ``SplitSync``. Under expert
parallelism (ep > 1) with ZeRO 0-2 the engine wraps twice and joins the two with
``SplitSync``: the dense parameters over the dp x cp group as above, the expert parameters
(``parallel.experts.is_expert``) over the ``ep_dp_cp`` group, the ranks holding the same
experts (DeepSpeed-MoE's expert-data-parallel group, ``ep_dp``, times the cp ranks, which
hold the same experts and see other tokens), their sums divided by the whole dp x cp size
(each expert already summed the gradients of the ep ranks' tokens it served).
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext

import torch
import torch.nn as nn

from shardwise.comm.replicas import NO_REPLICAS, Replicas
from shardwise.parallel.data_parallel.grad_sync import GradientSync
from shardwise.parallel.precision import host_master


class ReplicatedSync:
    """ZeRO-0: every dp rank holds full parameters, gradients and optimizer states.

    ``params``: this rank's parameters (full model names in ``names``), in registration order.
    ``group``/``dp_size``/``dp_rank``: the dp group (``dp_size == 1``: no communication).
    ``param_dtype``: compute dtype; with bf16/fp16 each parameter gets an fp32 master and
    the parameter is cast down (Micikevicius et al. 2018), with fp32 the parameter is its own
    master. ``bucket_mb`` / ``first_bucket_mb``: bucket capacities in MiB; they and the
    all-reduce algorithm are our DDP's (``GradientSync``). ``divisor``: the sums are divided
    by it (default ``dp_size``; expert parameters: the whole dp x cp size, also when their
    group is one rank). ``replicas`` (HSDP, a ``comm.replicas.Replicas``): the averaged
    gradients are then averaged across them (the engine passes none: in one job the all-reduce
    over the whole dp x cp group already is that mean, in one collective). ``offload``:
    the fp32 masters in host memory (``training.offload = "optimizer"``), fp32 runs too.
    """

    def __init__(self, params: list[nn.Parameter], names: dict[int, str], group, dp_size: int,
                 dp_rank: int, param_dtype: torch.dtype, bucket_mb: float,
                 first_bucket_mb: float, allreduce: str, divisor: int | None = None,
                 replicas: Replicas = NO_REPLICAS, offload: bool = False):
        self.params, self.replicas = params, replicas
        self.piece_params = list(params)
        self.piece_names = [names[id(p)] for p in params]
        if offload:  # masters of their own in host memory, whatever the compute dtype
            self.pieces = [nn.Parameter(host_master(p)) for p in params]
            for p in params:
                p.data = p.data.to(param_dtype)
        elif param_dtype == torch.float32:
            self.pieces = list(params)
        else:
            self.pieces = [nn.Parameter(p.detach().float().clone()) for p in params]
            for p in params:
                p.data = p.data.to(param_dtype)
        # replicas: counted once over dp (and over HSDP's replicas)
        self.counted = [dp_rank == 0 and replicas.rank == 0] * len(params)
        self.divisor = dp_size if divisor is None else divisor
        self.sync = (GradientSync(params, group, bucket_mb, first_bucket_mb, allreduce,
                                  divisor=self.divisor)
                     if dp_size > 1 else None)

    def final_backward(self):
        """A context: backwards inside it make gradients final, so each full bucket's all-reduce
        starts at once (a null context when dp = 1)."""
        return self.sync.final_backward() if self.sync is not None else nullcontext()

    def finish(self) -> None:
        """Launch the remaining buckets, wait, divide the sums by ``divisor`` (dp = 1: divide only
        when ``divisor`` > 1), then average over HSDP's ``replicas``."""
        if self.sync is not None:
            self.sync.finish()
        elif self.divisor > 1:  # one rank holds these experts: only the mean over dp
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(self.divisor)
        self.replicas.average_(self.grad_shards())

    def zero_grad(self) -> None:
        """Zero the gradients in place (the buckets, or each kept ``param.grad``)."""
        if self.sync is not None:
            self.sync.zero_grad()  # in place: gradients stay views into the buckets
        else:  # kept and zeroed in place, as the buckets are: memory held between steps
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)  # one launch on CUDA; a loop on the CPU

    def piece_grads(self) -> list[torch.Tensor]:
        """Each piece's fp32 gradient, in ``pieces`` order; zeros where no backward has made one."""
        return [p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
                for p in self.params]

    @torch.no_grad()
    def after_step(self) -> None:
        """Copy the fp32 masters into the compute-dtype parameters (fp32: nothing to copy)."""
        pairs = [(p, m) for p, m in zip(self.params, self.pieces) if p is not m]
        if pairs and pairs[0][0].device != pairs[0][1].device:  # offloaded: host to device
            for p, m in pairs:
                p.copy_(m, non_blocking=m.is_pinned())
        elif pairs:  # masters cast into the compute-dtype parameters, one launch on CUDA
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    def full_parameters(self):
        """Every parameter is whole already: nothing to gather."""
        return nullcontext()

    def buckets_overlapped(self) -> list[int] | None:
        """``[buckets launched before finish(), buckets]`` of the last step (None: dp = 1)."""
        return None if self.sync is None else [self.sync.launched_early, len(self.sync.buckets)]

    def future_grad_bytes(self) -> int:
        """Without buckets: the bytes of the gradients kept between steps (zeroed in place)
        that no backward has made yet."""
        if self.sync is not None:
            return 0
        return sum(q.numel() * q.element_size() for q in self.params
                   if q.grad is None and q.requires_grad)

    def param_shards(self) -> list[torch.Tensor]:
        """Parameter memory beyond the model's parameters: none without ZeRO-3."""
        return []

    def grad_shards(self) -> list[torch.Tensor]:
        """Gradient memory this rank keeps between steps (for the memory report)."""
        if self.sync is not None:
            return [b.buffer for b in self.sync.buckets]
        return [p.grad for p in self.params if p.grad is not None]


class SplitSync:
    """Several syncs answering as one (see module docstring): under ep, ``dense`` over
    dp x cp then ``experts`` over ep_dp x cp; under ZeRO-3, one ``ZeroStage3`` per chunk of
    this rank (each gathered and reduce-scattered around its own micro-batches). Pieces are
    the parts' in the order given; ``full_parameters`` gathers every part that shards."""

    def __init__(self, *parts):
        self.parts = parts
        self.pieces = [m for part in parts for m in part.pieces]
        self.piece_params = [q for part in parts for q in part.piece_params]
        self.piece_names = [n for part in parts for n in part.piece_names]
        self.counted = [c for part in parts for c in part.counted]

    def final_backward(self):
        """Every part's ``final_backward`` entered in order, as one context (an ``ExitStack``)."""
        stack = ExitStack()
        for part in self.parts:
            stack.enter_context(part.final_backward())
        return stack

    def finish(self) -> None:
        """Each part's ``finish`` in order, each over its own group."""
        for part in self.parts:
            part.finish()

    def zero_grad(self) -> None:
        """Each part's ``zero_grad`` (in place)."""
        for part in self.parts:
            part.zero_grad()

    def piece_grads(self) -> list[torch.Tensor]:
        """The parts' fp32 piece gradients, concatenated in ``pieces`` order."""
        return [g for part in self.parts for g in part.piece_grads()]

    def after_step(self) -> None:
        """Each part's ``after_step``: masters back into the compute-dtype parameters."""
        for part in self.parts:
            part.after_step()

    def param_shards(self) -> list[torch.Tensor]:
        """The parts' parameter memory beyond the model's (ZeRO-3's compute-dtype shards)."""
        return [t for part in self.parts for t in part.param_shards()]

    def grad_shards(self) -> list[torch.Tensor]:
        """The parts' gradient memory kept between steps, for the memory report."""
        return [t for part in self.parts for t in part.grad_shards()]

    def full_parameters(self):
        """Every part's parameters whole inside the block (ZeRO-3 parts gather, in order:
        collective over their groups), nothing to do for the others."""
        stack = ExitStack()
        for part in self.parts:
            stack.enter_context(part.full_parameters())
        return stack

    def buckets_overlapped(self) -> None:
        """Not reported for several parts."""
        return None

    def future_grad_bytes(self) -> int:
        """The parts' gradient bytes still to be made (see ``ReplicatedSync``)."""
        return sum(part.future_grad_bytes() for part in self.parts)
