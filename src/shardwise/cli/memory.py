"""``shardwise memory``: predicted bytes per rank for each ZeRO stage and any layout.

    shardwise memory --params 1.5e9 --dp 64 --precision bf16     # ZeRO formulas, dp only
    shardwise memory --model llama3-8b --dp 64                     # a named size's P
    shardwise memory --config configs/tiny.toml --dp 2 --tp 2 --pp 2 --stages 0,1,2
    shardwise memory --config my_llama.toml --dp 2 --tp 2 --pp 2  # model.kind = "llama"
    shardwise memory --config configs/shakespeare.toml --dp 4 --measure --budget-mb 8
    shardwise memory --config configs/tiny.toml --dp 2 --cp 2 --stages 1    # ZeRO over dp x cp
    shardwise memory --config configs/tiny.toml --dp 2 --pp 2 --chunks-per-rank 2 --stages 3
    shardwise memory --params 7e9 --dp 64 --dp-replicate 8         # HSDP: ZeRO over 8 ranks
    shardwise memory --config configs/tiny.toml --dp 1 --recompute full  # + activations
    shardwise memory --config configs/tiny.toml --offload optimizer --state-dtype bf16
    shardwise memory --config configs/tiny.toml --dp 2 --offload optimizer+params  # ZeRO-3
    shardwise memory --config configs/tiny.toml --dp 1 --activation-offload  # device/host

With a model (``--config``: the model of its ``model.kind``, gpt, llama or a kind registered
with ``shardwise.register_model``, or of its ``model.init_from`` checkpoint's config.json, as
``shardwise train`` builds it; the header names the kind), every rank of the layout is predicted exactly (``engine.memory.predict_rank``: the
rank's model built on the meta device, packed as the dp sync packs it); with ``--measure`` each stage is also run for one optimizer step on the
local ranks and the bytes dp rank 0 of each (pp, tp) then holds are printed beside.
With ``--params`` only (or ``--model``, a named size of ``shardwise plan``, for its
parameter count), the formulas of Rajbhandari et al. for dp alone. Both paths are the
planner's memory model (``planner.memory``: ``predict_rank`` with a model, ``zero_bytes``
with a parameter count), so ``shardwise plan`` and this report print the same bytes. Units
are named in the header: binary, MiB (2**20 bytes) or GiB (2**30) from 1 GiB, as every size
in shardwise; except the ``--params`` table, which reproduces the ZeRO paper's (Rajbhandari
et al. 2020, figure 1) in its decimal units, MB (1e6) or GB (1e9), and says so.
``--budget-mb`` is MiB in both. Context parallelism (``--cp``) replicates the weights on its
ranks, so ZeRO's shards span dp x cp of them (with ``--params``: N = dp x cp); it splits
activations, which this report of static bytes does not count; how its attention talks
(``parallel.cp_comm``: ring, all-to-all or hybrid) changes none of these bytes, and the
header names it. HSDP (``--dp-replicate R``):
ZeRO 1-3 shard within one replica of dp / R ranks, so the state shrinks by dp / R, not dp.
``--recompute MODE`` (with ``--config``; ``parallel.recompute``'s modes) adds the peak
activation bytes of the busiest pipeline rank (``planner.memory.activation_bytes``, the
config's micro-batches and sequence length) without recomputation and with ``MODE``
(``--recompute-every N``: "full" on every N-th block), a prediction: the engine counts no
activation bytes of its own (``Engine.memory_bytes`` is the static ones).
``--activation-offload`` (``parallel.activation_offload``, with ``--recompute`` none or full)
prints that figure's device part and the host's (``planner.memory.offloaded_activation_bytes``).
"""

from __future__ import annotations

import math
import sys

from shardwise.base.config import RECOMPUTE_MODES
from shardwise.cli.common import EXIT_USAGE, Parser


def measure_worker(cfg_dict: dict) -> dict:
    """Rank function: one step, then this rank's coordinates and measured bytes."""
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.base.config import Config

    trainer = build_trainer(Config.from_dict(cfg_dict))
    trainer.train_step()
    return {"coords": trainer.topology.coords, **trainer.engine.memory_bytes()}


