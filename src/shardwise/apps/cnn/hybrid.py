"""The CNN with one strategy per layer (``Plan``), over one group of N ranks.

Built from the full single-process ``CNN`` (same seed on every rank, so parity holds by
construction): data-parallel and replicated layers keep their module; column / row layers
become ``shardwise.parallel.tensor_parallel``'s ``ColumnParallelLinear`` / ``RowParallelLinear``,
initialised from the full layer's slice; filters / channels / spatial convolutions
become ``shardwise.apps.cnn.conv``'s layers; a ``branch`` block keeps only this rank's
branches (``shardwise.apps.cnn.branches.BranchParallel``). Between layers,
``layout.convert`` makes the
layout changes the plan asks for; two are fused into the layer beside them (see
``shardwise.apps.cnn.layout``). Parameter names are the single-process CNN's
(``blocks.{i}.layer.weight``); sharded ones carry ``tp_dim``; a placed branch's parameters
live on one rank only (``full_state`` collects them).

One step (``loss_and_backward`` then ``sync_gradients``): every rank holds the global batch
(it reads it itself), keeps its rows if the first layer takes the batch layout, runs the
chain, and computes ``sum of per-sample losses / B`` over the samples its logits hold (its
rows in the batch layout, all in full), so that every gradient is the true gradient of the
global mean loss (``layout``'s convention); then the data-parallel layers' gradients are
summed over the group (``data_parallel.GradientSync``: our DDP's flat buckets, each
all-reduced through ``comm`` as soon as backward has filled it).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise import comm
from shardwise.apps.cnn.branches import BranchParallel
from shardwise.apps.cnn.chooser import Plan
from shardwise.apps.cnn.conv import ChannelConv2d, FilterConv2d, SpatialConv2d
from shardwise.apps.cnn.cost import BRANCH
from shardwise.apps.cnn.layout import BATCH, FEATURE, FULL, ROWS, convert, my_part, my_rows
from shardwise.models.cnn import CNN, Block
from shardwise.parallel.data_parallel import GradientSync
from shardwise.parallel.precision import global_norm
from shardwise.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RankGroup,
    RowParallelLinear,
    gather_from_sequence,
    gather_tensor,
    reduce_scatter_to_sequence,
    shard_tensor,
)

BUCKET_MB = 25.0


class HybridCNN(nn.Module):
    """(B, C, S, S) global batch -> logits of this rank's samples; see module docstring.

    ``group``: a ``RankGroup`` over all N ranks of the plan, the one group for both axes
    (data-parallel layers all-reduce their gradients over it, column / row layers shard
    over it); its ``all_reduce`` / ``gather`` algorithms are used for every collective.
    """

    def __init__(self, full: CNN, plan: Plan, group: RankGroup):
        super().__init__()
        if plan.ranks != group.size:
            raise ValueError(f"the plan is for {plan.ranks} ranks, the group has {group.size}")
        self.plan, self.group, self.cfg = plan, group, full.cfg
        blocks = []
        for b, lp, spec in zip(full.blocks, plan.layers, plan.specs):
            layer = b.layer
            if lp.strategy == "column":
                layer = ColumnParallelLinear(layer.in_features, layer.out_features, group,
                                             master=layer, tag=spec.name)
            elif lp.strategy == "row":
                layer = RowParallelLinear(layer.in_features, layer.out_features, group,
                                          input_is_parallel=True, master=layer, tag=spec.name)
            elif lp.strategy == "filters":
                layer = FilterConv2d(layer, group, lp.layout_in, tag=spec.name)
            elif lp.strategy == "channels":
                layer = ChannelConv2d(layer, group, lp.layout_out, tag=spec.name)
            elif lp.strategy == "spatial":
                layer = SpatialConv2d(layer, group, tag=spec.name)
            elif lp.strategy == BRANCH:
                layer = BranchParallel(layer, lp.placement, group, lp.layout_in, lp.layout_out)
            blocks.append(Block(layer, b.pool, b.last))
        self.blocks = nn.ModuleList(blocks)
        # gradients that are partial sums over ranks: data-parallel layers', and the bias of
        # a row layer whose output leaves in the batch layout (it sees only this rank's rows,
        # as sequence parallelism's replicated parameters do)
        # (and a spatial convolution's, which sees only this rank's rows)
        self.dp_params = [p for b, lp in zip(self.blocks, plan.layers)
                          if lp.strategy in ("dp", "spatial") for p in b.parameters()]
        self.dp_params += [b.layer.bias for b, lp in zip(self.blocks, plan.layers)
                           if lp.strategy in ("row", "channels") and lp.layout_out == BATCH
                           and b.layer.bias is not None]
        # parameters only this rank holds (its placed branches): counted once in the norm
        self.placed = {id(p) for b in self.blocks if isinstance(b.layer, BranchParallel)
                       for p in b.parameters()}
        # our DDP's buckets and hooks: a bucket's all-reduce starts as soon as backward has
        # filled it (armed: every backward is final), summed, not averaged
        self.sync = (GradientSync(self.dp_params, group.group, BUCKET_MB,
                                  allreduce=group.all_reduce, armed=True, average=False)
                     if group.size > 1 and self.dp_params else None)
        self.zero_grad()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero gradients in place; data-parallel ones are views into the flat buckets."""
        if self.sync is not None:
            self.sync.zero_grad()
        for p in self.parameters():
            if p.grad is not None:
                p.grad.detach().zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, str]:
        """Logits and their layout (batch: this rank's B/N rows; full: all B)."""
        tp, layouts = self.group, self.plan.layers
        h = my_part(x, layouts[0].layout_in, tp)
        prev = layouts[0].layout_in
        for block, lp, spec in zip(self.blocks, layouts, self.plan.specs):
            if spec.kind == "fc" and h.dim() > 2:
                if prev == ROWS:  # a band of rows is no slice of the flat features: whole first
                    h, prev = convert(h, ROWS, FULL, tp, spec.name), FULL
                h = h.flatten(1)                                  # (b, C H W)
            layer = block.layer
            if isinstance(layer, ColumnParallelLinear) and lp.layout_in == BATCH:
                h = convert(h, prev, BATCH, tp, spec.name)
                # fused batch -> full: all-gather forward, reduce-scatter backward
                y = layer.local(gather_from_sequence(h, tp, dim=0, tag=spec.name))
            elif isinstance(layer, RowParallelLinear) and lp.layout_out == BATCH:
                h = convert(h, prev, lp.layout_in, tp, spec.name)
                # fused row -> batch: reduce-scatter forward, all-gather backward
                y = reduce_scatter_to_sequence(F.linear(h, layer.weight), tp, dim=0,
                                               tag=spec.name)
                y = y if layer.bias is None else y + layer.bias
            else:
                y = layer(convert(h, prev, lp.layout_in, tp, spec.name))
            h, prev = block.tail(y), lp.layout_out
        if prev == FEATURE:
            h, prev = convert(h, FEATURE, FULL, tp, "logits"), FULL
        return h, prev

    def loss_and_backward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
        """Forward and backward on the global batch ``(x, y)`` (every rank passes the same);
        returns this rank's share of the mean loss and of the correct predictions (sum
        them over the group for the global values: ``global_metrics``)."""
        logits, layout = self(x)
        labels = my_rows(y, self.group) if layout == BATCH else y
        loss = F.cross_entropy(logits, labels, reduction="sum") / y.shape[0]
        loss.backward()
        correct = int((logits.argmax(-1) == labels).sum())
        if layout == FULL and self.group.rank != 0:  # every rank holds the same: count once
            return 0.0, 0
        return float(loss.detach()), correct

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Finish summing the partial gradients (``dp_params``) over the group: launch the
        buckets backward did not fill, wait for all."""
        if self.sync is not None:
            self.sync.finish()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))``, the norm of the whole
        model's gradient (sharded and placed parameters summed over ranks, replicated ones
        once); returns the norm (the same on every rank)."""
        params = [p for p in self.parameters() if p.grad is not None]
        counted = [hasattr(p, "tp_dim") or id(p) in self.placed or self.group.rank == 0
                   for p in params]
        total = global_norm([p.grad for p in params], counted,
                            self.group.group if self.group.size > 1 else "local")[0]
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            p.grad.detach().mul_(coef.to(p.grad.dtype))
        return total

    @torch.no_grad()
    def global_metrics(self, loss: float, correct: int, device) -> tuple[float, int]:
        """Sum each rank's ``(loss, correct)`` share over the group (one small all-reduce)."""
        if self.group.size == 1:
            return loss, correct
        t = torch.tensor([loss, float(correct)], dtype=torch.float64, device=device)
        comm.all_reduce(t, group=self.group.group, algorithm="native", check=False)
        return float(t[0]), int(round(float(t[1])))

    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter, unsharded, in the single-process CNN's names (collective)."""
        out = {n: gather_tensor(p, p.tp_dim, self.group) if hasattr(p, "tp_dim")
               else p.detach().clone() for n, p in self.named_parameters()}
        for name, shape, _ in self.placed_params():
            out[name] = self.collect_placed(out.get(name), shape)
        return out

    def placed_params(self) -> list[tuple[str, torch.Size, int]]:
        """(name, shape, owning rank) of every placed branch's parameters, held or not (the
        same list, in the same order, on every rank)."""
        return [(f"blocks.{i}.layer.{name}", shape, owner) for i, b in enumerate(self.blocks)
                if isinstance(b.layer, BranchParallel) for name, shape, owner in b.layer.all_params]

    @torch.no_grad()
    def collect_placed(self, local: torch.Tensor | None, shape) -> torch.Tensor:
        """The owner's ``local`` tensor on every rank (``None`` elsewhere; collective): summed
        with zeros from the other ranks, exact."""
        t = local.detach().clone() if local is not None else next(
            self.parameters()).new_zeros(shape)
        comm.all_reduce(t, group=self.group.group, algorithm="native", check=False)
        return t

    @torch.no_grad()
    def load_full_state(self, full: dict[str, torch.Tensor]) -> None:
        """Copy this rank's slice of each full tensor into the parameters."""
        for n, p in self.named_parameters():
            p.copy_(shard_tensor(full[n], p.tp_dim, self.group) if hasattr(p, "tp_dim")
                    else full[n])
