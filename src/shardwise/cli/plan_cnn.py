"""``shardwise plan --model cnn``: the CNN's per-layer data / tensor parallel plan, chosen by
dynamic programming over predicted communication + compute (``shardwise.apps.cnn.chooser``)."""

from __future__ import annotations

import argparse
import sys

from shardwise.apps.cnn.chooser import format_plan, named_plans, resolve
from shardwise.apps.cnn.cost import FLOPS_PER_S
from shardwise.cli.common import EXIT_USAGE, Parser
from shardwise.comm import cost as comm_cost
from shardwise.models.cnn import CNN, CNNConfig, parse_branches


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
         "kernel": CNNConfig.kernel, "flops_per_s": FLOPS_PER_S, "plan": None, "inception": ""}
    if a.config:
        from shardwise.base.config import Config

        cfg = Config.load(a.config)  # ConfigError is a ValueError: one line
        c = cfg.cnn
        d.update(batch=cfg.training.global_batch_size, ranks=c.ranks, channels=tuple(c.channels),
                 hidden=tuple(c.hidden), kernel=c.kernel, flops_per_s=c.flops_per_s,
                 inception=",".join(c.inception),
                 plan=c.plan if isinstance(c.plan, str) else ",".join(c.plan))
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v)


def plan_main(args: list[str] | None = None) -> int:
    """``shardwise plan --model cnn``: print the chosen plan (and pure DP / pure TP beside it)."""
    p = Parser(prog="shardwise plan --model cnn", description="Per-layer data / tensor parallel "
                "plan of the CNN by dynamic programming over predicted comm + compute.")
    p.add_argument("--config", help="take the defaults below from this TOML's [cnn] section "
                   "and training.global_batch_size")
    p.add_argument("--batch", type=int, help="global batch size (default 64)")
    p.add_argument("--ranks", type=int, help="ranks in the group N (default 2)")
    p.add_argument("--channels", type=_ints, help="conv output channels, e.g. 32,64")
    p.add_argument("--kernel", type=int, help="convolution kernel size, odd (default 3)")
    p.add_argument("--hidden", type=_ints,
                   help="fully connected widths before the classifier, e.g. 512,256")
    p.add_argument("--inception", help="an Inception block's branches after the last "
                   "convolution, e.g. 1x1:16,3x3:32,5x5:8,pool:8 (default none)")
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
        branches = parse_branches([e for e in a.inception.split(",") if e.strip()])
        specs = CNN(CNNConfig(channels=a.channels, hidden=a.hidden, kernel=a.kernel,
                              inception=branches)).specs()
        prof = comm_cost.load_profile(a.profile) if a.profile else None
        kw = {"profile": prof, "flops_per_s": a.flops_per_s}
        chosen = None
        if a.plan and a.plan != "auto":
            chosen = resolve(a.plan if a.plan in ("dp", "tp-fc") else a.plan.split(","),
                             specs, a.batch, a.ranks, **kw)
    except ValueError as e:
        print(f"shardwise: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    plans = named_plans(specs, a.batch, a.ranks, **kw)
    chosen = chosen or plans["hybrid"]
    print(f"CNN {sum(s.params for s in specs):,} parameters, batch {a.batch}, {a.ranks} ranks")
    print(format_plan(chosen))
    print("compare: " + "; ".join(f"{k} {v.bytes_per_step:,.0f} B/rank, {v.seconds * 1e3:.2f} ms"
                                  for k, v in plans.items()))
    return 0
