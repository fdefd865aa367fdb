"""``shardwise plan``: the feasible layouts of a model on a cluster, ranked by predicted
step time, with memory per GPU and the time split; the best one as a runnable TOML.

    shardwise plan --model configs/tiny.toml --cluster local --gpus 4 --global-batch 16
    shardwise plan --model gpt2-124m --cluster dgx-h100 --gpus 8 --global-batch 64 --pruned 10
    shardwise plan --model hf:path/to/checkpoint --seq 4096 --cluster dgx-h100 --gpus 16
    shardwise plan --model llama3-8b --cluster dgx-h100 --gpus 32 --dp-replicate 1,2,4 # HSDP

The model (a TOML read as ``shardwise train`` reads it, ``hf:DIR`` or a named size), the
search's axes, ``--fp8`` / ``--selective``, the table and ``--json``: docs/planner.md. Bad
input prints one line and exits 2. ``--model cnn`` is routed to the CNN's per-layer chooser
(``shardwise.cli.plan_cnn``).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from shardwise.base.config import SPLIT_BACKWARD_KINDS
from shardwise.base.files import write_text
from shardwise.cli.common import EXIT_USAGE, Parser, output_path


def build_parser():
    """The parser of ``shardwise plan`` (the CNN's chooser, ``--model cnn``, has its own)."""
    ap = Parser(prog="shardwise plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="named size (gpt2-124m ... megatron-1t, tinyllama-1.1b, llama2-7b ... "
                         "llama3-405b, mistral-7b, mixtral-8x7b, deepseek-v2-lite, "
                         "deepseek-v3, phi3-mini, phi4, gemma2-2b, gemma2-9b, gemma3-1b, "
                         "gemma3-12b, gemma3-27b), a TOML with "
                         "a [model] table (a shardwise train config), hf:DIR (a Hugging Face "
                         "checkpoint directory: its config.json), or cnn")
    ap.add_argument("--config", default=None, metavar="PATH",
                    help="a shardwise train config: plan the model it trains (any "
                         "model.kind); same as --model PATH")
    ap.add_argument("--cluster", default="local",
                    help="dgx-a100-40gb, dgx-a100-80gb, dgx-h100, dgx-h200 or local "
                         "(default)")
    ap.add_argument("--gpus", default="4", help="world size: GPUs (local: ranks; default 4)")
    ap.add_argument("--global-batch", default="16", help="sequences per optimizer step "
                    "(default 16)")
    ap.add_argument("--seq", default=None, help="sequence length (default: the model's)")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                    help="compute dtype (default: the cluster's: bf16 on GPUs, fp32 local)")
    ap.add_argument("--memory-gib", default=None,
                    help="memory per GPU a layout may fill, GiB (default: the preset's less 2 "
                         "GiB left free for the CUDA context, NCCL's buffers and "
                         "fragmentation; local: the RAM shared by the ranks)")
    ap.add_argument("--top", default="10", help="layouts to print (default 10)")
    ap.add_argument("--pruned", default="0", metavar="N", help="also print N pruned layouts "
                    "with the reason")
    ap.add_argument("--tp-across-nodes", action="store_true", help="let tp span nodes")
    ap.add_argument("--emit-toml", metavar="PATH", help="write the best layout as a config "
                    "`shardwise train --config PATH` runs")
    ap.add_argument("--timeline", metavar="PNG", help="draw the best layout's predicted "
                    "pipeline timeline")
    ap.add_argument("--compute", choices=("per-op", "fixed"), default="per-op",
                    help="GPU presets' compute model: per operation (GEMMs by size, "
                         "memory-bound kernels by bytes; default) or one fixed matmul "
                         "efficiency (the older model)")
    ap.add_argument("--kernels-profile", default=None, metavar="PATH",
                    help="price a GPU preset's GEMMs and memory-bound kernels from this kernel "
                         "profile (shardwise bench calibrate --device cuda on the preset's "
                         "GPU) instead of Calculon's tables; the datasheet stays the ceiling")
    ap.add_argument("--cp", default=None, metavar="N[,N]",
                    help="context-parallel sizes to search (default: every one where 2 cp "
                         "divides the sequence)")
    ap.add_argument("--cp-comm", default="ring,all_to_all,hybrid", metavar="MODE[,MODE]",
                    help="how cp > 1 attention may reach the other ranks' tokens "
                         "(parallel.cp_comm): ring, all_to_all, hybrid; default: all three, "
                         "the fastest predicted chosen")
    ap.add_argument("--ep", default=None, metavar="N[,N]",
                    help="expert-parallel sizes to search, a mixture of experts only "
                         "(default: every divisor of dp that divides the experts)")
    ap.add_argument("--dp-replicate", default="1", metavar="R[,R]",
                    help="HSDP replica counts to search with ZeRO 1-3 (each that divides "
                         "dp; ZeRO shards within a replica, gradients averaged across "
                         "replicas on the inter-node links); default 1: none")
    ap.add_argument("--fp8", action="store_true", help="also price FP8 linear layers (a "
                    "cluster with FP8 tensor cores: dgx-h100, dgx-h200); priced, not emitted: "
                    "shardwise train runs fp8 with tp = 1 only")
    ap.add_argument("--zero-bubble", action="store_true", help="also search the zero-bubble "
                    "pipeline schedules zb1p, zbv and dualpipev (backward split into input and "
                    "weight gradients), emitted by --emit-toml")
    ap.add_argument("--selective", action="store_true", help="also search selective "
                    "recomputation (parallel.recompute = \"selective\": matmul and attention "
                    "outputs kept, the rest recomputed; layout name rc=sel), emitted by "
                    "--emit-toml; not for a mixture of experts; shardwise train refuses it on "
                    "CUDA until checked there")
    ap.add_argument("--recompute-full", action="store_true", help="also search full "
                    "recomputation per block (parallel.recompute = \"full\": each block keeps "
                    "its input; layout name rc=blk), emitted by --emit-toml")
    ap.add_argument("--json", action="store_true", help="print one JSON document (layouts, "
                    "memory in bytes, times in seconds, pruned counts by reason) instead of "
                    "the tables")
    return ap


def plan_main(argv: list[str] | None = None) -> int:
    """``shardwise plan``: rank the feasible layouts of a model on a cluster by predicted step time
    and print them (or ``--json``, ``--emit-toml``). Returns the exit code (2, in one line, on a bad
    model or option)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = _cnn_argv(argv)
    if rest is not None:  # the CNN's per-layer chooser takes every other option itself
        return _cnn(rest)
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except ValueError as exc:  # planner.specs.SpecError among them
        print(f"shardwise plan: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _cnn_argv(argv: list[str]) -> list[str] | None:
    """``argv`` without ``--model cnn`` (or ``--model=cnn``) when it names the CNN, else None."""
    for i, tok in enumerate(argv):
        if tok == "--model=cnn":
            return argv[:i] + argv[i + 1:]
        if tok == "--model" and i + 1 < len(argv) and argv[i + 1] == "cnn":
            return argv[:i] + argv[i + 2:]
    return None


def _cnn(argv: list[str]) -> int:
    """The single dispatch point for ``--model cnn`` (the CNN's per-layer chooser)."""
    from shardwise.cli.plan_cnn import plan_main as cnn_plan_main

    return cnn_plan_main(argv)


def _run(args) -> int:
    from shardwise.planner.hardware import get_cluster
    from shardwise.planner.memory import GiB
    from shardwise.planner.search import plan, smallest_need
    from shardwise.planner.specs import SpecError, load_model, positive_number

    world = positive_number(args.gpus, "--gpus", integer=True)
    batch = positive_number(args.global_batch, "--global-batch", integer=True)
    top = positive_number(args.top, "--top", integer=True)
    n_pruned = int(positive_number(args.pruned, "--pruned", integer=True)) if args.pruned != "0" else 0
    if (args.model is None) == (args.config is None):
        raise SpecError("give one of --model NAME|PATH and --config PATH")
    source = args.model if args.model is not None else args.config
    if args.config is not None and not Path(args.config).is_file():
        raise SpecError(f"--config {args.config!r}: no such file")
    seq = positive_number(args.seq, "--seq", integer=True) if args.seq is not None else None
    for flag, where in (("--emit-toml", args.emit_toml), ("--timeline", args.timeline)):
        if where:  # before the search and the probe: a bad path costs nothing
            try:
                output_path(flag, where)
            except ValueError as exc:
                raise SpecError(str(exc)) from None
    spec = load_model(source, seq)
    profile = None
    if args.kernels_profile is not None:  # read (and refused on local) before calibrating
        from shardwise.planner import kernels

        profile = kernels.load(args.kernels_profile)
        if args.cluster == "local":
            raise SpecError("--kernels-profile: prices a GPU preset; local is measured")
    cluster = get_cluster(args.cluster, spec, world, args.compute)
    if profile is not None:
        cluster = kernels.apply(cluster, profile, args.kernels_profile)
    precision = args.precision or cluster.precision
    limit = (positive_number(args.memory_gib, "--memory-gib") * GiB if args.memory_gib
             else cluster.memory_per_rank(world))
    cps = _sizes(args.cp, "--cp") if args.cp is not None else None
    eps = _sizes(args.ep, "--ep") if args.ep is not None else None
    from shardwise.base.config import CP_COMMS  # here: pydantic is slow to import

    comms = [x.strip() for x in args.cp_comm.split(",") if x.strip()]
    bad = [x for x in comms if x not in CP_COMMS]
    if bad or not comms:
        raise SpecError(f"--cp-comm {args.cp_comm}: expected some of {', '.join(CP_COMMS)}")
    if eps is not None and not spec.moe and eps != [1]:
        raise SpecError(f"--ep {args.ep}: {spec.name} has no experts (expert parallelism "
                        "needs a mixture of experts, e.g. mixtral-8x7b)")
    for c in cps or ():
        if world % c:
            raise SpecError(f"--cp {c}: does not divide the {world} GPUs")
        if c > 1 and spec.dropout > 0:
            raise SpecError(f"--cp {c}: {spec.name} has model.dropout = {spec.dropout:g} and "
                            "ring attention has no attention dropout (the engine refuses cp "
                            "> 1 with dropout); set model.dropout = 0")
    for e in eps or ():
        if e > 1 and (world % e or spec.n_experts % e):
            raise SpecError(f"--ep {e}: must divide the {world} GPUs and the "
                            f"{spec.n_experts} experts")
    if args.fp8 and cluster.fp8_flops is None:
        raise SpecError(f"--fp8 on {cluster.name}: the {cluster.gpu} has no FP8 tensor cores "
                        "(dgx-h100 and dgx-h200 have)")
    feasible, pruned = plan(spec, cluster, world, batch, precision=precision,
                            memory_limit=limit, tp_across_nodes=args.tp_across_nodes,
                            top=top, progress=True, cp=cps, ep=eps, cp_comm=tuple(comms),
                            fp8=(False, True) if args.fp8 else (False,),
                            dp_replicate=_sizes(args.dp_replicate, "--dp-replicate"),
                            selective=(False, True) if args.selective else (False,),
                            schedules=("1f1b", "interleaved") + (
                                SPLIT_BACKWARD_KINDS if args.zero_bubble else ()),
                            recompute=(False, True, "full") if args.recompute_full
                            else (False, True))
    if not feasible:
        need = smallest_need(pruned)
        if need is not None:
            raise SpecError(f"{spec.name} ({spec.params / 1e9:.3g}B parameters) fits no layout "
                            f"of {world} GPUs with {limit / GiB:.3g} GiB each: the smallest "
                            f"needs {need / GiB:.3g} GiB per GPU")
        first = pruned[0].reason if pruned else "no layout"
        raise SpecError(f"no feasible layout of {spec.name} on {world} GPUs: {first}")
    best = feasible[0]
    groups = _pruned_groups(pruned)
    extra: dict = {}
    if args.emit_toml:
        try:
            extra["emitted_toml"] = str(emit_toml(args.emit_toml, source, spec, best.layout,
                                                  batch, precision, compiled=cluster.compiled))
        except OSError as exc:  # a full disk: the file as it was (base.files.replacing)
            raise SpecError(f"--emit-toml {args.emit_toml}: {exc.strerror}") from None
    if args.timeline:
        from shardwise.parallel.pipeline.timeline import render
        from shardwise.planner.simulate import simulate

        ev = simulate(spec, best.layout, cluster, precision, with_events=True)["events"]
        render(ev, args.timeline, f"predicted {best.layout.label()} on {cluster.name}")
        extra["timeline"] = args.timeline
    if args.json:
        import json

        print(json.dumps(_as_json(spec, cluster, world, batch, precision, feasible[:top],
                                  limit, groups, len(feasible), extra), indent=1))
        return 0
    _print(spec, cluster, world, batch, precision, feasible[:top], limit)
    if n_pruned:
        total = sum(n for n, _ in groups)
        print(f"\npruned: {total} layouts; by reason (count, an example):")
        shown = groups[:n_pruned]
        names = [_name(ps[0].layout) for _, ps in shown]
        width = max(len(x) for x in names)
        for (n, ps), name in zip(shown, names):
            print(f"  {n:>6}  {name:<{width}}  {ps[0].reason}")
    if "emitted_toml" in extra:
        path = extra["emitted_toml"]
        print(f"\nbest layout written to {path}: shardwise train --config {path}")
        if best.layout.recompute == "selective" and not cluster.cores:
            print(f"note: {path} has {SELECTIVE_CUDA}", file=sys.stderr)
    if "timeline" in extra:
        print(f"predicted timeline: {args.timeline}")
    return 0


def _sizes(text: str, flag: str) -> list[int]:
    """``"1,2,4"`` as whole numbers > 0, each once, ascending (one-line error otherwise)."""
    from shardwise.planner.specs import positive_number

    return sorted({int(positive_number(x.strip(), flag, integer=True)) for x in text.split(",")})


def _name(lay) -> str:
    return lay.label() if lay.micro_batches else f"dp{lay.dp} tp{lay.tp} pp{lay.pp}"


def _pruned_groups(pruned) -> list[tuple[int, list]]:
    """(layouts, records) per kind of reason (its numbers stripped), most layouts first."""
    import re

    number = re.compile(r"[0-9][0-9.]*(e[+-]?[0-9]+)?")
    groups: dict[str, list] = {}
    kinds: dict[str, str] = {}  # reason -> its kind: a search repeats few reasons many times
    for p in pruned:
        kind = kinds.get(p.reason)
        if kind is None:
            kind = kinds[p.reason] = number.sub("#", p.reason)
        groups.setdefault(kind, []).append(p)
    out = [(sum(p.count for p in ps), ps) for ps in groups.values()]
    return sorted(out, key=lambda g: g[0], reverse=True)


SPLIT = ("compute", "tp", "cp", "ep", "pp", "bubble", "dp", "optimizer")


def _as_json(spec, cluster, world, batch, precision, rows, limit, groups, n_simulated,
             extra) -> dict:
    from dataclasses import asdict

    tokens = batch * spec.block_size
    layouts = []
    for i, c in enumerate(rows, 1):
        t = c.time
        layouts.append({"rank": i, "label": c.layout.label(), "layout": asdict(c.layout),
                        "memory_bytes": {k: float(v) for k, v in c.memory.items()},
                        "step_s": t["step"], "tokens_per_s": tokens / t["step"],
                        "split_s": {k: t[k] for k in SPLIT}})
    return {"model": {"name": spec.name, "kind": spec.family, "params": spec.params,
                      "n_layer": spec.n_layer, "n_embd": spec.n_embd,
                      "sequence": spec.block_size, "n_experts": spec.n_experts,
                      **({"top_k": spec.top_k} if spec.moe else {})},
            "cluster": {"name": cluster.name, "gpu": cluster.gpu,
                        "memory_limit_bytes": float(limit),
                        "memory_bytes": float(cluster.memory),
                        "reserved_bytes": float(cluster.reserved),
                        "compute": cluster.ops.name if cluster.ops else
                        ("measured" if cluster.cores else f"fixed {cluster.efficiency:g}"),
                        "kernels": cluster.kernels},
            "gpus": world, "global_batch": batch, "precision": precision,
            "layouts": layouts, "simulated": n_simulated,
            "pruned": [{"count": n, "reason": ps[0].reason, "example": _name(ps[0].layout)}
                       for n, ps in groups],
            **extra}


def parameter_count(n: float) -> str:
    """A parameter count as a reader says it: ``8.03B``, ``124.4M``, ``29.1K``."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.4g}{unit}"
    return f"{n:.0f}"


def _limit_words(cluster, world, limit) -> str:
    """How much memory each layout may fill, and why: the preset's less its reserve."""
    from shardwise.planner.memory import GiB

    if cluster.reserved and limit == cluster.memory_per_rank(world):
        return (f"{limit / GiB:.3g} of {cluster.memory / GiB:.3g} GiB each: "
                f"{cluster.reserved / GiB:.3g} left free")
    return f"{limit / GiB:.3g} GiB each"


def _print(spec, cluster, world, batch, precision, rows, limit) -> None:
    from shardwise.planner.memory import unit_for

    unit, div = unit_for(max(r.memory["total"] for r in rows))
    tokens = batch * spec.block_size
    labels = [c.layout.label() for c in rows]
    w = max(len("layout"), *(len(x) for x in labels))
    # the split's columns: cp's and ep's only when a row has that axis
    cols = [k for k in SPLIT if k not in ("cp", "ep")
            or any(getattr(c.layout, k) > 1 for c in rows)]
    short = {"compute": "comp", "bubble": "bub", "optimizer": "opt"}
    moe = (f", {spec.n_experts} experts (top-{spec.top_k})" if spec.moe else "")
    print(f"{spec.name}: {parameter_count(spec.params)} parameters{moe}, {spec.n_layer} layers x "
          f"{spec.n_embd}, sequence {spec.block_size}, model.kind {spec.family}; "
          f"{world} x {cluster.gpu} ({cluster.name}, {_limit_words(cluster, world, limit)}), "
          f"global batch {batch}, {precision}")
    shared = (f" ({world} ranks run {cluster.contention:.2f}x slower than alone on its "
              f"{cluster.cores} cores; a cp ring message {cluster.ring_message_s * 1e3:.2f} ms)"
              if cluster.contention > 1 else "")
    model = (f"per operation ({cluster.ops.name}, {cluster.kernels} kernels)" if cluster.ops
             else f"measured on this machine{shared}" if cluster.cores
             else f"fixed: matmuls at {cluster.efficiency:g} of peak")
    print(f"compute model: {model}")
    fp8 = " (fp8: linear layers in FP8)" if any(c.layout.fp8 for c in rows) else ""
    print(f"memory per GPU in {unit} (1 {unit} = 2**{int(div).bit_length() - 1} bytes); time "
          f"per step in ms, split in % ({', '.join(cols)}){fp8}")
    print(f"{'#':>3}  {'layout':<{w}}  {'static':>8} {'activ.':>8} {'total':>8} {'step ms':>10} "
          f"{'tokens/s':>10}  {'comp':>4} " + " ".join(f"{short.get(k, k):>3}" for k in cols[1:]))
    for i, (c, label) in enumerate(zip(rows, labels), 1):
        t, m = c.time, c.memory
        static = m["params"] + m["grads"] + m["optimizer"]
        pct = [max(0.0, 100 * t[k] / t["step"]) for k in cols]  # no "-0" from rounding
        print(f"{i:>3}  {label:<{w}}  {static / div:>8.3f} {m['activations'] / div:>8.3f} "
              f"{m['total'] / div:>8.3f} {t['step'] * 1e3:>10.1f} {tokens / t['step']:>10.0f}  "
              + f"{pct[0]:>4.0f} " + " ".join(f"{p:>3.0f}" for p in pct[1:]))


def parallel_table(lay) -> dict:
    """The ``[parallel]`` fields of a config that trains layout ``lay`` (a
    ``planner.layout.Layout``) as the planner priced it."""
    parallel = {"mode": "grid", "dp": lay.dp, "tp": lay.tp, "pp": lay.pp,
                "micro_batches": lay.micro_batches, "schedule": lay.schedule,
                "chunks_per_rank": lay.chunks_per_rank, "zero": lay.zero,
                "recompute": {False: "none", True: "stage"}.get(lay.recompute, lay.recompute),
                "sequence_parallel": lay.sp, "partition": lay.partition,
                "cp": lay.cp, "ep": lay.ep}
    if lay.cp_a2a > 1:  # the all-to-all (DeepSpeed-Ulysses) or the hybrid
        parallel["cp_comm"] = lay.cp_comm
        if lay.cp_comm == "hybrid":
            parallel["cp_a2a"] = lay.cp_a2a
    if lay.dp_replicate > 1:  # HSDP
        parallel.update({"dp_replicate": lay.dp_replicate,
                         "dp_shard": lay.dp // lay.dp_replicate})
    return parallel


def emit_toml(path: str, model_arg: str, spec, lay, batch: int, precision: str,
              compiled: bool = False) -> Path:
    """Write ``lay`` as a train config. A TOML model keeps its sections, its model table as
    written (any ``model.kind``; ``block_size`` the planned sequence); ``hf:DIR`` gets
    ``model.init_from`` and the planned ``block_size``; a named model gets
    its sizes written out (``ModelSpec.model_table``: a Llama as ``model.kind = "llama"``
    with its key/value heads, SwiGLU width and rotary base, and its experts). A layout the
    engine does not run as priced (fp8 here, priced with tp; Korthikanti et al.'s
    attention-core recomputation, ``Layout.selective``, which the search never offers) is
    refused in one line; the engine's selective recomputation is written with a comment
    that train refuses it on CUDA today. The config gets a run of its own: ``training.out_dir``
    ``runs/<PATH's stem>`` (beside the model TOML's own ``out_dir``, if it sets one), and the
    checkpoints under it (a ``checkpoint.dir`` is not copied). ``compiled``: the cluster priced
    compiled blocks (``Cluster.compiled``, the GPU presets), so ``training.compile = true`` is
    written, as priced (time and memory). Returns the path."""
    from shardwise.planner.specs import SpecError

    if lay.fp8 or lay.selective:
        what = ("FP8 (shardwise train runs it with tp = 1 only)" if lay.fp8 else
                "attention-core recomputation (shardwise train's selective is torch's "
                "op-level one)")
        raise SpecError(f"--emit-toml: the best layout ({lay.label()}) uses {what}; drop "
                        "--fp8 to emit one")
    data: dict = {}
    src = Path(model_arg)
    if src.is_file():
        data = tomllib.loads(src.read_text())
        if "model" not in data:  # a bare [model] table
            data = {"model": data}
        model = {**data["model"], "block_size": spec.block_size}
    elif model_arg.startswith("hf:"):  # train reads the rest from config.json again
        model = {"init_from": model_arg, "block_size": spec.block_size}
    else:
        model = spec.model_table()
    parallel = {k: v for k, v in data.get("parallel", {}).items()
                if k in ("bucket_mb", "first_bucket_mb", "allreduce", "timeout_s")}
    parallel.update(parallel_table(lay))
    training = dict(data.get("training", {}))
    runs = Path(training["out_dir"]).parent if "out_dir" in training else Path("runs")
    training.update({"global_batch_size": batch, "precision": precision,
                     "out_dir": str(runs / Path(path).stem)})  # not the model's run
    # priced as compiled blocks keep and spend (run eager, it keeps more); train refuses
    # compile with tp's dropout (base.config), so that one case is written eager
    if compiled and not (lay.tp > 1 and spec.dropout > 0):
        training["compile"] = True
    out = {**data, "model": model, "parallel": parallel, "training": training}
    if "checkpoint" in data:  # its checkpoints under out_dir, not the model's run's
        out["checkpoint"] = {k: v for k, v in data["checkpoint"].items() if k != "dir"}
    text = "# written by shardwise plan: " + lay.label() + "\n"
    if lay.recompute == "selective":
        text += f"# {SELECTIVE_CUDA}\n"
    for section, table in out.items():
        if not isinstance(table, dict):
            continue
        text += f"\n[{section}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in table.items())
    from shardwise.base.config import Config

    Config.from_dict(tomllib.loads(text))  # what train will check, before writing
    return write_text(path, text)  # whole or not at all


# the engine's CUDA_REFUSAL (parallel.activation_checkpoint) in short, without importing it
SELECTIVE_CUDA = ("parallel.recompute = \"selective\": shardwise train refuses it on CUDA "
                  "until its GPU check has run (docs/gpu.md; it runs on the CPU); on GPUs "
                  "use parallel.recompute = \"stage\" or \"full\" for now")


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)
