"""The ``experts`` style of a model's plan: stacked experts split over ep and tp.

``parallelize_experts(layer, plan, ep, tp, name=...)`` takes each submodule of ``layer`` that
the plan styles ``experts`` (``models.moe.Experts``: ``gate_proj``, ``up_proj`` (E, C, F),
``down_proj`` (E, F, C), ``forward(x, counts)``) and, in place:

- keeps this ep rank's experts ``[r L, (r + 1) L)``, L = E / ep (``ep_dim = 0`` on each
  parameter: an expert parameter, reduced over the dp ranks that hold the same experts,
  ``ep_dp``), and this tp rank's slice of the width F (``tp_dim``: 2 for gate and up, 1 for
  down), as Megatron-Core's expert tensor parallelism: gate and up column-parallel, down
  row-parallel, per expert;
- wraps its forward in communication with two hooks, so the module keeps its name, its
  class and its own forward (run on the local slice):

  before: f over tp (identity forward, all-reduce of the gradient backward: each tp rank's
  gate/up give a partial input gradient), then ``dispatch`` over ep;
  after: ``combine`` over ep, then g over tp (all-reduce forward: each tp rank's down
  slice gives a partial sum), so the router and the gate weights, replicated on the tp
  ranks, see the whole expert output and get whole gradients.

Under sequence parallelism the experts lie inside their mixture's ``moe`` region
(``tensor_parallel.plan``): its input was all-gathered along the sequence and its output
is reduce-scattered, so neither f nor g runs here; each tp rank's result stays the partial
sum of its width slice (and its input gradient a partial one), summed by the region's
reduce-scatter (and, backward, by its all-gather's conjugate, a reduce-scatter).

On the meta device it stays on meta (the engine shards, then materialises). The router and
a shared expert are not touched here (the router is replicated; a shared expert is a dense
SwiGLU with its own column / row styles).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from shardwise.models.description import style_of
from shardwise.parallel.experts.dispatch import combine, dispatch
from shardwise.parallel.tensor_parallel.group import RankGroup
from shardwise.parallel.tensor_parallel.mappings import copy_to_region, reduce_from_region
from shardwise.parallel.tensor_parallel.plan import in_sequence_region

_TP_DIMS = {"gate_proj": 2, "up_proj": 2, "down_proj": 1}  # the width F in each


def parallelize_experts(layer: nn.Module, plan: Mapping[str, str], ep: RankGroup,
                        tp: RankGroup, *, name: str = "", algorithm: str = "native") -> nn.Module:
    """Split every ``experts``-styled submodule of ``layer`` (module ``name`` of the full
    model) over ``ep`` and ``tp`` (module docstring); ``algorithm``: the all-to-all's
    (``comm.ALL_TO_ALL_ALGORITHMS``). Returns ``layer``. Raises ValueError (one line) when
    ep does not divide the experts or tp their width, or, under sequence parallelism, for
    experts outside a ``moe`` module (their tokens would be this rank's slice of the
    sequence only)."""
    for sub, module in layer.named_modules():
        full = ".".join(x for x in (name, sub) if x)
        if style_of(plan, full) == "experts":
            region = in_sequence_region(plan, full, tp)
            if tp.sequence_parallel and tp.size > 1 and not region:
                raise ValueError(f"{full}: experts under sequence parallelism need their "
                                 "mixture of experts styled 'moe' in the tp plan")
            shard_experts(module, ep, tp, tag=full, algorithm=algorithm, partial=region)
    return layer


def shard_experts(m: nn.Module, ep: RankGroup, tp: RankGroup, tag: str = "experts",
                  algorithm: str = "native", partial: bool = False) -> None:
    """Keep this rank's slice of ``m``'s stacked weights and hook its communication in;
    ``partial``: inside a sequence-parallel region, no f and no g (module docstring)."""
    n_experts = m.gate_proj.shape[0]
    local = ep.shard(n_experts, "model.n_experts")
    tp.shard(m.gate_proj.shape[2], "model.moe_ffn_hidden (expert width)")
    for pname, dim in _TP_DIMS.items():
        old = getattr(m, pname)
        t = old.detach().narrow(0, ep.rank * local, local)
        if tp.size > 1:
            n = t.shape[dim] // tp.size
            t = t.narrow(dim, tp.rank * n, n)
        new = nn.Parameter(t.clone().contiguous(), requires_grad=old.requires_grad)
        new.__dict__.update(old.__dict__)  # active_fraction
        if tp.size > 1:
            new.tp_dim = dim
        if ep.size > 1:
            new.ep_dim = 0
        setattr(m, pname, new)
    m.n_experts_local = local
    plans: list = []

    def before(module, args):
        x, counts = args                                   # (M, C), (E,)
        if not partial:
            x = copy_to_region(x, tp, tag=f"{tag}.input")  # f
        if ep.size == 1:
            return x, counts
        x, counts, plan = dispatch(x, counts, ep, algorithm)
        plans.append(plan)
        return x, counts                                   # (R, C) by local expert, (L,)

    def after(module, args, y):
        if ep.size > 1:
            y = combine(y, plans.pop(), ep, algorithm)     # (M, C)
        return y if partial else reduce_from_region(y, tp, tag=f"{tag}.output")  # g

    m.register_forward_pre_hook(before)
    m.register_forward_hook(after)


def is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` is split over ep (an expert parameter under expert parallelism)."""
    return getattr(p, "ep_dim", None) is not None
