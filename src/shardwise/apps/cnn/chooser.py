"""Choose each layer's strategy: dynamic programming over the layer chain.

The cost of a plan is the sum, over layers, of the predicted communication seconds of the
layer's collectives (``shardwise.apps.cnn.cost``) plus its compute seconds, plus the cost of
every layout change between consecutive layers. A layer's cost depends only on its own
strategy and its input and output layouts, and a change's cost only on the two layouts it
joins, so the minimum over the chain is found by dynamic programming over the state
"layout of the activation leaving layer i" (4 layouts): for each layer, each strategy and
each of its input/output layouts, the best cost so far is the cheapest predecessor state
plus the change into this layer's input layout plus this layer's cost (the Viterbi
recursion; O(layers x strategies x layouts^2), exact, no enumeration of the 8^L plans).
The input images cost nothing in any layout (every rank reads its batch itself); logits
must end in the batch or full layout (feature -> full is charged if needed). Convolutions
choose among dp, replicated, filters, channels and spatial (``shardwise.apps.cnn.cost``).

FlexFlow (Jia et al., MLSys 2019) and Alpa (Zheng et al., OSDI 2022) search the same
per-operator space with richer models; Krizhevsky 2014 (arXiv:1404.5997) hand-picks the
answer this finds for CNNs: data parallel convolutions, tensor parallel classifier.

CLI: ``shardwise plan --model cnn --batch 64 --ranks 4`` or ``shardwise plan --model cnn --config
configs/fashion_cnn.toml`` (``plan_main``).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.apps.cnn.cost import (
    FLOPS_PER_S,
    INPUTS,
    OUTPUTS,
    Collective,
    LayerPlan,
    allowed,
    change_collectives,
    check_strategy,
    compute_seconds,
    layer_collectives,
    layer_plan,
)
from shardwise.apps.cnn.layout import FEATURE, FULL
from shardwise.comm import cost as comm_cost
from shardwise.models.cnn import BlockSpec


@dataclass(frozen=True)
class Plan:
    """A strategy and layouts per layer, with the predicted cost it was chosen by."""

    layers: tuple[LayerPlan, ...]
    specs: tuple[BlockSpec, ...]
    batch: int
    ranks: int
    seconds: float

    @property
    def strategies(self) -> list[str]:
        """Each layer's strategy (``dp``, ``tp-fc``, ...), in order."""
        return [lp.strategy for lp in self.layers]

    def collectives(self) -> list[list[Collective]]:
        """Per layer: the change into its input layout, then its own collectives (the last
        layer also the change of the logits to full, if they leave in ``feature``)."""
        out, prev = [], None
        for i, (spec, lp) in enumerate(zip(self.specs, self.layers)):
            c = [] if prev is None else change_collectives(self.specs[i - 1].out_elems, prev,
                                                          lp.layout_in, self.batch)
            c += layer_collectives(spec, lp, self.batch, input_grad=i > 0)
            if i == len(self.layers) - 1 and lp.layout_out == FEATURE:
                c += change_collectives(spec.out_elems, FEATURE, FULL, self.batch)
            out.append(c)
            prev = lp.layout_out
        return out

    def bytes_per_layer(self) -> list[float]:
        """Bytes each rank sends per step, per layer (layout change into it included)."""
        return [sum(c.bytes_sent(self.ranks) for c in cs) for cs in self.collectives()]

    @property
    def bytes_per_step(self) -> float:
        """Bytes each rank sends per step, all layers and layout changes summed."""
        return sum(self.bytes_per_layer())

    @property
    def output_layout(self) -> str:
        """The layout the logits leave in (``feature`` is changed to full at the end)."""
        return FULL if self.layers[-1].layout_out == FEATURE else self.layers[-1].layout_out


