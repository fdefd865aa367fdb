"""Your own ``nn.Module``, trained three ways on 2 ranks, each equal to one process.

A two-layer MLP regression (defined here, nothing of shardwise's) is trained for a few
SGD-with-momentum steps on a synthetic global batch:

- (a) data parallel: ``shardwise.DistributedDataParallel`` (each rank half the batch,
  gradients all-reduced and averaged; Li et al., VLDB 2020);
- (b) ZeRO-2: ``shardwise.ZeroDataParallel(stage=2)`` (each rank half the batch; gradients
  reduce-scattered, each rank steps the fp32 master of its half of the parameters, then
  all-gathers them; Rajbhandari et al., SC 2020);
- (c) tensor parallel: the MLP's two ``nn.Linear`` replaced by ``ColumnParallelLinear`` then
  ``RowParallelLinear`` over a ``RankGroup`` (Megatron-LM's MLP split, Shoeybi et al. 2019,
  arXiv:1909.08053, section 3: no communication between the two layers; one all-reduce
  forward, one backward). Both ranks see the whole batch; each holds half the hidden units.

Each run is compared with the same model trained in this process on the whole batch: the
largest relative difference of the per-step losses and of the final parameters must be
<= 1e-5 (fp32; what is left is the order of floating-point sums).

Run (2 CPU ranks over gloo, a few seconds each)::

    PYTHONPATH=src python examples/own_module_ddp_zero_tp.py
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise

SEED, STEPS, BATCH, D_IN, HIDDEN, D_OUT, LR, MOMENTUM = 0, 6, 32, 16, 64, 8, 0.05, 0.9
WORLD = 2
TOLERANCE = 1e-5  # fp32


class MLP(nn.Module):
    """The user's model: (B, D_IN) -> (B, D_OUT)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def build_model() -> MLP:
    torch.manual_seed(SEED)  # the same initial weights in every process
    return MLP()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches (x (BATCH, D_IN), y (BATCH, D_OUT)) of a noisy linear target."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(D_IN, D_OUT, generator=g)
    out = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, D_IN, generator=g)
        out.append((x, x @ w + 0.1 * torch.randn(BATCH, D_OUT, generator=g)))
    return out


def sgd(params) -> torch.optim.Optimizer:
    """Any torch optimizer works with every wrapper; SGD keeps the check about the technique.
    (AdamW's first steps move each weight by about ``lr * sign(grad)``: a gradient that is 0
    up to rounding can then differ by a whole ``lr`` between a sum in two halves and a sum
    in one: 1.1e-5 to 1.3e-5 of the largest weight here with AdamW at lr 1e-2, alike
    for all three wrappers.)"""
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def reference() -> dict:
    """One process, the whole batch: the result every layout must reproduce."""
    model = build_model()
    opt = sgd(model.parameters())
    losses = []
    for x, y in batches():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _dp_topology() -> shardwise.Topology:
    rank = torch.distributed.get_rank()
    return shardwise.init_process_groups(shardwise.Topology.build(dp=WORLD, rank=rank,
                                                                  world_size=WORLD))


def _mean_over_ranks(loss: torch.Tensor, group) -> float:
    """The global batch's loss: each rank's mean over its equal half, averaged."""
    t = loss.detach().reshape(1).clone()
    shardwise.comm.all_reduce(t, op="mean", group=group)
    return t.item()


