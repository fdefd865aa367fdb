"""Rank functions for the CNN hybrid tests (run inside ``shardwise.launch.spawn``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise import comm
from shardwise.apps.cnn import LayerPlan, Plan, named_plans
from shardwise.apps.cnn.cost import layer_plan
from shardwise.apps.cnn.hybrid import HybridCNN
from shardwise.models.cnn import CNN, CNNConfig
from shardwise.parallel.tensor_parallel import RankGroup

# small enough to be quick, every width divisible by 4 (classes too, for column on fc3)
SMALL = CNNConfig(image_size=16, channels=(4, 8), hidden=(32, 16), classes=8)
SMALL5 = CNNConfig(image_size=16, channels=(4, 8), kernel=5, hidden=(32, 16), classes=8)
# an Inception block after one convolution: four branches of uneven FLOPs (5x5 > 3x3 >>
# 1x1 = pool), and two branches (fewer than 4 ranks: two ranks hold none)
INCEPTION4 = CNNConfig(image_size=16, channels=(4,), hidden=(16,), classes=8,
                       inception=(("1x1", 4), ("3x3", 8), ("5x5", 4), ("pool", 4)))
INCEPTION2 = CNNConfig(image_size=16, channels=(4,), hidden=(16,), classes=8,
                       inception=(("3x3", 4), ("pool", 4)))
LR, CLIP = 3e-3, 1.0
B, F_, R = "batch", "feature", "full"


def make_batches(steps: int, batch: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(batch, 1, 16, 16, generator=g),
             torch.randint(0, SMALL.classes, (batch,), generator=g)) for _ in range(steps)]


def make_opt(params, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=LR)


def reference(seed: int, batches: list, kind: str = "adamw", cfg: CNNConfig = SMALL) -> dict:
    """One process: the full CNN, mean cross-entropy, the same optimizer and clipping."""
    torch.manual_seed(seed)
    model = CNN(cfg)
    opt = make_opt(model.parameters(), kind)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def hand_plans(specs, batch: int, n: int) -> dict[str, Plan]:
    """Two plans that between them take every layout change, fused or not."""
    lp = LayerPlan
    mixed1 = (lp("replicated", R, R), lp("dp", B, B), lp("row", F_, B), lp("column", B, F_),
              lp("column", R, F_))
    mixed2 = (lp("dp", B, B), lp("replicated", R, R), lp("column", R, F_), lp("dp", B, B),
              lp("row", F_, R))
    return {k: Plan(v, tuple(specs), batch, n, 0.0) for k, v in
            (("mixed1", mixed1), ("mixed2", mixed2))}


def conv_plans(specs, specs5, batch: int, n: int) -> dict[str, tuple[Plan, CNNConfig]]:
    """Each convolution strategy alone (the fully connected layers data parallel), and three
    mixed plans that between them take every layout change of a feature map."""
    lp, Rw = LayerPlan, "rows"
    dp3 = (lp("dp", B, B),) * 3
    plans = {
        "filters": ((lp("filters", R, F_), lp("filters", R, F_)) + dp3, SMALL),
        "channels": ((lp("dp", B, B), lp("channels", F_, R)) + dp3, SMALL),  # conv1: 1 channel
        "spatial": ((lp("spatial", Rw, Rw),) * 2 + dp3, SMALL),
        "spatial5": ((lp("spatial", Rw, Rw),) * 2 + dp3, SMALL5),
        "mixed3": ((lp("spatial", Rw, Rw), lp("filters", R, F_), lp("row", F_, B),
                    lp("dp", B, B), lp("column", B, F_)), SMALL),
        "mixed4": ((lp("filters", B, F_), lp("channels", F_, B), lp("column", B, F_),
                    lp("row", F_, R), lp("replicated", R, R)), SMALL),
        "mixed5": ((lp("dp", B, B), lp("spatial", Rw, Rw), lp("column", R, F_),
                    lp("row", F_, R), lp("replicated", R, R)), SMALL),
    }
    return {k: (Plan(v, tuple(specs5 if c is SMALL5 else specs), batch, n, 0.0), c)
            for k, (v, c) in plans.items()}


def spatial_cases(steps: int = 3) -> dict:
    """``SpatialConv2d`` alone, kernel 3 and 5, stride 1 and 2, padding k // 2, against one
    ``nn.Conv2d`` (every rank computes it too): SGD on a squared error, losses and final
    parameters; and the halo bytes of one forward + backward summed over the ranks (all
    gathered, so every rank reports them)."""
    from shardwise.apps.cnn.conv import SpatialConv2d
    from shardwise.apps.cnn.layout import my_rows

    n, rank = dist.get_world_size(), dist.get_rank()
    group = RankGroup(group=dist.group.WORLD, size=n, rank=rank, all_reduce="ring", gather="ring")
    out = {}
    for k in (3, 5):
        for s in (1, 2):
            torch.manual_seed(10 * k + s)
            full = torch.nn.Conv2d(3, 4, k, stride=s, padding=k // 2)
            x, c_in, w_ = torch.rand(2, 3, 16, 12), 3, 12
            # a deeper layer's input: its gradient flows back through the halo exchange
            x_ref, x_mine = x.clone().requires_grad_(), x.clone().requires_grad_()
            t = torch.rand(2, 4, 16 // s, 12 // s)
            mine = SpatialConv2d(full, group, tag="c")
            opt_ref = torch.optim.SGD(full.parameters(), lr=0.1)
            opt = torch.optim.SGD(mine.parameters(), lr=0.1)
            ref_losses, losses, halo = [], [], None
            for step in range(steps):
                opt_ref.zero_grad()
                loss = ((full(x_ref) - t) ** 2).sum() / t.numel()
                loss.backward()
                opt_ref.step()
                ref_losses.append(float(loss))
                opt.zero_grad()
                with comm.accounting.recording() as rec:
                    y = mine(my_rows(x_mine, group, 2))
                    part = ((y - my_rows(t, group, 2)) ** 2).sum() / t.numel()
                    part.backward()
                if step == 0:
                    halo = sum(r.bytes_sent for r in rec.records)
                    x_err = float((my_rows(x_mine.grad, group, 2) - my_rows(x_ref.grad, group, 2))
                                  .norm() / my_rows(x_ref.grad, group, 2).norm())
                for p in mine.parameters():
                    comm.all_reduce(p.grad, group=group.group, algorithm="ring")
                opt.step()
                got = part.detach().clone()
                comm.all_reduce(got, group=group.group, algorithm="ring")
                losses.append(float(got))
            every = torch.tensor([float(halo)])
            comm.all_reduce(every, group=group.group, algorithm="ring")
            out[(k, s)] = {"losses": losses, "ref_losses": ref_losses, "input_grad_err": x_err,
                           "halo_bytes_all_ranks": float(every),
                           "halo_formula_all_ranks": 2 * (n - 1) * (k - s) * 4 * 2 * c_in * w_,
                           "params": {nm: p.detach().clone() for nm, p in mine.named_parameters()},
                           "ref_params": {nm: p.detach().clone()
                                          for nm, p in full.named_parameters()}}
    return out


def suite_worker(seed: int, batches: list) -> dict:
    """Train every plan on these batches; report losses, final full parameters, and the
    bytes this rank sent in the first step (forward, backward, gradient sync) beside the
    plan's prediction (argument-agreement rounds off, as shapes are fixed by construction)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    comm.configure(check=False)  # no argument-agreement rounds: the bytes are the payload's
    group = RankGroup(group=dist.group.WORLD, size=n, rank=rank, all_reduce="ring", gather="ring")
    batch = len(batches[0][1])
    specs = CNN(SMALL).specs()
    plans = {k: (v, SMALL) for k, v in
             {**named_plans(specs, batch, n), **hand_plans(specs, batch, n)}.items()}
    plans["tp-fc-sgd"] = plans["tp-fc"]  # SGD with momentum instead of AdamW
    plans.update(conv_plans(specs, CNN(SMALL5).specs(), batch, n))
    out = train_plans(seed, batches, group, {name: (cfg, p) for name, (p, cfg) in plans.items()})
    out["spatial_cases"] = spatial_cases()
    out["branches"] = train_plans(seed, batches, group, branch_plans(batch, n))
    return out


