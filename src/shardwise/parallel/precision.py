"""Mixed precision for ZeRO: low-precision compute, fp32 master weights, loss scaling.

Micikevicius et al., "Mixed Precision Training" (ICLR 2018): parameters and gradients in
fp16/bf16 (2 bytes each), an fp32 master copy and fp32 Adam moments (12 bytes), the
16 bytes per parameter that ZeRO partitions. fp16 needs dynamic loss scaling: the loss is
multiplied by ``scale`` before backward, gradients are divided by it before the step, and
a step whose gradients overflowed anywhere in the dp group is skipped and the scale halved;
after ``growth_interval`` clean steps it doubles. bf16 has fp32's exponent range and needs
no scaling.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.base.config import PRECISIONS
from shardwise.parallel.offload import HOST, Transfers

# the compute dtype of each training.precision: fp8 computes in bf16 around its float8
# matmuls (``parallel.float8``), so parameters, gradients and activations are bf16's
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.bfloat16}
assert tuple(DTYPES) == PRECISIONS  # training.precision's choices

# HOST: host memory, where ``training.offload`` keeps the fp32 masters and AdamW's moments
# (ZeRO-Offload, Ren et al. 2021), and with "optimizer+params" ZeRO-3's parameter shards


def host_master(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A copy of ``t`` in host memory in ``dtype`` (an fp32 master by default; ZeRO-3's
    compute-dtype shard under ``training.offload = "optimizer+params"``), pinned when ``t``
    is on CUDA (so its transfers can be asynchronous); same shape."""
    out = torch.empty(t.shape, dtype=dtype, device=HOST, pin_memory=t.device.type == "cuda")
    out.copy_(t.detach())
    return out


class DynamicLossScaler:
    """Loss scale that halves on overflow and doubles after ``growth_interval`` clean steps."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 1000,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5):
        self.scale = float(init_scale)
        self.growth_interval, self.growth_factor = growth_interval, growth_factor
        self.backoff_factor = backoff_factor
        self._clean = 0
        self.skipped = 0

    def update(self, overflow: bool) -> None:
        """After a step: on overflow, multiply the scale by ``backoff_factor`` (the step was
        skipped); after ``growth_interval`` clean steps in a row, by ``growth_factor``."""
        if overflow:
            self.scale *= self.backoff_factor
            self._clean = 0
            self.skipped += 1
        else:
            self._clean += 1
            if self._clean % self.growth_interval == 0:
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        """The scale, the clean steps since the last change and the skipped steps."""
        return {"scale": self.scale, "clean": self._clean, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``'s values."""
        self.scale, self._clean, self.skipped = state["scale"], state["clean"], state["skipped"]


@torch.no_grad()
def global_norm(grads: list[torch.Tensor], counted: list[bool] | None = None, group=None,
                check_finite: bool = False, device=None) -> tuple[torch.Tensor, bool]:
    """``(L2 norm, overflow)`` of gradients spread over the ranks of ``group``: the squares
    of ``grads[i]`` with ``counted[i]`` (default: all) summed here in float64, then one
    all-reduce over ``group`` (None: the world; "local": none) carries the squared norm and,
    with ``check_finite``, a flag for a non-finite gradient on any rank. The one place the
    project computes a gradient norm. Returns the norm as an fp32 scalar tensor (on the
    gradients' device: reading it is the caller's host synchronisation)."""
    counted = counted if counted is not None else [True] * len(grads)
    dev = device if device is not None else (grads[0].device if grads else torch.device("cpu"))
    stats = torch.zeros(2, dtype=torch.float64, device=dev)  # squared norm, overflow flag
    mine = [g.detach() for g, c in zip(grads, counted) if c]
    if mine and dev.type == "cuda":  # one fused launch for every tensor's norm, not 4 each
        stats[0] = torch.nn.utils.get_total_norm(mine, 2.0, foreach=True).double().square()
    else:  # the CPU's exact reference: squares summed in float64
        for g in mine:
            stats[0] += g.double().pow(2).sum()
    if check_finite:
        stats[1] = float(not all(bool(torch.isfinite(g).all()) for g in grads))
    if group != "local" and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size(group) > 1:
        comm.all_reduce(stats, op="sum", group=group, check=False)  # one reduction: both
    # the flag is read on the host only when asked for: without it the step never waits
    return stats[0].sqrt().float(), bool(stats[1] > 0) if check_finite else False


@torch.no_grad()
def fp32_step(optimizer, pieces: list[torch.nn.Parameter], piece_grads: list[torch.Tensor],
              group, max_norm: float, scaler: DynamicLossScaler | None,
              counted: list[bool] | None = None) -> dict:
    """The optimizer step of every layout, on this rank's fp32 master pieces.

    ``piece_grads[i]`` is the fp32 gradient of master piece ``i`` (transient: freed after
    the step), on the run's device; a piece in host memory (``training.offload``) receives a
    copy (``offload.Transfers``, launched before the norm), clipped and stepped there.
    Unscales (fp16), then one
    all-reduce over ``group`` (the world for the engine; None: the world; "local" or no
    torch.distributed: no reduction) carries both the squared gradient norm and the
    overflow flag, so every rank takes the same decision: skip the
    step on overflow anywhere, else clip to the global norm ``max_norm`` (``<= 0``: no
    clipping; the formula of ``torch.nn.utils.clip_grad_norm_``) and step. ``counted[i]``
    says whether piece ``i``'s squares enter the norm on this rank: a piece replicated on
    several ranks of ``group`` (dp replicas without ZeRO, LayerNorms on every tp rank, the
    second copy of a tied weight) is counted on exactly one of them, so the sum over
    ``group`` is the norm one process would compute. Returns ``{"grad_norm", "skipped"}``:
    the norm a 0-d tensor on the device (nothing here waits for the device unless loss
    scaling must decide whether to skip: fp16 reads the overflow flag once per step).
    """
    if scaler is not None:
        for g in piece_grads:
            g.mul_(1.0 / scaler.scale)
    # the gradients' device: the reduction runs there (offloaded masters live on the host)
    dev = (piece_grads[0].device if piece_grads else
           pieces[0].device if pieces else torch.device("cpu"))
    # offloaded masters (host memory): each gradient's device-to-host copy starts now, on
    # the side stream (CUDA), overlapping the norm's reduction; None where the master is on
    # the gradient's device
    off = [g.device != p.device for p, g in zip(pieces, piece_grads)]
    copies = Transfers(dev) if any(off) else None
    moving = [copies.to_host(g) if o else None for g, o in zip(piece_grads, off)] if copies \
        else []
    total, overflow = global_norm(piece_grads, counted, group, check_finite=scaler is not None,
                                  device=dev)
    if scaler is not None:
        scaler.update(overflow)
    if moving:  # offloaded: the host waits for the copies, then clips and steps there
        copies.wait()
    if overflow:
        return {"grad_norm": float("inf"), "skipped": True}
    if moving:
        piece_grads = [h if h is not None else g for g, h in zip(piece_grads, moving)]
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in piece_grads:
            g.mul_(coef.to(g.device, g.dtype))
    kept = [p.grad for p in pieces]  # a parameter that is its own master keeps its gradient
    for p, g in zip(pieces, piece_grads):
        p.grad = g
    optimizer.step()
    for p, g in zip(pieces, kept):
        p.grad = g  # transient fp32 copies are dropped
    return {"grad_norm": total, "skipped": False}
