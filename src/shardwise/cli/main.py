"""Command line: ``shardwise train`` (the main job), ``prepare`` (token shards of your own
data), ``export`` (a checkpoint as a Hugging Face model), ``generate`` (sample from a
checkpoint), ``bench comm``, ``bench calibrate``, ``memory``, ``plan`` (``--model cnn``:
the CNN's per-layer plan), ``timeline``.

Examples::

    shardwise train                                   # configs/shakespeare.toml, dp=2 local ranks
    shardwise train --config configs/tiny.toml --parallel.dp 4 --training.steps 50
    shardwise train --data my.txt                     # resumes if out_dir holds a checkpoint
    shardwise prepare my.jsonl --tokenizer bpe --out data/mine && shardwise train --data data/mine
    shardwise train --fresh                           # start over; old checkpoints moved aside
    shardwise train --max-restarts 3                  # restart the local ranks after a failure
    torchrun --nproc-per-node 2 -m shardwise train    # ranks come from torchrun's environment
    shardwise train --config configs/fashion_cnn.toml # the CNN, one strategy per layer
    shardwise plan --model cnn --batch 64 --ranks 4   # the CNN's per-layer plan and its bytes
    shardwise train --config configs/finetune_hf.toml --model.init_from hf:DIR --data my.txt
    shardwise export runs/finetune --format hf --out exported   # from_pretrained loads it
    shardwise generate runs/finetune --prompt "ROMEO:" --parallel.tp 2
    shardwise train --help                            # every config field: type, default, meaning
    shardwise --version

Bad input (unknown key, wrong type, impossible sizes, missing file) prints one line naming
the field or file and exits with code 2, before any rank starts; a misspelt key or section
names the nearest one (``optimizer.lrr: unknown key; did you mean optimizer.lr?``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from shardwise.base.version import version
from shardwise.cli.common import EXIT_USAGE, Parser, split_overrides, whole_number

DEFAULT_CONFIG = "configs/shakespeare.toml"


def cmd_train(args, extra: list[str]) -> int:
    """``shardwise train``: load the config and its overrides, check it and the data before any rank
    starts (one line, exit 2, on bad input), then train here (under torchrun) or spawn the local
    ranks, restarting up to ``--max-restarts`` times. Returns the exit code."""
    import time

    from shardwise.base.config import Config, ConfigError
    from shardwise.base.errors import RunError

    started = time.perf_counter()  # the closing line reports the command's wall time

    if args.resume and args.fresh:
        print("shardwise: error: --resume and --fresh exclude each other", file=sys.stderr)
        return EXIT_USAGE
    mode = "fresh" if args.fresh else "resume" if args.resume else "auto"
    try:  # the config alone first: a typo is told before torch is imported (0.3 s, not 4 s)
        overrides = split_overrides(extra)
        if args.data is not None:
            overrides["data.path"] = args.data
        config_path = args.config
        if config_path is None and Path(DEFAULT_CONFIG).is_file():
            config_path = DEFAULT_CONFIG
        cfg = Config.load(config_path, overrides)
    except (ConfigError, RunError, ValueError) as e:
        print(f"shardwise: error: {e}", file=sys.stderr)
        return EXIT_USAGE

    from shardwise import launch
    from shardwise.apps.registry import app_for
    from shardwise.data import DataError
    from shardwise.training import rundir
    from shardwise.training.loggers import check_loggers

    env = launch.rank_env_from_environ()
    is_rank0 = env is None or env.rank == 0
    # under torchrun --max-restarts, a restarted gang resumes even if launched with --fresh
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    try:
        app = app_for(cfg)
        if cfg.fault_tolerance.enable and app.name != "lm":
            raise ConfigError(f"fault_tolerance.enable with the {app.name} application: only "
                              "the language model trains as replica groups of a torchft job")
        cfg = app.resolve(cfg)  # model.init_from: the model of its config.json
        check_loggers(cfg)  # training.tensorboard / wandb: their packages are there
        app.check_config(cfg)  # the application's own rules (the CNN's plan, the servers' keys)
        app.check_data(cfg)  # missing, unreadable or too small
        if env is not None and env.world_size != cfg.world_size:
            raise ConfigError(
                f"the layout needs {cfg.world_size} ranks (parallel.dp x pp x cp x tp, or ps.servers "
                f"+ ps.workers), but torchrun started "
                f"WORLD_SIZE={env.world_size}")
        local = env.local_world_size if env is not None else cfg.world_size
        device, device_note = launch.pick_device(cfg.training.device, local,  # before any rank
                                                 backend=cfg.parallel.backend)
        if cfg.training.precision == "fp8":  # torchao installed, float8 matmuls on this device
            from shardwise.parallel.float8 import check_fp8

            check_fp8(device)  # every visible GPU (the local ranks use them, sharing or not)
        if device == "cuda" and cfg.parallel.recompute == "selective":
            from shardwise.parallel.activation_checkpoint import CUDA_REFUSAL

            raise ConfigError(CUDA_REFUSAL)
        plan = rundir.prepare(cfg, mode, is_rank0=is_rank0, restart=restart)
        if plan.resume_from and app.check_resumable is not None:
            app.check_resumable(plan.resume_from, cfg)
    except (ConfigError, DataError, RunError, ValueError) as e:
        print(f"shardwise: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if is_rank0:  # on their own lines (a restarted rank's follow its dead gang's bar)
        from shardwise.training.console import status

        for note in [device_note] if device_note else []:
            status(note, file=sys.stderr)
        for note in plan.notes:
            status(f"shardwise: {note}", file=sys.stderr)
    resume_from = str(plan.resume_from) if plan.resume_from else False

    # plan.lock (the out_dir flock) stays held while this frame lives, i.e. for the whole run
    if env is not None:  # under torchrun: this process is one rank; torchrun restarts the gang
        _run_as_torchrun_rank(cfg, env, resume_from, device, started)
    return _run_local(cfg, resume_from, args.max_restarts, device, started)


def _closing_line(cfg, result: dict, started: float) -> str:
    """``shardwise: done: N steps in T s, <the application's summary>; outputs in DIR``, from
    the result of the application's ``result_rank``; ``started``: ``time.perf_counter()``."""
    import time

    from shardwise.apps.registry import app_for

    return (f"shardwise: done: {result['step']} steps in {time.perf_counter() - started:.0f} s, "
            f"{app_for(cfg).summary(result)}; outputs in {cfg.training.out_dir}")


