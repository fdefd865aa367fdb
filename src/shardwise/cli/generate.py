"""``shardwise generate RUN_DIR --prompt TEXT``: sample from a run's checkpoint in the layout
of this launch (``apps.lm.generate``).

Examples::

    shardwise generate runs/finetune --prompt "ROMEO:" --tokens 200
    shardwise generate runs/finetune --prompt "ROMEO:" --parallel.tp 2      # 2 local ranks
    shardwise generate runs/finetune --prompt "ROMEO:" --temperature 1.0 --top-k 0 --seed 7
    torchrun --nproc-per-node 2 -m shardwise generate runs/finetune --prompt "A" --parallel.tp 2

The layout is one process unless ``--parallel.dp/tp/pp`` (any ``--section.field VALUE``
of the config) say otherwise; under torchrun the world it started must equal it.
"""

from __future__ import annotations

import sys
from typing import Sequence

from shardwise.cli.common import (
    EXIT_USAGE,
    Parser,
    positive_number,
    run_rank_and_exit,
    split_overrides,
    whole_number,
)


def main(argv: Sequence[str] | None = None) -> int:
    """``shardwise generate``: prints the prompt and its continuation; returns 0, or 2 with
    one line on stderr (no checkpoint, a prompt character outside the vocabulary, a bad
    layout), 1 when a rank fails."""
    ap = Parser(prog="shardwise generate",
                description="Sample from a run's checkpoint in the layout of this launch "
                "(any --section.field VALUE of the config, e.g. --parallel.tp 2).")
    ap.add_argument("run_dir", metavar="RUN_DIR", help="the run's training.out_dir, or a "
                    "checkpoint directory")
    ap.add_argument("--prompt", required=True, metavar="TEXT")
    ap.add_argument("--tokens", type=whole_number(1), default=200, metavar="N",
                    help="tokens to generate (default 200)")
    ap.add_argument("--temperature", type=positive_number, default=0.8, metavar="T",
                    help="softmax temperature (default 0.8)")
    ap.add_argument("--top-k", type=whole_number(0), default=20, metavar="K",
                    help="sample among the K likeliest tokens; 0: all (default 20)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    ap.add_argument("--step", type=int, metavar="N", help="the checkpoint of step N "
                    "(default: the newest)")
    args, extra = ap.parse_known_args(argv)
    from shardwise import checkpoint, launch
    from shardwise.apps.lm.export import find_checkpoint
    from shardwise.apps.lm.generate import generate_rank, generation_config
    from shardwise.data.tokenizer import tokenizer_from_state

    env = launch.rank_env_from_environ()
    try:
        path = find_checkpoint(args.run_dir, args.step)
        meta = checkpoint.check_loadable(path)  # checksums and metadata, no tensor read
        cfg = generation_config(meta, split_overrides(extra))
        tokenizer = tokenizer_from_state(meta["tokenizer"])
        missing = sorted(set(args.prompt) - set(getattr(tokenizer, "chars", args.prompt)))
        if missing:  # the character tokenizer knows only its text's characters
            raise ValueError(f"--prompt: {missing[0]!r} is not in the run's vocabulary of "
                             f"{tokenizer.vocab_size} characters")
        if env is not None and env.world_size != cfg.world_size:
            raise ValueError(f"the layout needs {cfg.world_size} ranks (parallel.dp x pp x "
                             f"tp), but torchrun started WORLD_SIZE={env.world_size}")
        device, _ = launch.pick_device(cfg.training.device, cfg.world_size)
    except ValueError as e:
        print(f"shardwise generate: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    prompt = tokenizer.encode(args.prompt).tolist() or tokenizer.start_ids()
    work = (cfg.model_dump(), str(path), prompt, args.tokens, args.temperature,
            args.top_k or None, args.seed)
    if env is not None:  # this process is one rank of torchrun's gang
        def body() -> None:
            launch.init_distributed(env, timeout_s=cfg.parallel.timeout_s,
                                    threads=cfg.training.threads or None, device=device)
            ids = generate_rank(*work)
            if env.rank == 0:
                print(tokenizer.decode(ids), flush=True)

        run_rank_and_exit(body, "shardwise generate")
    if cfg.world_size == 1:
        try:
            ids = generate_rank(*work)
        except ValueError as e:  # CheckpointError: tensors that do not load into this model
            print(f"shardwise generate: error: {e}", file=sys.stderr)
            return EXIT_USAGE
    else:
        try:
            ids = launch.spawn(generate_rank, cfg.world_size, work,
                               threads=cfg.training.threads or None,
                               timeout_s=cfg.parallel.timeout_s, device=device)[0]
        except launch.WorkerError as e:
            print(f"shardwise generate: error: {e}", file=sys.stderr)
            return EXIT_USAGE if e.usage else 1
    print(tokenizer.decode(ids))
    return 0