def branch_worker(seed: int, batches: list) -> dict:
    """``branch_plans`` alone, with the gather-then-layout-change plan and without the
    tensor-parallel one (any rank count)."""
    comm.configure(check=False)
    n, rank = dist.get_world_size(), dist.get_rank()
    group = RankGroup(group=dist.group.WORLD, size=n, rank=rank, all_reduce="ring", gather="ring")
    plans = branch_plans(len(batches[0][1]), n, extra=True)
    return train_plans(seed, batches, group, {k: v for k, v in plans.items() if k != "branch-tp"})


def branch_plans(batch: int, n: int, extra: bool = False) -> dict[str, tuple[CNNConfig, Plan]]:
    """The Inception models' branch placements: between data-parallel layers (batch in and
    out: all-gather in, all-to-all out; or out through the full layout), alone among
    replicated layers (full in and out; its bytes are the step's), before tensor-parallel
    layers, and two branches on n ranks. ``extra``: also out through the full layout then
    into the dp layer (the slow set's; its parts are in the others)."""
    out = {}
    for name, cfg, strategies, layouts in (
            ("dp-branch-dp", INCEPTION4, ("dp", "branch", "dp", "dp"),
             ((B, B), (B, B), (B, B), (B, B))),
            ("dp-branch-full-dp", INCEPTION4, ("dp", "branch", "dp", "dp"),
             ((B, B), (B, R), (B, B), (B, B))),
            ("only-branch", INCEPTION4, ("replicated", "branch", "replicated", "replicated"),
             ((R, R), (R, R), (R, R), (R, R))),
            ("branch-tp", INCEPTION4, ("dp", "branch", "column", "row"),
             ((B, B), (B, R), (R, F_), (F_, R))),
            ("two-branches", INCEPTION2, ("dp", "branch", "dp", "dp"),
             ((B, B), (B, B), (B, B), (B, B)))):
        specs = CNN(cfg).specs()
        layers = tuple(layer_plan(sp, s, i, o, n) for sp, s, (i, o) in
                       zip(specs, strategies, layouts))
        out[name] = (cfg, Plan(layers, tuple(specs), batch, n, 0.0))
    return out if extra else {k: v for k, v in out.items() if k != "dp-branch-full-dp"}


def train_plans(seed: int, batches: list, group: RankGroup,
                plans: dict[str, tuple[CNNConfig, Plan]]) -> dict:
    """Each (model, plan) trained on ``batches``: losses, full parameters, first-step bytes."""
    out = {}
    for name, (cfg, plan) in plans.items():
        torch.manual_seed(seed)
        model = HybridCNN(CNN(cfg), plan, group)
        opt = make_opt(model.parameters(), "sgd" if name.endswith("sgd") else "adamw")
        losses, measured = [], None
        for step, (x, y) in enumerate(batches):
            model.zero_grad()
            with comm.accounting.recording() as rec:
                loss, correct = model.loss_and_backward(x, y)
                model.sync_gradients()
            if step == 0:
                measured = sum(r.bytes_sent for r in rec.records)
            model.clip_grad_norm_(CLIP)
            opt.step()
            losses.append(model.global_metrics(loss, correct, torch.device("cpu"))[0])
        out[name] = {"strategies": plan.strategies, "losses": losses,
                     "params": model.full_state(), "bytes_measured": measured,
                     "bytes_predicted": plan.bytes_per_step,
                     "placement": [lp.placement for lp in plan.layers]}
    return out
