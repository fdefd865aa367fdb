"""One distributed optimizer for every layout: fp32 masters, one global norm, one step.

Megatron-LM's distributed optimizer, reduced to what this project needs: whatever the
layout, the optimizer steps fp32 master pieces (whole parameters without ZeRO, this rank's
shard with ZeRO), and per step:

1. the gradient sync's fp32 piece gradients are taken (``sync.piece_grads()``);
2. under sequence parallelism, the gradients of tp-replicated parameters are summed over
   the tp group (each rank saw only its slice of the sequence; Korthikanti et al. 2022,
   section 4.2.2); without it only those of "partial_grad" modules (replicated weights
   applied to this rank's heads: Qwen3's q_norm / k_norm);
3. the two copies of a tied embedding / head on the first and last pipeline stage add each
   other's gradient (one exchange between the two stages, like Megatron's embedding group);
4. ``zero.precision.fp32_step``: unscale (fp16), one all-reduce over the whole world for the
   squared norm and the overflow flag, every replicated piece counted once, so every rank
   clips by the same coefficient and skips the same steps; then AdamW on the masters;
5. ``sync.after_step()`` brings the masters back into the compute-dtype parameters.

``optimizer.state_dtype = "bf16"`` keeps AdamW's two moments in bf16 (``LowPrecisionAdamW``;
torchtitan's and Megatron-Core's precision-aware optimizer), the masters in fp32.
"""

from __future__ import annotations

import math

import torch

from shardwise import comm
from shardwise.comm.coalesce import coalesced_
from shardwise.parallel.precision import DynamicLossScaler, fp32_step
from shardwise.parallel.tensor_parallel.state import sync_replicated_grads

_NO_REDUCTION = "local"  # fp32_step's group for a norm that stays on this rank


def build_adamw(masters: list, decay: list[bool], *, lr: float,
                betas: tuple = (0.9, 0.999), weight_decay: float = 0.01, fused: bool = False,
                state_dtype: torch.dtype = torch.float32) -> torch.optim.Optimizer:
    """The AdamW (Loshchilov & Hutter 2019) the engine steps ``masters`` with (fp32 tensors,
    any shapes): two groups, ``weight_decay`` on those ``decay`` marks (the model's
    matrices) and 0 on the rest; torch's fused kernel where ``fused`` (CUDA), else the loop
    over tensors (``foreach=False``); the moments in ``state_dtype`` (bf16:
    ``LowPrecisionAdamW``). The planner times this one (``planner.hardware``,
    ``planner.kernel_bench``)."""
    groups = [{"params": [m for m, d in zip(masters, decay) if d],
               "weight_decay": weight_decay},
              {"params": [m for m, d in zip(masters, decay) if not d], "weight_decay": 0.0}]
    if state_dtype != torch.float32:
        return LowPrecisionAdamW(groups, lr=lr, betas=betas, state_dtype=state_dtype)
    # fused: one kernel over every tensor (CUDA's default); the loop over tensors is the
    # CPU's reference: each element's arithmetic is the same whatever the pieces are
    kernel = {"fused": True} if fused else {"foreach": False}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **kernel)