def _layout_table(args, stages: list[int]) -> int:
    """Per-rank prediction for a model and a dp x tp x pp layout (``engine.memory``), with
    ``--measure`` the bytes each rank holds after one step beside it."""
    from shardwise.base.config import Config
    from shardwise.engine.memory import predict_rank
    from shardwise.planner.memory import MiB, unit_for
    from shardwise.planner.specs import describe_config, full_size

    over = {"parallel.dp": args.dp, "parallel.tp": args.tp, "parallel.pp": args.pp,
            "parallel.cp": args.cp, "parallel.dp_replicate": args.dp_replicate,
            "training.progress": False, "checkpoint.at_end": False, "training.sample_chars": 0}
    if args.bucket_mb is not None:
        over["parallel.bucket_mb"] = args.bucket_mb
    if args.ep is not None:
        over["parallel.ep"] = args.ep
    if args.recompute is not None:
        over["parallel.recompute"] = args.recompute
        over["parallel.recompute_every"] = args.recompute_every
    if args.chunks_per_rank is not None:
        over["parallel.chunks_per_rank"] = args.chunks_per_rank
        if args.chunks_per_rank > 1:  # static bytes do not read m; interleaving needs m % pp = 0
            over["parallel.schedule"], over["parallel.micro_batches"] = "interleaved", args.pp
    from shardwise.apps.lm.hf import resolve_init_from

    try:  # the model train builds: model.kind's description (gpt, llama, a registered one)
        base = resolve_init_from(Config.load(args.config, over))  # model.init_from's model
        p, d = base.parallel, describe_config(base)
        if args.precision is None:  # what the run holds: fp8 matmuls keep bf16 weights
            args.precision = {"fp8": "bf16"}.get(base.training.precision,
                                                 base.training.precision)
        state = args.state_dtype or base.optimizer.state_dtype
        state_bytes = 8 if state == "fp32" else 4
        preds = {}
        for z in stages:
            for pr in range(p.pp):
                for tr in range(p.tp):
                    preds[(z, pr, tr)] = predict_rank(
                        d, dp=p.dp, pp=p.pp, tp=p.tp, cp=p.cp, pp_rank=pr, tp_rank=tr, zero=z,
                        precision=args.precision, bucket_mb=p.bucket_mb, ep=p.ep,
                        chunks_per_rank=p.chunks_per_rank, partition_by=p.partition,
                        dp_replicate=p.dp_replicate, state_bytes=state_bytes,
                        offload=args.offload != "none",
                        offload_params=args.offload == "optimizer+params", lora=base.lora)
    except (ValueError, NotImplementedError) as e:  # ConfigError, DataError: one line
        print(f"shardwise memory: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    unit, div = unit_for(max([x["total"] for x in preds.values()] or [0]))
    print(f"{d.kind} {full_size(d) / 1e6:.2f}M parameters, {d.n_layer} layers x {d.hidden_size}, "
          f"vocab {d.vocab_size}; dp={p.dp}{f' (ep={p.ep})' if p.ep > 1 else ''}"
          + (f" (HSDP {p.dp_replicate}x{p.dp // p.dp_replicate})" if p.dp_replicate > 1
             else "") + " x "
          f"pp={p.pp}" + (f" (v={p.chunks_per_rank})" if p.chunks_per_rank > 1 else "")
          + (f" x cp={p.cp}" if p.cp > 1 else "")
          + (f" ({p.cp_comm}, all-to-all over {p.cp_heads})" if p.cp > 1 and p.cp_heads > 1
             else "") + f" x tp={p.tp}, "
          f"{args.precision} compute (fp32 masters, {state} moments"
          + ("; the optimizer in host memory: device = total - optimizer"
             if args.offload == "optimizer" else "")
          + ("; the optimizer and ZeRO-3's parameter shards in host memory: device = total "
             "- optimizer - params" if args.offload == "optimizer+params" else "") + "); "
          f"bytes per rank in {unit} (1 {unit} = "
          f"2**{int(div).bit_length() - 1} bytes; dp rank 0: padding lands on the last dp rank)")
    # a rank's pp / tp coordinates, in columns only where the layout has that axis
    def where(pr, tr) -> str:
        return (f" {pr:>3}" if p.pp > 1 else "") + (f" {tr:>3}" if p.tp > 1 else "")

    print(f"{'zero':>4}{where('pp', 'tp')} {'params':>9} {'grads':>9} {'optimizer':>9} "
          f"{'total':>9}" + (f" {'device':>9}" if args.offload != "none" else "")
          + (f" {'measured':>9}" if args.measure else "")
          + (f"  fits {args.budget_mb:g} MiB?" if args.budget_mb else ""))
    for z in stages:
        measured = {}
        if args.measure:
            from shardwise.launch import spawn

            cfg = resolve_init_from(Config.load(args.config, {
                **over, "parallel.zero": z, "training.precision": args.precision,
                "optimizer.state_dtype": state, "training.offload": args.offload,
                "training.global_batch_size": max(2, p.micro_batches) * p.dp}))
            for r in spawn(measure_worker, cfg.world_size, (cfg.model_dump(),)):
                if r["coords"]["dp"] == 0 and r["coords"].get("cp", 0) == 0:
                    measured[(r["coords"]["pp"], r["coords"]["tp"])] = r["total"]
        for pr in range(p.pp):
            for tr in range(p.tp):
                pred = preds[(z, pr, tr)]
                line = (f"{z:>4}{where(pr, tr)} {pred['params'] / div:>9.3f} "
                        f"{pred['grads'] / div:>9.3f} {pred['optimizer'] / div:>9.3f} "
                        f"{pred['total'] / div:>9.3f}")
                if args.offload != "none":
                    line += f" {(pred['total'] - pred['host']) / div:>9.3f}"
                if measured:
                    line += f" {measured[(pr, tr)] / div:>9.3f}"
                if args.budget_mb:
                    line += f"  {'yes' if pred['total'] <= args.budget_mb * MiB else 'NO'}"
                print(line)
    if args.recompute is not None or args.activation_offload:
        _activation_lines(base, d, args)
    return 0


def _activation_lines(cfg, d, args) -> None:
    """The peak activation bytes per rank (busiest pipeline rank) without recomputation and
    with ``args.recompute``, from the planner's memory model; with ``--activation-offload``
    the device's and the host's part of the latter."""
    from shardwise.base.words import count
    from shardwise.planner.memory import activation_bytes, offloaded_activation_bytes, unit_for
    from shardwise.planner.specs import ModelSpec

    p = cfg.parallel
    spec = ModelSpec.from_description(d)
    mb = cfg.training.global_batch_size // p.dp // p.micro_batches
    kw = dict(mb=mb, tp=p.tp, pp=p.pp, micro_batches=p.micro_batches, v=p.chunks_per_rank,
              schedule=p.schedule, sp=p.sequence_parallel, precision=args.precision,
              partition=p.partition, cp=p.cp, a2a=max(p.cp_heads, 1))
    compiled = cfg.training.compile  # compiled blocks keep less (planner.memory)
    none = activation_bytes(spec, **kw, compiled=compiled)
    mode = args.recompute or "none"
    got = activation_bytes(spec, **kw, recompute=mode, recompute_every=args.recompute_every,
                           offload=args.activation_offload, compiled=compiled)
    unit, div = unit_for(none)
    every = f" every {args.recompute_every}" if args.recompute_every > 1 else ""
    m = count(p.micro_batches, "micro-batch", "micro-batches")
    if args.activation_offload:
        kw.pop("a2a")
        off = offloaded_activation_bytes(spec, **kw, recompute=mode,
                                         recompute_every=args.recompute_every)
        every += f" + activation offload (device; host {off / div:.3f})"
    print(f"activations per rank (peak, busiest pipeline rank; {count(mb, 'sequence')} x "
          f"{spec.block_size // p.cp} tokens a micro-batch, {m}; "
          f"predicted) in {unit}: recompute none {none / div:.3f}, "
          f"{mode}{every} {got / div:.3f} ({got / none:.2f} of none)")


def main(argv: list[str] | None = None) -> int:
    """``shardwise memory``: bytes per rank of parameters, gradients and optimizer states for each
    ZeRO stage, from a config (counted, or measured with ``--measure``) or from the ZeRO paper's
    formulas (``--params``, ``--model``). Returns the exit code (2 on bad input)."""
    ap = Parser(prog="shardwise memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="TOML config whose model is measured")
    ap.add_argument("--params", type=float, default=None, help="parameter count P (formulas only)")
    ap.add_argument("--model", default=None, help="named size (gpt2-124m ... llama3-405b): "
                    "its parameter count P (formulas only)")
    ap.add_argument("--dp", type=int, default=2, help="data-parallel ranks N")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (needs --config)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (needs --config)")
    ap.add_argument("--chunks-per-rank", type=int, default=None, help="model chunks per "
                    "pipeline rank, the interleaved schedule's v (needs --config; default: "
                    "the config's)")
    ap.add_argument("--ep", type=int, default=None, help="expert-parallel ranks, folded over "
                    "--dp (needs --config with model.n_experts; default: the config's)")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks: replicas of "
                    "the weights, ZeRO shards over dp x cp")
    ap.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas R among the "
                    "--dp ranks: ZeRO shards over dp / R (x cp) and averages across replicas")
    ap.add_argument("--bucket-mb", type=float, default=None, help="ZeRO bucket capacity, MiB")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                    help="compute dtype (default: the config's training.precision, fp8 "
                    "keeping bf16 weights; bf16 without --config)")
    ap.add_argument("--stages", default=None, help="comma-separated ZeRO stages (default "
                    "0,1,2,3; 3 with --offload optimizer+params)")
    ap.add_argument("--measure", action="store_true", help="run one step per stage and measure")
    ap.add_argument("--state-dtype", default=None, choices=("fp32", "bf16"),
                    help="AdamW moments' dtype (optimizer.state_dtype; default: the config's, "
                    "fp32 with --params)")
    ap.add_argument("--offload", default="none",
                    choices=("none", "optimizer", "optimizer+params"),
                    help="training.offload: \"optimizer\" keeps the masters and moments in "
                    "host memory, \"optimizer+params\" ZeRO-3's parameter shards too "
                    "(needs --config)")
    ap.add_argument("--recompute", default=None, choices=RECOMPUTE_MODES,
                    help="also print the activation bytes per rank without recomputation "
                    "and with this parallel.recompute mode (needs --config)")
    ap.add_argument("--activation-offload", action="store_true", help="also print the "
                    "activation bytes per rank with parallel.activation_offload, on the device "
                    "and on the host (with --recompute none or full; needs --config)")
    ap.add_argument("--recompute-every", type=int, default=1, help="with --recompute full: "
                    "every N-th block checkpointed (parallel.recompute_every)")
    ap.add_argument("--budget-mb", type=float, default=None, help="per-rank budget to check, MiB")
    args = ap.parse_args(argv)  # --help answered here, before the planner imports torch
    from shardwise.planner.memory import MiB, unit_for, zero_bytes
    from shardwise.planner.specs import NAMED

    if args.stages is None:
        args.stages = "3" if args.offload == "optimizer+params" else "0,1,2,3"
    try:
        stages = [int(s) for s in args.stages.split(",")]
        if any(s not in (0, 1, 2, 3) for s in stages):
            raise ValueError
    except ValueError:
        print(f"shardwise memory: error: --stages {args.stages!r}: expected stages 0-3, "
              "comma-separated", file=sys.stderr)
        return EXIT_USAGE
    if args.offload == "optimizer+params" and stages != [3]:
        print(f"shardwise memory: error: --offload optimizer+params with --stages "
              f"{args.stages}: ZeRO-3 only (--stages 3)", file=sys.stderr)
        return EXIT_USAGE
    for flag, value in (("--dp", args.dp), ("--cp", args.cp),
                        ("--dp-replicate", args.dp_replicate)):
        if value < 1:
            print(f"shardwise memory: error: {flag} {value}: expected a whole number >= 1",
                  file=sys.stderr)
            return EXIT_USAGE
    if args.dp % args.dp_replicate:
        print(f"shardwise memory: error: --dp-replicate {args.dp_replicate} does not divide "
              f"--dp {args.dp}", file=sys.stderr)
        return EXIT_USAGE
    for flag, value, least in (("--params", args.params, 1.0), ("--budget-mb", args.budget_mb, 0.0)):
        if value is not None and not (math.isfinite(value) and value >= least and value > 0):
            print(f"shardwise memory: error: {flag} {value:g}: expected a finite number "
                  f"{'>= 1' if least else '> 0'}", file=sys.stderr)
            return EXIT_USAGE
    name = None
    if args.model is not None:
        if args.params is not None:
            print("shardwise memory: error: --model and --params: give one", file=sys.stderr)
            return EXIT_USAGE
        if args.model not in NAMED:
            print(f"shardwise memory: error: --model {args.model!r}: not a named size "
                  f"({', '.join(NAMED)})", file=sys.stderr)
            return EXIT_USAGE
        name, args.params = args.model, float(NAMED[args.model].params)
    if args.params is not None and args.measure:
        print("shardwise memory: error: --measure needs a model (--config), not --params",
              file=sys.stderr)
        return EXIT_USAGE

    if args.tp < 1 or args.pp < 1:
        print("shardwise memory: error: --tp and --pp must be positive", file=sys.stderr)
        return EXIT_USAGE
    if args.activation_offload and args.recompute not in (None, "none", "full"):
        print(f"shardwise memory: error: --activation-offload with --recompute "
              f"{args.recompute}: priced with none or full only", file=sys.stderr)
        return EXIT_USAGE
    if args.params is None:  # a model: the exact per-rank prediction of any layout
        return _layout_table(args, stages)
    if (args.tp > 1 or args.pp > 1 or args.chunks_per_rank is not None or args.recompute
            or args.offload != "none" or args.activation_offload):
        print("shardwise memory: error: --tp/--pp/--chunks-per-rank need a model (--config), "
              "not --params (so do --recompute, --offload and --activation-offload)",
              file=sys.stderr)
        return EXIT_USAGE
    measured, P = {}, int(args.params)
    args.precision = args.precision or "bf16"  # the ZeRO paper's mixed precision
    shard = args.dp // args.dp_replicate  # HSDP: ZeRO within one replica
    state_bytes = 4 if args.state_dtype == "bf16" else 8
    preds = {s: zero_bytes(P, shard * args.cp, s, args.precision, state_bytes)
             for s in stages}
    unit, div = unit_for(max(d["total"] for d in preds.values()), decimal=True)
    ranks = f"dp {shard} x cp {args.cp} = {shard * args.cp}" if args.cp > 1 else shard
    if args.dp_replicate > 1:
        ranks = f"{ranks} (dp {args.dp} = {args.dp_replicate} HSDP replicas x {shard})"
    print(f"{name + ': ' if name else ''}P = {P:,} parameters, N = {ranks} ranks, "
          f"{args.precision} compute with fp32 "
          f"masters; bytes per rank in {unit} (1 {unit} = {div:.0e} bytes: decimal, as the "
          "ZeRO paper's table)")
    head = f"{'stage':>5} {'params':>10} {'grads':>10} {'optimizer':>10} {'total':>10}"
    if measured:
        head += f" {'measured':>10} {'(params/grads/optim)':>26}"
    if args.budget_mb:
        head += f"  fits {args.budget_mb:g} MiB?"
    print(head)
    for s in stages:
        pred = preds[s]
        line = (f"{s:>5} {pred['params'] / div:>10.2f} {pred['grads'] / div:>10.2f} "
                f"{pred['optimizer'] / div:>10.2f} {pred['total'] / div:>10.2f}")
        if measured:
            m = measured[s]
            line += (f" {m['total'] / div:>10.2f} {m['params'] / div:>8.2f}/{m['grads'] / div:.2f}/"
                     f"{m['optimizer'] / div:.2f}".ljust(27))
        if args.budget_mb:
            used = measured[s]["total"] if measured else pred["total"]
            line += f"  {'yes' if used <= args.budget_mb * MiB else 'NO'}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
