"""Mixture of experts: a top-k router over E SwiGLU experts (the single-process reference).

A ``MoE`` block replaces a decoder block's MLP: each token is sent to the k experts its router
scores highest and its output is their outputs weighted by the gates (plus an optional
shared expert every token goes through, its output optionally scaled by a sigmoid gate of
the token). Routing (``route``: softmax or sigmoid gating, the expert bias, groups), the
per-sequence load-balancing loss (``load_balancing_loss``) and how it enters backward
(``AuxLossScaler``), grouped dispatch (``grouped_mm``) and the capacity factor are described
in docs/moe.md, "The block". Sources:

- Shazeer et al. 2017, "Outrageously Large Neural Networks" (arXiv:1701.06538): the sparsely
  gated layer;
- Lepikhin et al. 2020, "GShard" (arXiv:2006.16668), section 2.2: top-2 gating, expert
  capacity (first choices before second, then by token), the group load-balancing loss;
- Fedus et al. 2021, "Switch Transformers" (arXiv:2101.03961), eq. 4-6: the load-balancing
  loss ``alpha E sum_i f_i P_i``, the capacity factor;
- Jiang et al. 2024, "Mixtral of Experts" (arXiv:2401.04088): SwiGLU experts, the top-k
  gates renormalised to sum to one;
- DeepSeek-AI 2024, "DeepSeek-V3" (arXiv:2412.19437), eq. 12-20: sigmoid gating, the shared
  expert, the sequence-wise balance loss; sec. 2.1.2 (eq. 16): auxiliary-loss-free balancing;
  DeepSeek-V2/V3's group-limited routing;
- Qwen2-MoE (Yang et al. 2024, arXiv:2407.10671; transformers' ``qwen2_moe``): the shared
  expert's output times ``sigmoid(x w)``, w a (C,) weight;
- Megatron-Core MoE (``megatron/core/transformer/moe``): dropless routing with grouped GEMMs,
  ``MoEAuxLossAutoScaler``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.comm import replay
from shardwise.models import sequence

GATINGS = ("softmax", "sigmoid")
# how group-limited routing scores a group of experts: the sum of its top 2 (biased) gating
# scores (DeepSeek-V3) or its top 1, the max (DeepSeek-V2's "group_limited_greedy")
GROUP_SCORES = ("top2", "top1")
_GROUPED_MM = getattr(F, "grouped_mm", None)  # torch >= 2.9 (CPU: 2.10); else padded bmm


def _contiguous_grad(out: torch.Tensor) -> torch.Tensor:
    if out.requires_grad:  # grouped_mm's backward refuses an expanded gradient (``y.sum()``'s)
        out.register_hook(lambda g: g.contiguous())
    return out


@torch.compiler.disable
def _grouped_mm_eager(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _contiguous_grad(_GROUPED_MM(x, w, offs=offs))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` (M, K), sorted by group, each times its group's matrix of ``w`` (G, K,
    Nout): ``counts`` (G,) int64 rows per group (summing to M). Returns (M, Nout). One call
    for every group: torch's grouped GEMM (``F.grouped_mm``) where it runs (the CPU, bf16 on
    CUDA; rows of K and Nout a multiple of 16 bytes; under ``torch.compile`` other dtypes
    than bf16 run it eagerly, its traced form taking bf16 only), else one ``torch.bmm`` over
    the groups padded to the largest (which reads the counts on the host)."""
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[-1])
    aligned = all(d * x.element_size() % 16 == 0 for d in (x.shape[1], w.shape[-1]))
    if _GROUPED_MM is not None and aligned and (x.device.type == "cpu"
                                                 or x.dtype == torch.bfloat16):
        offs = counts.cumsum(0).to(torch.int32)
        if x.dtype != torch.bfloat16:  # what torch.compile traces (its meta kernel) is bf16
            return _grouped_mm_eager(x, w, offs)  # only: other dtypes run it eagerly
        return _contiguous_grad(_GROUPED_MM(x, w, offs=offs))
    g = w.shape[0]
    group = torch.repeat_interleave(torch.arange(g, device=x.device), counts)      # (M,)
    pos = torch.arange(x.shape[0], device=x.device) - (counts.cumsum(0) - counts)[group]
    padded = x.new_zeros(g, int(counts.max()), x.shape[1])
    padded[group, pos] = x                                                         # (G, cap, K)
    return torch.bmm(padded, w)[group, pos]                                        # (M, Nout)


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights: ``gate_proj`` and ``up_proj`` (E, C, F),
    ``down_proj`` (E, F, C); expert e computes ``(silu(x W_gate[e]) * x W_up[e]) W_down[e]``.

    ``forward(x, counts)``: tokens ``x`` (M, C) sorted by expert, ``counts`` (E,) int64 how
    many rows each expert takes; returns (M, C). Every parameter is marked
    ``active_fraction = top_k / n_experts`` (the share of it a token uses: the FLOP count).
    Expert parallelism keeps a slice of the experts (``parallel.experts``); the forward is
    the same on any slice."""

    def __init__(self, n_experts: int, dim: int, hidden: int, top_k: int = 1):
        super().__init__()
        self.n_experts, self.dim, self.hidden = n_experts, dim, hidden
        self.gate_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.up_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, dim))
        for p in self.parameters():
            p.active_fraction = top_k / n_experts

    def reset_parameters(self, std: float = 0.02) -> None:
        """Draw every expert's weights from N(0, ``std``)."""
        for p in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """SwiGLU of each expert on its rows: ``x`` ``(M, C)`` sorted by expert, ``counts`` ``(E,)``
        rows per expert -> ``(M, C)``."""
        h = F.silu(grouped_mm(x, self.gate_proj, counts)) * grouped_mm(x, self.up_proj, counts)
        return grouped_mm(h, self.down_proj, counts)                            # (M, C)