class DistributedOptimizer:
    """AdamW over ``sync.pieces`` (see module docstring).

    ``tp``: the ``RankGroup``; ``sequence_parallel``: sum replicated gradients over it.
    ``tied_peer``: global rank holding the other copy of the tied weight (None: no copy
    crosses stages); ``tied_names``: this rank's names of that weight; ``tied_counted``:
    whether this rank's copy enters the norm (the first stage's does). ``global_norm=False``
    (PipeDream: each stage steps on its own clock, so no reduction can span stages) keeps the
    norm local: no clipping and no fp16 then (the config refuses both). ``fused``: torch's
    fused AdamW kernel (``optimizer.fused``), else the loop over tensors. ``state_dtype``:
    the moments' dtype (``optimizer.state_dtype``; bf16: ``LowPrecisionAdamW``).
    """

    def __init__(self, sync, *, tp, sequence_parallel: bool, lr: float, betas: tuple,
                 weight_decay: float, loss_scaler: DynamicLossScaler | None = None,
                 tied_peer: int | None = None, tied_names: tuple[str, ...] = (),
                 tied_counted: bool = True, global_norm: bool = True, fused: bool = False,
                 state_dtype: torch.dtype = torch.float32):
        self.sync, self.tp, self.loss_scaler = sync, tp, loss_scaler
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.tied_peer = tied_peer
        self.norm_group = None if global_norm else _NO_REDUCTION
        self.pieces = sync.pieces
        params = sync.piece_params
        self.sharded = [getattr(p, "tp_dim", None) is not None for p in params]
        self.partial = tp.size > 1 and any(getattr(p, "tp_partial_grad", False) for p in params)
        self.tied = [n.split("[")[0] in tied_names for n in sync.piece_names]
        self.counted = [c and (s or tp.rank == 0) and (tied_counted or not t)
                        for c, s, t in zip(sync.counted, self.sharded, self.tied)]
        self.optimizer = build_adamw(self.pieces, [p.dim() >= 2 for p in params], lr=lr,
                                     betas=betas, weight_decay=weight_decay, fused=fused,
                                     state_dtype=state_dtype)

    @property
    def param_groups(self):
        """The AdamW's two groups over ``pieces`` (decay on matrices, 0 on vectors): the ``lr`` a
        scheduler sets and a checkpoint keeps."""
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self, max_norm: float) -> dict:
        """Sync, unscale, clip by the global norm, step, refresh the parameters. Returns
        ``{"grad_norm": float, "skipped": bool}``, the same on every rank."""
        grads = self.sync.piece_grads()
        if self.sequence_parallel:
            sync_replicated_grads(self.sync.piece_params, self.tp, grads)
        elif self.partial:
            sync_replicated_grads(self.sync.piece_params, self.tp, grads, only_partial=True)
        if self.tied_peer is not None:
            def add_peer(flat):
                other = torch.empty_like(flat)
                comm.exchange([(flat, self.tied_peer)], [(other, self.tied_peer)])
                flat.add_(other)  # a + b == b + a: both copies get the same bits
            self._sum(grads, self.tied, add_peer)
        out = fp32_step(self.optimizer, self.pieces, grads, self.norm_group, max_norm,
                        self.loss_scaler, self.counted)
        if not out["skipped"]:
            self.sync.after_step()
        return out

    @staticmethod
    def _sum(grads: list[torch.Tensor], which: list[bool], reduce) -> None:
        """Apply ``reduce`` (in place) to the flat concatenation of the selected gradients."""
        coalesced_([g for g, w in zip(grads, which) if w], reduce)

    def state_dict(self) -> dict:
        """The AdamW's ``state_dict``: moments of this rank's pieces and the groups' settings."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Load a ``state_dict`` of the same pieces (raises as ``torch.optim.Optimizer`` does)."""
        self.optimizer.load_state_dict(state)


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter 2019; torch's ``AdamW`` formulas, eps 1e-8) over fp32
    masters whose two moments are kept in ``state_dtype`` (bf16) between steps.

    Numerics: each step loads the moments to fp32, updates them and steps the master with
    these fp32 values, then stores them rounded to nearest: per step each stored moment
    carries a relative error of at most 2**-9 (bf16's 8-bit significand), so the next
    update m / (sqrt(v) + eps) moves by about 1.5 x 2**-9 relative, the master itself kept
    exactly in fp32. Half the moments' bytes (4 instead of 8 per element). The state keeps
    torch's names (``step``, ``exp_avg``, ``exp_avg_sq``); moments loaded in another dtype
    (a checkpoint's load casts them to the parameter's) are kept in ``state_dtype`` again."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2,
                 state_dtype: torch.dtype = torch.bfloat16):
        self.state_dtype = state_dtype
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every parameter with a gradient (``closure`` unsupported)."""
        assert closure is None, "LowPrecisionAdamW.step takes no closure"
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = (group["lr"], group["betas"], group["eps"],
                                     group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    for k in ("exp_avg", "exp_avg_sq"):
                        st[k] = torch.zeros_like(p, dtype=self.state_dtype)
                for k in ("exp_avg", "exp_avg_sq"):
                    if st[k].dtype != self.state_dtype:
                        st[k] = st[k].to(self.state_dtype)
                st["step"] += 1
                t = float(st["step"])
                g = p.grad.float()
                m = st["exp_avg"].float().lerp_(g, 1 - b1)
                v = st["exp_avg_sq"].float().mul_(b2).addcmul_(g, g, value=1 - b2)
                p.mul_(1 - lr * wd)
                denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(eps)
                p.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
                st["exp_avg"].copy_(m)
                st["exp_avg_sq"].copy_(v)
