"""``shardwise memory``: predicted bytes per rank for each ZeRO stage, measured beside them.

    shardwise memory --params 1.5e9 --dp 64 --precision bf16     # formulas only
    shardwise memory --config configs/shakespeare.toml --dp 4 --measure --budget-mb 8

With ``--measure`` each stage is run for one optimizer step on ``--dp`` local ranks with
the configured GPT, and the bytes each rank then holds (parameters, gradients, optimizer
states; ``zero.memory.measured_bytes``) are printed next to the formula, as the maximum
over ranks. Stage 0 is our DDP in fp32 (params, grads, Adam moments: 16P; it keeps no
separate master copy).
"""

from __future__ import annotations

import argparse
import math
import sys

from shardwise.zero.memory import predicted_bytes

MB = 1 << 20


def measure_worker(cfg_dict: dict) -> dict:
    """Rank function: one step, then this rank's measured bytes."""
    import torch.distributed as dist

    from shardwise.config import Config
    from shardwise.topology import Topology, init_process_groups
    from shardwise.trainer import Trainer
    from shardwise.zero.memory import measured_bytes

    cfg = Config.from_dict(cfg_dict)
    topo = init_process_groups(Topology.build(cfg.parallel.dp, rank=dist.get_rank(),
                                              world_size=dist.get_world_size()))
    trainer = Trainer(cfg, topo)
    trainer.train_step()
    wrapper = trainer.zero or _Plain()
    out = measured_bytes(trainer.model, wrapper, trainer.optimizer)
    out["padded_numel"] = getattr(wrapper, "padded_numel", trainer.model.num_parameters())
    return out


class _Plain:
    """Stage 0 seen through the wrapper interface of ``measured_bytes``."""

    pieces: list = []

    def param_shards(self):
        return []

    def grad_shards(self):
        return []


def main(argv: list[str] | None = None) -> int:
    from shardwise.cli import _Parser  # one-line errors, exit 2

    ap = _Parser(prog="shardwise memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="TOML config whose model is measured")
    ap.add_argument("--params", type=float, default=None, help="parameter count P (formulas only)")
    ap.add_argument("--dp", type=int, default=2, help="data-parallel ranks N")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16")
    ap.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages")
    ap.add_argument("--measure", action="store_true", help="run one step per stage and measure")
    ap.add_argument("--budget-mb", type=float, default=None, help="per-rank budget to check")
    args = ap.parse_args(argv)
    try:
        stages = [int(s) for s in args.stages.split(",")]
        if any(s not in (0, 1, 2, 3) for s in stages):
            raise ValueError
    except ValueError:
        print(f"shardwise memory: error: --stages {args.stages!r}: expected stages 0-3, "
              "comma-separated", file=sys.stderr)
        return 2
    if args.dp < 1:
        print(f"shardwise memory: error: --dp {args.dp}: expected a whole number >= 1",
              file=sys.stderr)
        return 2
    for flag, value, least in (("--params", args.params, 1.0), ("--budget-mb", args.budget_mb, 0.0)):
        if value is not None and not (math.isfinite(value) and value >= least and value > 0):
            print(f"shardwise memory: error: {flag} {value:g}: expected a finite number "
                  f"{'>= 1' if least else '> 0'}", file=sys.stderr)
            return 2
    if args.params is not None and args.measure:
        print("shardwise memory: error: --measure needs a model (--config), not --params",
              file=sys.stderr)
        return 2

    measured, P = {}, int(args.params) if args.params else None
    if P is None or args.measure:
        from shardwise.config import Config, ConfigError
        from shardwise.launch import spawn

        try:
            base = Config.load(args.config, {"parallel.dp": args.dp})
        except ConfigError as e:
            print(f"shardwise memory: error: {e}", file=sys.stderr)
            return 2
        if P is None:
            from shardwise.data import CharTokenizer, load_text
            from shardwise.models import GPT, GPTConfig

            m = base.model
            vocab = m.vocab_size or CharTokenizer.from_text(load_text(base.data.path)).vocab_size
            P = GPT(GPTConfig(vocab, m.block_size, m.n_layer, m.n_head, m.n_embd,
                              tie_weights=m.tie_weights)).num_parameters()
        if args.measure:
            for s in stages:
                prec = "fp32" if s == 0 else args.precision
                cfg = Config.load(args.config, {
                    "parallel.dp": args.dp, "parallel.zero": s, "training.precision": prec,
                    "training.progress": False, "training.global_batch_size": 2 * args.dp,
                    "checkpoint.at_end": False})
                rows = spawn(measure_worker, args.dp, (cfg.model_dump(),))
                measured[s] = {k: max(r[k] for r in rows) for k in rows[0]}

    b = 2 if args.precision in ("bf16", "fp16") else 4
    print(f"P = {P:,} parameters, N = {args.dp} ranks, {args.precision} compute "
          f"(stage 0: fp32 DDP); bytes per rank, MiB")
    head = f"{'stage':>5} {'params':>10} {'grads':>10} {'optimizer':>10} {'total':>10}"
    if measured:
        head += f" {'measured':>10} {'(params/grads/optim)':>26}"
    if args.budget_mb:
        head += f"  fits {args.budget_mb:g} MiB?"
    print(head)
    for s in stages:
        if s == 0:  # fp32 DDP: params 4P, grads 4P, Adam moments 8P
            pred = {"params": 4 * P, "grads": 4 * P, "optimizer": 8 * P, "total": 16 * P}
        else:
            Pp = measured[s]["padded_numel"] if s in measured else P
            pred = predicted_bytes(Pp, args.dp, s, b)
        line = (f"{s:>5} {pred['params'] / MB:>10.2f} {pred['grads'] / MB:>10.2f} "
                f"{pred['optimizer'] / MB:>10.2f} {pred['total'] / MB:>10.2f}")
        if measured:
            m = measured[s]
            line += (f" {m['total'] / MB:>10.2f} {m['params'] / MB:>8.2f}/{m['grads'] / MB:.2f}/"
                     f"{m['optimizer'] / MB:.2f}".ljust(27))
        if args.budget_mb:
            used = measured[s]["total"] if measured else pred["total"]
            line += f"  {'yes' if used <= args.budget_mb * MB else 'NO'}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