def _run_as_torchrun_rank(cfg, env, resume_from: str | bool, device: str,
                          started: float) -> None:
    """Join torchrun's gang (a fresh store prefix per restart), train, ``os._exit``; the
    application's ``result_rank`` prints the closing line."""
    from shardwise import launch
    from shardwise.apps.jobs import train_worker
    from shardwise.apps.registry import app_for
    from shardwise.cli.common import run_rank_and_exit

    def body() -> None:
        dev = launch.init_distributed(env, timeout_s=cfg.parallel.timeout_s,
                                      threads=cfg.training.threads or None,
                                      store=launch.elastic_store(env, cfg.parallel.timeout_s),
                                      device=device, backend=cfg.parallel.backend)
        result = train_worker(cfg.model_dump(), resume_from, str(dev))
        if env.rank == app_for(cfg).result_rank(cfg):
            print(_closing_line(cfg, result, started), flush=True)

    run_rank_and_exit(body)


def _run_local(cfg, resume_from: str | bool, max_restarts: int, device: str = "auto",
               started: float | None = None) -> int:
    """Spawn the local ranks; restart them (resuming) up to ``max_restarts`` times after a
    failure; on SIGTERM / SIGINT stop every rank and exit 128 + signal with one line. The
    closing line gives the wall time since ``started`` (``time.perf_counter``; None: now)."""
    import time

    from shardwise import launch
    from shardwise.apps.jobs import train_worker
    from shardwise.apps.registry import app_for
    from shardwise.base.errors import RunError
    from shardwise.training import rundir
    from shardwise.training.console import status  # not inside a dead rank's bar

    def _terminate(signum, frame):
        raise launch.Interrupted(signum)

    signal.signal(signal.SIGTERM, _terminate)
    # SIGINT too, explicitly: a launcher started in the background by a shell inherits SIGINT
    # ignored (POSIX, for asynchronous commands), and Python then leaves it ignored
    signal.signal(signal.SIGINT, _terminate)
    started = time.perf_counter() if started is None else started
    restarts = 0
    while True:
        try:
            results = launch.spawn(train_worker, cfg.world_size,
                                   (cfg.model_dump(), resume_from, device),
                                   threads=cfg.training.threads or None,
                                   timeout_s=cfg.parallel.timeout_s, device=device,
                                   backend=cfg.parallel.backend)
            break
        except launch.WorkerError as e:
            # every rank has ended and the lock is ours: what a rank stopped mid-write goes
            # (a full disk gets its space back before the traceback is written)
            rundir.clean_stale(Path(cfg.training.out_dir), cfg.checkpoint_dir)
            kept = _keep_traceback(cfg, e)
            if e.fatal:  # one line; exit 2 when the user can fix it (a full disk, a setting)
                status(f"shardwise: error: {e}{f' ({kept})' if kept else ''}", file=sys.stderr)
                return EXIT_USAGE if e.usage else 1
            if restarts >= max_restarts:
                status(f"shardwise: training failed: {e}", file=sys.stderr)
                if kept:
                    status(f"shardwise: {kept}", file=sys.stderr)
                return 1
            restarts += 1
            status(f"shardwise: {str(e).splitlines()[0].rstrip(':')}; restart {restarts} of "
                   f"{max_restarts}", file=sys.stderr)
            try:
                again = rundir.prepare(cfg, "auto", restart=True, lock=False)  # ours already
            except (RunError, ValueError) as e2:
                status(f"shardwise: error: {e2}", file=sys.stderr)
                return 1
            for note in again.notes:
                status(f"shardwise: {note}", file=sys.stderr)
            resume_from = str(again.resume_from) if again.resume_from else False
        except (launch.Interrupted, KeyboardInterrupt) as e:
            signum = getattr(e, "signum", signal.SIGINT)
            status(f"shardwise: stopped by {signal.Signals(signum).name}: every rank ended; "
                   f"checkpoints so far are in {cfg.checkpoint_dir}", file=sys.stderr)
            return 128 + signum
    print(_closing_line(cfg, results[app_for(cfg).result_rank(cfg)], started))
    return 0