def choose(specs: list[BlockSpec], batch: int, ranks: int, fixed: list[str] | None = None,
           restrict: dict[str, tuple[str, ...]] | None = None,
           profile: comm_cost.Profile | None = None, flops_per_s: float = FLOPS_PER_S) -> Plan:
    """The cheapest plan (see module docstring). ``fixed``: one strategy per layer (only
    the layouts are chosen; ValueError naming a layer that cannot take its strategy);
    ``restrict``: {"conv": (...), "fc": (...)} strategies allowed per layer kind.
    Raises ValueError if ``batch`` is not divisible by ``ranks``."""
    if batch % ranks:
        raise ValueError(f"training.global_batch_size={batch} is not divisible by "
                         f"cnn.ranks={ranks}")
    if fixed is not None and len(fixed) != len(specs):
        raise ValueError(f"cnn.plan: {len(fixed)} strategies for {len(specs)} layers "
                         f"({', '.join(s.name for s in specs)})")
    prm = (profile or comm_cost.active_profile()).params(ranks)

    def secs(cs: list[Collective]) -> float:
        return sum(c.seconds(ranks, prm) for c in cs)

    best: dict[str, tuple[float, list[LayerPlan]]] = {}  # layout out -> (cost, plan so far)
    for i, spec in enumerate(specs):
        if fixed is not None:
            check_strategy(spec, fixed[i], ranks)
            options = [fixed[i]]
        else:
            options = [s for s in allowed(spec, ranks)
                       if restrict is None or s in restrict.get(spec.kind, (s,))]
        nxt: dict[str, tuple[float, list[LayerPlan]]] = {}
        for s in options:
            for lin in INPUTS[s]:
                for lout in OUTPUTS[s]:
                    lp = layer_plan(spec, s, lin, lout, ranks)
                    own = secs(layer_collectives(spec, lp, batch, i > 0)) + compute_seconds(
                        spec, s, batch, ranks, flops_per_s)
                    if i == 0:
                        cands = [(0.0, [])]
                    else:
                        cands = [(c + secs(change_collectives(specs[i - 1].out_elems, prev, lin,
                                                              batch)), p)
                                 for prev, (c, p) in best.items()]
                    c, p = min(cands, key=lambda cp: cp[0])
                    if lout not in nxt or c + own < nxt[lout][0]:
                        nxt[lout] = (c + own, p + [lp])
        best = nxt
    for lout in list(best):
        if lout == FEATURE:
            c, p = best[lout]
            best[lout] = (c + secs(change_collectives(specs[-1].out_elems, FEATURE, FULL, batch)), p)
    cost, layers = min(best.values(), key=lambda cp: cp[0])
    return Plan(tuple(layers), tuple(specs), batch, ranks, cost)


def named_plans(specs: list[BlockSpec], batch: int, ranks: int, **kw) -> dict[str, Plan]:
    """The three plans the benchmark compares: pure DP, pure TP on the fully connected
    layers (convolutions DP), and the chosen hybrid."""
    return {"dp": choose(specs, batch, ranks, fixed=["dp"] * len(specs), **kw),
            "tp-fc": choose(specs, batch, ranks, restrict={"conv": ("dp",), "inception": ("dp",),
                                                           "fc": ("column", "row")}, **kw),
            "hybrid": choose(specs, batch, ranks, **kw)}


def resolve(plan: str | list[str], specs: list[BlockSpec], batch: int, ranks: int,
            **kw) -> Plan:
    """``cnn.plan`` as a ``Plan``: "auto" (chosen), "dp", "tp-fc", or one strategy per layer."""
    if isinstance(plan, str):
        if plan == "auto":
            return choose(specs, batch, ranks, **kw)
        if plan in ("dp", "tp-fc"):
            return named_plans(specs, batch, ranks, **kw)[plan]
        raise ValueError(f"cnn.plan={plan!r}: expected auto, dp, tp-fc or a list of one "
                         "strategy per layer")
    return choose(specs, batch, ranks, fixed=list(plan), **kw)


def format_plan(plan: Plan) -> str:
    """The plan as a table: per layer its parameters, strategy, layouts, collectives and
    the bytes each rank sends per step; then the totals."""
    n = plan.ranks
    rows = [("layer", "params", "strategy", "layout in -> out", "collectives (X bytes)",
             "X by formula", "sent/rank")]
    for spec, lp, cs in zip(plan.specs, plan.layers, plan.collectives()):
        what = ", ".join(f"{c.name}({c.nbytes:,}) {c.phase}" for c in cs) or "-"
        formula = ", ".join(f"{c.formula}" for c in cs) or "-"
        strategy = lp.strategy + ("" if not lp.placement else "[" + " | ".join(
            ",".join(spec.branches[j].kind for j in m) or "-" for m in lp.placement) + "]")
        rows.append((spec.name, f"{spec.params:,}", strategy,
                     f"{lp.layout_in} -> {lp.layout_out}", what, formula,
                     f"{sum(c.bytes_sent(n) for c in cs):,.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    lines.append("sent/rank: 2(N-1)/N X per all-reduce, (N-1)/N X per all-gather, "
                 "reduce-scatter or halo exchange (its mean over the ranks)")
    lines.append(f"total: {plan.bytes_per_step:,.0f} bytes sent per rank per step; "
                 f"predicted {plan.seconds * 1e3:.2f} ms per step (comm + compute)")
    return "\n".join(lines)