# -- (a) data parallel ------------------------------------------------------------------------
def train_ddp() -> dict:
    topo = _dp_topology()
    model = build_model()
    ddp = shardwise.DistributedDataParallel(model, topo.groups.dp)
    opt = sgd(model.parameters())
    losses = []
    for x, y in batches():
        lo = topo.dp_rank * (BATCH // WORLD)
        x, y = x[lo:lo + BATCH // WORLD], y[lo:lo + BATCH // WORLD]   # this rank's half
        ddp.zero_grad()  # zeroes the buckets in place: param.grad stays a view of them
        loss = F.mse_loss(ddp(x), y)
        loss.backward()  # returns with every gradient averaged over the dp group
        opt.step()
        losses.append(_mean_over_ranks(loss, topo.groups.dp))
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


# -- (b) ZeRO-2 -------------------------------------------------------------------------------
def train_zero() -> dict:
    topo = _dp_topology()
    model = build_model()
    zero = shardwise.ZeroDataParallel(model, topo.groups.dp, stage=2)
    # the optimizer sees only this rank's fp32 master pieces, not the model's parameters
    opt = sgd(zero.param_groups(weight_decay=0.0))
    losses = []
    for x, y in batches():
        lo = topo.dp_rank * (BATCH // WORLD)
        x, y = x[lo:lo + BATCH // WORLD], y[lo:lo + BATCH // WORLD]
        zero.zero_grad()
        loss = F.mse_loss(zero(x), y)
        zero.scale_loss(loss).backward()  # reduce-scatter: this rank gets its gradient shard
        zero.step(opt)                    # step the shard, all-gather the full parameters
        losses.append(_mean_over_ranks(loss, topo.groups.dp))
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


# -- (c) tensor parallel ----------------------------------------------------------------------
def apply_tp(model: MLP, tp: shardwise.RankGroup) -> MLP:
    """Megatron's MLP split: fc1 by output features (column), fc2 by input features (row).
    Each shard is cut from the layer it replaces (``master``), so the model is unchanged."""
    model.fc1 = shardwise.ColumnParallelLinear(D_IN, HIDDEN, tp, master=model.fc1)  # -> (B, H/N)
    model.fc2 = shardwise.RowParallelLinear(HIDDEN, D_OUT, tp, input_is_parallel=True,
                                            master=model.fc2)                       # -> (B, D_OUT)
    return model


def train_tp() -> dict:
    rank = torch.distributed.get_rank()
    topo = shardwise.init_process_groups(shardwise.Topology.build(tp=WORLD, rank=rank,
                                                                  world_size=WORLD))
    tp = shardwise.RankGroup.from_topology(topo)
    model = apply_tp(build_model(), tp)
    # SGD is elementwise: stepping each shard is stepping the full tensor
    opt = sgd(model.parameters())
    losses = []
    for x, y in batches():  # the whole batch on every tp rank
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)  # the same value on both ranks (after g's all-reduce)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # sharded parameters carry tp_dim: the dim to concatenate the ranks' shards along
    return {"losses": losses,
            "params": {n: p.detach() for n, p in model.named_parameters()},
            "tp_dim": {n: getattr(p, "tp_dim", -1) for n, p in model.named_parameters()}}


# -- comparison -------------------------------------------------------------------------------
def max_rel_diff(got: dict, ref: dict) -> tuple[float, float]:
    """(losses, parameters): the largest |got - ref| / max|ref| over steps / tensors."""
    loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    param = max(((got["params"][n] - r).abs().max() / r.abs().max()).item()
                for n, r in ref["params"].items())
    return loss, param


def unshard(per_rank: list[dict]) -> dict:
    """The tp ranks' shards joined back into the single-process model's tensors."""
    first = per_rank[0]
    params = {n: (torch.cat([r["params"][n] for r in per_rank], dim=d) if d >= 0
                  else first["params"][n]) for n, d in first["tp_dim"].items()}
    return {"losses": first["losses"], "params": params}


def main() -> dict:
    ref = reference()
    runs = {"ddp": shardwise.spawn(train_ddp, WORLD, threads=1, device="cpu"),
            "zero2": shardwise.spawn(train_zero, WORLD, threads=1, device="cpu"),
            "tp": shardwise.spawn(train_tp, WORLD, threads=1, device="cpu")}
    report = {}
    for way, per_rank in runs.items():
        got = unshard(per_rank) if way == "tp" else per_rank[0]
        # every rank must agree with the reference, not only rank 0
        diffs = [max_rel_diff(got, ref)] + ([max_rel_diff(r, ref) for r in per_rank[1:]]
                                            if way != "tp" else [])
        loss, param = max(d[0] for d in diffs), max(d[1] for d in diffs)
        report[way] = {"loss": loss, "params": param}
        print(f"{way:6s} max relative difference vs one process: loss {loss:.2e}, "
              f"parameters {param:.2e}")
    worst = max(max(r.values()) for r in report.values())
    assert worst <= TOLERANCE, f"parity broken: {worst:.2e} > {TOLERANCE:.0e}"
    print(f"parity OK: every way within {TOLERANCE:.0e} of one process "
          f"(final loss {ref['losses'][-1]:.4f}, from {ref['losses'][0]:.4f})")
    return report


if __name__ == "__main__":  # the guard spawn needs: each rank re-imports this file
    main()