ERROR_LOG = "errors.log"  # under training.out_dir: the tracebacks of failed ranks


def _keep_traceback(cfg, e) -> str:
    """Append the failed rank's traceback (``WorkerError.traceback``) to
    ``training.out_dir/errors.log``; return the words that point to it, or say why not
    ("" when the rank left no traceback)."""
    import time

    path = Path(cfg.training.out_dir) / ERROR_LOG
    if not e.traceback:
        return ""
    try:
        with open(path, "a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}: {str(e).splitlines()[0]}\n"
                    f"{e.traceback.rstrip()}\n")
    except OSError as err:
        return f"the traceback could not be written to {path} ({err.strerror})"
    return f"traceback in {path}"


def cmd_bench(args, extra: list[str]) -> int:
    """``shardwise bench WHAT``: ``comm`` (``cli.bench``) or ``calibrate``
    (``cli.bench_calibrate``). Returns the exit code."""
    if args.what == "comm":
        from shardwise.cli.bench import main as comm_main

        return comm_main(extra)
    if args.what == "calibrate":
        from shardwise.cli.bench_calibrate import main as calibrate_main

        return calibrate_main(extra)
    print(f"shardwise: error: unknown benchmark {args.what!r}", file=sys.stderr)
    return EXIT_USAGE


def cmd_memory(args, extra: list[str]) -> int:
    """``shardwise memory``: ``cli.memory.main`` on the remaining arguments."""
    from shardwise.cli.memory import main as memory_main

    return memory_main(extra)


def cmd_plan(args, extra: list[str]) -> int:
    """``shardwise plan``: ``cli.plan.plan_main`` on the remaining arguments."""
    from shardwise.cli.plan import plan_main

    return plan_main(extra)


def cmd_prepare(args, extra: list[str]) -> int:
    """``shardwise prepare``: ``cli.prepare.main`` on the remaining arguments."""
    from shardwise.cli.prepare import main as prepare_main

    return prepare_main(extra)


def cmd_export(args, extra: list[str]) -> int:
    """``shardwise export``: ``cli.export.main`` on the remaining arguments."""
    from shardwise.cli.export import main as export_main

    return export_main(extra)


def cmd_generate(args, extra: list[str]) -> int:
    """``shardwise generate``: ``cli.generate.main`` on the remaining arguments."""
    from shardwise.cli.generate import main as generate_main

    return generate_main(extra)


def cmd_timeline(args, extra: list[str]) -> int:
    """``shardwise timeline``: ``cli.timeline.main`` on the remaining arguments."""
    from shardwise.cli.timeline import main as timeline_main

    return timeline_main(extra)




