"""Command line: ``shardwise train`` (the main job), ``bench comm``, ``memory``, ``timeline``.

Examples::

    shardwise train                                   # configs/shakespeare.toml, dp=2 local ranks
    shardwise train --config configs/tiny.toml --parallel.dp 4 --training.steps 50
    shardwise train --data my.txt --resume            # continue from the latest checkpoint
    torchrun --nproc-per-node 2 -m shardwise train    # ranks come from torchrun's environment

Bad input (unknown key, wrong type, impossible sizes, missing file) prints one line naming
the field or file and exits with code 2, before any rank starts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_USAGE = 2
DEFAULT_CONFIG = "configs/shakespeare.toml"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse's default prints usage too)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _split_overrides(extra: list[str]) -> dict:
    from shardwise.config import ConfigError, parse_override_value

    out, i = {}, 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--") or "." not in tok:
            raise ConfigError(f"unrecognised argument {tok!r}; overrides look like --section.field VALUE")
        key, eq, val = tok[2:].partition("=")
        if not eq:
            if i + 1 >= len(extra):
                raise ConfigError(f"--{key}: missing value")
            val, i = extra[i + 1], i + 1
        out[key] = parse_override_value(val)
        i += 1
    return out


def cmd_train(args, extra: list[str]) -> int:
    from shardwise import checkpoint, launch
    from shardwise.config import Config, ConfigError
    from shardwise.data import DataError, load_text
    from shardwise.jobs import train_worker

    try:
        overrides = _split_overrides(extra)
        if args.data is not None:
            overrides["data.path"] = args.data
        config_path = args.config
        if config_path is None and Path(DEFAULT_CONFIG).is_file():
            config_path = DEFAULT_CONFIG
        cfg = Config.load(config_path, overrides)
        load_text(cfg.data.path)  # a missing or unreadable corpus stops us here, not in a rank
        if args.resume and checkpoint.latest_checkpoint(cfg.checkpoint_dir) is None:
            raise ConfigError(f"--resume: no complete checkpoint in {str(cfg.checkpoint_dir)!r}")
        if args.resume and cfg.parallel.mode == "ps":
            from shardwise.param_server.state import check_resumable

            check_resumable(checkpoint.latest_checkpoint(cfg.checkpoint_dir), cfg)
        env = launch.rank_env_from_environ()
        if env is not None and env.world_size != cfg.world_size:
            raise ConfigError(
                f"the layout needs {cfg.world_size} ranks (parallel.dp x pp x tp, or ps.servers "
                f"+ ps.workers), but torchrun started "
                f"WORLD_SIZE={env.world_size}")
    except (ConfigError, DataError, ValueError) as e:
        print(f"shardwise: error: {e}", file=sys.stderr)
        return EXIT_USAGE

    threads = cfg.training.threads or None
    if env is not None:  # under torchrun: this process is one rank
        code = 0
        try:
            launch.init_distributed(env, timeout_s=cfg.parallel.timeout_s, threads=threads)
            train_worker(cfg.model_dump(), args.resume)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            launch.shutdown(clean=code == 0)
        sys.stdout.flush()
        sys.stderr.flush()
        import os

        os._exit(code)  # skip gloo's abort at interpreter exit

    try:
        results = launch.spawn(train_worker, cfg.world_size, (cfg.model_dump(), args.resume),
                               threads=threads, timeout_s=cfg.parallel.timeout_s)
    except launch.WorkerError as e:
        print(f"shardwise: training failed: {e}", file=sys.stderr)
        return 1
    s = results[cfg.ps.servers if cfg.parallel.mode == "ps" else 0]  # ps: worker 0
    print(f"shardwise: done: {s['step']} steps in {s['elapsed_s']:.0f} s, "
          f"final train loss {s['loss']:.4f}, validation loss {s['val_loss']:.4f} nats/char; "
          f"outputs in {cfg.training.out_dir}")
    return 0


def cmd_bench(args, extra: list[str]) -> int:
    if args.what == "comm":
        from shardwise.comm.bench import main as comm_main

        return comm_main(extra)
    print(f"shardwise: error: unknown benchmark {args.what!r}", file=sys.stderr)
    return EXIT_USAGE


def cmd_memory(args, extra: list[str]) -> int:
    from shardwise.zero.report import main as memory_main

    return memory_main(extra)


def cmd_timeline(args, extra: list[str]) -> int:
    from shardwise.pipeline.timeline import main as timeline_main

    return timeline_main(extra)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shardwise", description="Distributed training on PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser("train", help="train a GPT on text across local ranks (or under torchrun)",
                       description="Any config field can be overridden: --section.field VALUE")
    t.add_argument("--config", help=f"TOML config (default {DEFAULT_CONFIG})")
    t.add_argument("--data", help="train on this UTF-8 text file instead of Shakespeare")
    t.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    t.set_defaults(func=cmd_train)
    b = sub.add_parser("bench", help="benchmarks: comm", add_help=False)
    b.add_argument("what", help="which benchmark (comm)")
    b.set_defaults(func=cmd_bench)
    mem = sub.add_parser("memory", help="bytes per rank for each ZeRO stage: formulas and measured",
                         add_help=False)
    mem.set_defaults(func=cmd_memory)
    tl = sub.add_parser("timeline", help="pipeline Gantt chart of a run, or of a schedule (--predict)",
                        add_help=False)
    tl.set_defaults(func=cmd_timeline)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    return args.func(args, extra)


if __name__ == "__main__":
    raise SystemExit(main())