class AuxLossScaler(torch.autograd.Function):
    """Identity on ``x``; backward gives ``aux`` the gradient ``scale`` (Megatron-Core's
    ``MoEAuxLossAutoScaler``): the auxiliary loss enters the gradient wherever the block
    runs, as if ``scale * aux`` had been added to the loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        """Return ``x`` unchanged (a view), noting ``aux``'s shape for the backward."""
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """``grad`` to ``x``; the constant ``scale`` to ``aux`` (as if ``scale * aux`` were in the
        loss)."""
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def limit_to_groups(choice: torch.Tensor, n_group: int, topk_group: int,
                    group_score: str = "top2") -> torch.Tensor:
    """Group-limited routing (DeepSeek-V2 sec. 2.1.2's device-limited routing, V3 sec.
    2.1.2's node-limited routing, as transformers' ``DeepseekV3TopkRouter`` /
    ``DeepseekV2TopkRouter``): the E experts in ``n_group`` groups of E / G consecutive
    ones, each group scored per token by the sum of its top 2 choice scores (``"top2"``,
    V3) or its best one (``"top1"``, V2), and every expert outside the token's
    ``topk_group`` best groups masked to -inf. ``choice`` (N, E) fp32, the scores the top k
    is taken of (biased, when there is a bias); returns (N, E)."""
    n, e = choice.shape
    grouped = choice.view(n, n_group, e // n_group)                      # (N, G, E / G)
    top = 2 if group_score == "top2" else 1
    scores = grouped.topk(top, dim=-1).values.sum(dim=-1)                # (N, G)
    kept = scores.topk(topk_group, dim=-1).indices                       # (N, topk_group)
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, kept, True)
    return choice.masked_fill(~mask.repeat_interleave(e // n_group, dim=1), float("-inf"))


def route(logits: torch.Tensor, top_k: int, gating: str = "softmax", norm_topk: bool = True,
          bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
          group_score: str = "top2", scaling: float = 1.0):
    """Top-k routing of router logits (N, E). Returns ``(scores, weights, experts)``:
    ``scores`` (N, E) fp32 the normalised affinities the auxiliary loss averages (softmax
    probabilities; sigmoid scores divided by their sum), ``weights`` (N, k) fp32 the gates,
    ``experts`` (N, k) int64 the chosen experts, best first. ``bias`` (E,) fp32 or None:
    added to the gating scores (softmax probabilities, sigmoids) for the choice of the k
    experts only; the gates are the chosen experts' unbiased scores (DeepSeek-V3 eq. 16).
    ``n_group`` > 1: the k chosen among the experts of each token's ``topk_group`` best
    groups only (``limit_to_groups``, scored by ``group_score``). ``scaling``: the gates
    multiplied by it after any renormalisation (DeepSeek's ``routed_scaling_factor``; V3:
    2.5). ValueError for an unknown gating."""
    z = logits.float()
    if gating == "softmax":
        g = z.softmax(dim=-1)
        scores = g
    elif gating == "sigmoid":
        g = z.sigmoid()
        scores = g / g.sum(dim=-1, keepdim=True)
    else:
        raise ValueError(f"model.moe_gating={gating!r}: expected one of {', '.join(GATINGS)}")
    if bias is None and n_group == 1:
        weights, experts = g.topk(top_k, dim=-1)
    else:
        choice = g if bias is None else g + bias.float()
        if n_group > 1:
            choice = limit_to_groups(choice, n_group, topk_group, group_score)
        experts = choice.topk(top_k, dim=-1).indices
        weights = g.gather(-1, experts)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        weights = weights * scaling
    return scores, weights, experts


def check_groups(n_experts: int, top_k: int, n_group: int = 1, topk_group: int = 1,
                 group_score: str = "top2", scaling: float = 1.0) -> None:
    """One-line ``ValueError`` naming the [model] field for group-limited routing that
    cannot run (``MoE``'s docstring)."""
    if not scaling > 0:
        raise ValueError(f"model.moe_routed_scaling={scaling}: expected > 0")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"model.moe_group_score={group_score!r}: expected "
                         f"{' or '.join(GROUP_SCORES)}")
    if n_group == 1:
        return
    per = n_experts // n_group if n_group >= 1 else 0
    least = 2 if group_score == "top2" else 1
    if n_group < 1 or n_experts % n_group or per < least:
        raise ValueError(f"model.moe_n_group={n_group}: expected a divisor of "
                         f"model.n_experts={n_experts} leaving >= {least} experts per group")
    if not 1 <= topk_group <= n_group or top_k > topk_group * per:
        raise ValueError(f"model.moe_topk_group={topk_group}: expected 1 to "
                         f"model.moe_n_group={n_group} groups holding >= model.top_k={top_k} "
                         "experts")


def load_balancing_loss(scores: torch.Tensor, experts: torch.Tensor, n_seq: int) -> torch.Tensor:
    """``mean over sequences of E sum_i f_i P_i`` (module docstring; Switch eq. 4 with
    GShard's groups taken as sequences). ``scores`` (N, E), ``experts`` (N, k), the N tokens
    ``n_seq`` sequences in order (whole, or this context-parallel rank's tokens of each:
    then ``f`` counts the whole sequences', summed over their ranks, and ``P`` this rank's
    tokens, so the mean over the cp ranks is the whole sequences' loss). 0-d fp32; the
    gradient flows through P only."""
    n, e = scores.shape
    t = n // n_seq
    counts = F.one_hot(experts, e).sum(dim=1).view(n_seq, t, e).sum(dim=1)  # (S, E)
    counts = sequence.sequence_total(counts)             # whole sequences' (a sum over cp)
    f = counts.float() / counts.sum(dim=-1, keepdim=True)  # each sequence's T k assignments
    p = scores.view(n_seq, t, e).mean(dim=1)                                 # (S, E)
    return (e * (f * p).sum(dim=-1)).mean()


def keep_within_capacity(experts: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """(N, k) bool: the assignments an expert of ``capacity`` slots takes, first choices of
    every token before second choices, then by token (GShard's priority)."""
    by_slot = experts.t().reshape(-1)                                 # (k N,) slot-major
    onehot = F.one_hot(by_slot, n_experts)
    position = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1        # place in its expert
    return (position < capacity).view(experts.shape[1], -1).t()


class MoE(nn.Module):
    """A mixture-of-experts SwiGLU layer. (B, T, C) -> (B, T, C) (module docstring).

    ``router``: ``nn.Linear(C, E)`` without bias; ``experts``: ``Experts`` of width
    ``hidden``; ``shared_expert``: a module (B, T, C) -> (B, T, C) every token goes through,
    or None; ``shared_expert_gate``: with it, ``nn.Linear(C, 1)`` without bias named
    ``shared_expert_gate``, the shared expert's output scaled per token by
    ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE, ``Qwen2MoeSparseMoeBlock``; replicated
    over tp as the router). ``aux_loss_coef`` alpha, ``capacity_factor`` (0: dropless).
    ``n_group`` > 1, ``topk_group``, ``group_score``: group-limited routing (``route``,
    ``limit_to_groups``); ``routed_scaling``: the gates' factor (``route``'s ``scaling``).
    ``expert_bias``: the routing bias buffer below exists even at rate 0 (then it stays as
    loaded: a checkpoint's, DeepSeek-V3's ``e_score_correction_bias``).
    ``bias_update_rate`` gamma > 0: auxiliary-loss-free balancing (module docstring) with the
    buffer ``expert_bias`` (E,) fp32, zero at start, training state (``state_buffers``: the
    engine builds it as zeros and checkpoints it) moved by ``update_bias``; 0: no bias, no
    buffer. Raises ValueError for ``top_k`` outside [1, n_experts], an unknown gating or a
    negative rate, groups that do not split the experts evenly (at least 2 each for
    "top2"), ``topk_group`` outside [1, n_group], fewer experts in the kept groups than
    ``top_k``, or a scaling <= 0."""

    state_buffers = ("expert_bias",)  # buffers that are training state, zero at start

    def __init__(self, dim: int, n_experts: int, hidden: int, top_k: int = 2,
                 gating: str = "softmax", norm_topk: bool = True, aux_loss_coef: float = 0.01,
                 capacity_factor: float = 0.0, shared_expert: nn.Module | None = None,
                 bias_update_rate: float = 0.0, shared_expert_gate: bool = False,
                 n_group: int = 1, topk_group: int = 1, group_score: str = "top2",
                 routed_scaling: float = 1.0, expert_bias: bool = False):
        super().__init__()
        check_groups(n_experts, top_k, n_group, topk_group, group_score, routed_scaling)
        self.n_group, self.topk_group, self.group_score = n_group, topk_group, group_score
        self.routed_scaling = routed_scaling
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"model.top_k={top_k}: expected 1 <= top_k <= model.n_experts="
                             f"{n_experts}")
        if gating not in GATINGS:
            raise ValueError(f"model.moe_gating={gating!r}: expected one of {', '.join(GATINGS)}")
        if bias_update_rate < 0:
            raise ValueError(f"model.moe_bias_update_rate={bias_update_rate}: expected >= 0")
        self.bias_update_rate = bias_update_rate
        self.expert_bias: torch.Tensor | None
        if bias_update_rate > 0 or expert_bias:
            self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.n_experts, self.top_k, self.gating, self.norm_topk = n_experts, top_k, gating, norm_topk
        self.aux_loss_coef, self.capacity_factor = aux_loss_coef, capacity_factor
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(n_experts, dim, hidden, top_k)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (nn.Linear(dim, 1, bias=False)
                                   if shared_expert is not None and shared_expert_gate else None)
        self.aux_grad_scale = 1.0  # the engine's loss factor (module docstring)
        self._stats: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C)`` -> ``(B, T, C)``: route each token to its top-k experts (dropping those
        over capacity), weight and sum their outputs, add the shared expert; in training, attach the
        load-balancing loss and count each expert's load."""
        B, T, C = x.shape
        flat = x.reshape(-1, C)                                          # (N, C)
        scores, weights, chosen = route(self.router(flat), self.top_k, self.gating,  # (N, E),
                                        self.norm_topk, self.expert_bias,  # (N, k) x2
                                        self.n_group, self.topk_group, self.group_score,
                                        self.routed_scaling)
        n, k = chosen.shape
        keep = None
        if self.capacity_factor > 0:
            cap = math.ceil(self.capacity_factor * n * k / self.n_experts)
            keep = keep_within_capacity(chosen, self.n_experts, cap)     # (N, k)
        flat_e = chosen.reshape(-1)                                      # (N k,) token-major
        kept = (torch.arange(n * k, device=x.device) if keep is None
                else keep.reshape(-1).nonzero().squeeze(1))
        order = kept[torch.argsort(flat_e[kept], stable=True)]          # sorted by expert
        counts = torch.bincount(flat_e[kept], minlength=self.n_experts)  # (E,)
        ys = self.experts(flat[order // k], counts)                      # (M, C)
        placed = flat.new_zeros(n * k, C).index_copy(0, order, ys)       # dropped: zeros
        out = (placed.view(n, k, C) * weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)
        out = out.view(B, T, C)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)                                # (B, T, C)
            if self.shared_expert_gate is not None:                       # Qwen2-MoE
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared  # (B, T, 1) x
            out = out + shared
        if self.training and torch.is_grad_enabled():
            aux = self.aux_loss_coef * load_balancing_loss(scores, chosen, B)
            load = torch.bincount(flat_e, minlength=self.n_experts)
            dropped = (n * k - kept.numel()) * torch.ones((), dtype=torch.int64,
                                                          device=x.device)
            if not replay.recomputing():  # selective recomputation: counted in forward
                self._stats.append((aux.detach(), load, dropped))
            out = AuxLossScaler.apply(out, aux, self.aux_grad_scale)
        return out

    def pop_router_stats(self) -> dict[str, torch.Tensor] | None:
        """What the forwards since the last call routed, then forgotten: ``aux_loss`` (0-d
        fp32, the sum of each forward's coef-weighted auxiliary loss), ``load`` (E,) int64
        assignments per expert (before capacity), ``dropped`` (0-d int64) assignments over
        capacity, ``calls``; None when nothing ran."""
        if not self._stats:
            return None
        aux, load, dropped = (torch.stack(t).sum(dim=0) for t in zip(*self._stats))
        calls = len(self._stats)
        self._stats = []
        return {"aux_loss": aux, "load": load, "dropped": dropped, "calls": calls}

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing's step (DeepSeek-V3 sec. 2.1.2): ``expert_bias +=
        rate * sign(mean(load) - load)``, ``load`` (E,) the assignments routed to each
        expert over the step's whole (global) batch, any dtype, on any device. Nothing
        without a bias (rate 0). In place, no host synchronisation."""
        if self.expert_bias is None or not self.bias_update_rate:
            return
        load = load.to(self.expert_bias.device, torch.float64)
        self.expert_bias.add_(self.bias_update_rate * (load.mean() - load).sign().float())