class _Version(argparse.Action):
    """``--version``: print ``shardwise X.Y.Z`` and exit 0 (looked up only when asked)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"shardwise {version()}")
        parser.exit()


def _wide(prog: str) -> argparse.HelpFormatter:
    """Help with the option column wide enough for ``--parallel.sequence_parallel bool``."""
    return argparse.HelpFormatter(prog, max_help_position=44)


def build_parser(model_kind: str | None = None,
                 model_module: str | None = None) -> argparse.ArgumentParser:
    """The ``shardwise`` parser. ``train`` takes every config field as ``--section.field
    VALUE`` (``cli.config_args``, added when ``train`` parses or prints its help; its help
    lists ``model_kind``'s [model] fields, ``model_module`` imported first); the other
    commands pass their arguments, ``--help`` included, to their own parsers."""
    import functools

    from shardwise.cli.config_args import add_config_arguments

    parser = Parser(prog="shardwise", description="Distributed training on PyTorch.")
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    t = sub.add_parser("train", help="train a decoder (GPT, Llama, your own) on text, or the "
                       "CNN, across local ranks (or under torchrun)",
                       description="Train across local ranks (or as one rank under torchrun). "
                       "Any config field can be overridden: --section.field VALUE (a TOML "
                       "literal: 4, 1e-3, true, \"[32, 64]\"); every field is listed below.",
                       usage="shardwise train [--config TOML] [--data FILE|DIR] [--resume | --fresh] "
                       "[--max-restarts N] [--section.field VALUE ...]",
                       allow_abbrev=False,
                       late_arguments=functools.partial(add_config_arguments, kind=model_kind,
                                                        module=model_module),
                       formatter_class=_wide)
    t.add_argument("--config", metavar="TOML", help=f"TOML config (default {DEFAULT_CONFIG})")
    t.add_argument("--data", metavar="FILE|DIR",
                   help="train on this UTF-8 text file, or on the token shards `shardwise "
                        "prepare` wrote to DIR, instead of Shakespeare")
    t.add_argument("--resume", action="store_true",
                   help="require a checkpoint to continue from (a run resumes by default when "
                        "its checkpoint.dir holds one)")
    t.add_argument("--fresh", action="store_true",
                   help="start at step 0: move old checkpoints and metrics aside (never deleted)")
    t.add_argument("--max-restarts", type=whole_number(0), default=0, metavar="N",
                   help="restart the local ranks up to N times after a failure, resuming")
    t.set_defaults(func=cmd_train)
    b = sub.add_parser("bench", help="benchmarks: comm, calibrate",
                       description="Benchmarks. shardwise bench comm --help, shardwise bench "
                       "calibrate --help: their options.")
    bench = b.add_subparsers(dest="what", required=True, metavar="{comm,calibrate}",
                             parser_class=Parser)
    bench.add_parser("comm", help="collectives of shardwise.comm: bus bandwidth per algorithm, "
                     "world size and message size", add_help=False)  # comm's own --help
    bench.add_parser("calibrate", help="time a model's GEMMs, attention, memory-bound ops and "
                     "AdamW step on this device: a kernel profile for plan --kernels-profile",
                     add_help=False)  # its own --help
    b.set_defaults(func=cmd_bench)
    mem = sub.add_parser("memory", help="bytes per rank for each ZeRO stage: formulas and measured",
                         add_help=False)
    mem.set_defaults(func=cmd_memory)
    pl = sub.add_parser("plan", help="rank layouts of a model on a cluster: memory per GPU and "
                        "predicted step time; emit the best as a TOML", add_help=False)
    pl.set_defaults(func=cmd_plan)
    pr = sub.add_parser("prepare", help="tokenize text, JSONL or Parquet into token shards for "
                        "train --data DIR (char, a BPE trained here, or a tokenizer.json)",
                        add_help=False)
    pr.set_defaults(func=cmd_prepare)
    ex = sub.add_parser("export", help="a run's checkpoint as a Hugging Face model "
                        "(config.json, safetensors, tokenizer)", add_help=False)
    ex.set_defaults(func=cmd_export)
    ge = sub.add_parser("generate", help="sample from a run's checkpoint in the layout of this "
                        "launch", add_help=False)
    ge.set_defaults(func=cmd_generate)
    tl = sub.add_parser("timeline", help="pipeline Gantt chart of a run, or of a schedule (--predict)",
                        add_help=False)
    tl.set_defaults(func=cmd_timeline)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``shardwise ...``; returns the exit code (2: bad input, one line on stderr)."""
    from shardwise.cli.config_args import model_option, overrides

    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(model_option(argv, "kind"), model_option(argv, "module"))
    args, extra = parser.parse_known_args(argv)
    extra = overrides(args) + extra  # train's --section.field options, back as text
    try:
        return args.func(args, extra)
    except KeyboardInterrupt:  # Ctrl-C outside a run (while importing, checking): one line
        print("shardwise: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT

if __name__ == "__main__":
    raise SystemExit(main())
