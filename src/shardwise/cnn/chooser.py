"""Choose each layer's strategy: dynamic programming over the layer chain.

The cost of a plan is the sum, over layers, of the predicted communication seconds of the
layer's collectives (``shardwise.cnn.cost``) plus its compute seconds, plus the cost of
every layout change between consecutive layers. A layer's cost depends only on its own
strategy and its input and output layouts, and a change's cost only on the two layouts it
joins, so the minimum over the chain is found by dynamic programming over the state
"layout of the activation leaving layer i" (3 layouts): for each layer, each strategy and
each of its input/output layouts, the best cost so far is the cheapest predecessor state
plus the change into this layer's input layout plus this layer's cost (the Viterbi
recursion; O(layers x strategies x layouts^2), exact, no enumeration of the 4^L plans).
The input images cost nothing in any layout (every rank reads its batch itself); logits
must end in the batch or full layout (feature -> full is charged if needed).

FlexFlow (Jia et al., MLSys 2019) and Alpa (Zheng et al., OSDI 2022) search the same
per-operator space with richer models; Krizhevsky 2014 (arXiv:1404.5997) hand-picks the
answer this finds for CNNs: data parallel convolutions, tensor parallel classifier.

CLI: ``shardwise plan --model cnn --batch 64 --ranks 4`` or ``shardwise plan --model cnn --config
configs/fashion_cnn.toml`` (``plan_main``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from shardwise.cnn.cost import (FLOPS_PER_S, INPUTS, OUTPUTS, Collective, LayerPlan, allowed,
                                change_collectives, check_strategy, compute_seconds,
                                layer_collectives)
from shardwise.cnn.layout import FEATURE, FULL
from shardwise.comm import cost as comm_cost
from shardwise.models.cnn import CNN, BlockSpec, CNNConfig


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
        return [lp.strategy for lp in self.layers]

    def collectives(self) -> list[list[Collective]]:
        """Per layer: the change into its input layout, then its own collectives (the last
        layer also the change of the logits to full, if they leave in ``feature``)."""
        out, prev = [], None
        for i, (spec, lp) in enumerate(zip(self.specs, self.layers)):
            c = [] if prev is None else change_collectives(self.specs[i - 1].out_elems, prev,
                                                          lp.layout_in, self.batch)
            c += layer_collectives(spec, lp, self.batch)
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
        return sum(self.bytes_per_layer())

    @property
    def output_layout(self) -> str:
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
                    lp = LayerPlan(s, lin, lout)
                    own = secs(layer_collectives(spec, lp, batch)) + compute_seconds(
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
            "tp-fc": choose(specs, batch, ranks, restrict={"conv": ("dp",),
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
             "sent/rank")]
    for spec, lp, cs in zip(plan.specs, plan.layers, plan.collectives()):
        what = ", ".join(f"{c.name}({c.nbytes:,}) {c.phase}" for c in cs) or "-"
        rows.append((spec.name, f"{spec.params:,}", lp.strategy,
                     f"{lp.layout_in} -> {lp.layout_out}", what,
                     f"{sum(c.bytes_sent(n) for c in cs):,.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    lines.append(f"total: {plan.bytes_per_step:,.0f} bytes sent per rank per step; "
                 f"predicted {plan.seconds * 1e3:.2f} ms per step (comm + compute)")
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        vals = ()
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 1, got {text!r}")
    return vals


def _defaults(a: argparse.Namespace) -> None:
    """Fill the options left out from ``--config`` (else the built-in defaults)."""
    d = {"batch": 64, "ranks": 2, "channels": CNNConfig.channels, "hidden": CNNConfig.hidden,
         "flops_per_s": FLOPS_PER_S, "plan": None}
    if a.config:
        from shardwise.config import Config

        cfg = Config.load(a.config)  # ConfigError is a ValueError: one line
        c = cfg.cnn
        d.update(batch=cfg.training.global_batch_size, ranks=c.ranks, channels=tuple(c.channels),
                 hidden=tuple(c.hidden), flops_per_s=c.flops_per_s,
                 plan=c.plan if isinstance(c.plan, str) else ",".join(c.plan))
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v)


def plan_main(args: list[str] | None = None) -> int:
    """``shardwise plan --model cnn``: print the chosen plan (and pure DP / pure TP beside it)."""
    from shardwise.cli import _Parser

    p = _Parser(prog="shardwise plan --model cnn", description="Per-layer data / tensor parallel "
                "plan of the CNN by dynamic programming over predicted comm + compute.")
    p.add_argument("--config", help="take the defaults below from this TOML's [cnn] section "
                   "and training.global_batch_size")
    p.add_argument("--batch", type=int, help="global batch size (default 64)")
    p.add_argument("--ranks", type=int, help="ranks in the group N (default 2)")
    p.add_argument("--channels", type=_ints, help="conv output channels, e.g. 32,64")
    p.add_argument("--hidden", type=_ints,
                   help="fully connected widths before the classifier, e.g. 512,256")
    p.add_argument("--plan", help="fix the strategies: dp, tp-fc, or e.g. dp,dp,column,row,"
                   "replicated (default: choose)")
    p.add_argument("--flops-per-s", type=float,
                   help=f"compute rate per rank (default {FLOPS_PER_S:g})")
    p.add_argument("--profile", help="comm cost profile JSON (default: the active profile)")
    a = p.parse_args(args)
    try:
        _defaults(a)
        if a.batch < 1 or a.ranks < 1:
            raise ValueError(f"--batch={a.batch} and --ranks={a.ranks} must be >= 1")
        specs = CNN(CNNConfig(channels=a.channels, hidden=a.hidden)).specs()
        prof = comm_cost.load_profile(a.profile) if a.profile else None
        kw = {"profile": prof, "flops_per_s": a.flops_per_s}
        chosen = None
        if a.plan and a.plan != "auto":
            chosen = resolve(a.plan if a.plan in ("dp", "tp-fc") else a.plan.split(","),
                             specs, a.batch, a.ranks, **kw)
    except ValueError as e:
        print(f"shardwise: error: {e}", file=sys.stderr)
        return 2
    plans = named_plans(specs, a.batch, a.ranks, **kw)
    chosen = chosen or plans["hybrid"]
    print(f"CNN {sum(s.params for s in specs):,} parameters, batch {a.batch}, {a.ranks} ranks")
    print(format_plan(chosen))
    print("compare: " + "; ".join(f"{k} {v.bytes_per_step:,.0f} B/rank, {v.seconds * 1e3:.2f} ms"
                                  for k, v in plans.items()))
    return 0
