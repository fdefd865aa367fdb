"""``shardwise timeline``: draw a run's recorded pipeline timeline, or a schedule's prediction
(``shardwise.parallel.pipeline.timeline`` records and renders them)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from shardwise.cli.common import EXIT_USAGE, Parser
from shardwise.parallel.pipeline.schedules import ScheduleError, validate_args
from shardwise.parallel.pipeline.timeline import load, predicted, render


def main(argv: Sequence[str] | None = None) -> int:
    """``shardwise timeline``: draw RUN_DIR's recorded timeline, or a schedule's prediction.
    Returns 0, or 2 with a one-line error on stderr."""
    ap = Parser(prog="shardwise timeline", description="Draw RUN_DIR's recorded pipeline "
                "timeline (a run with parallel.pp > 1), or a schedule's prediction (--predict).")
    ap.add_argument("run_dir", nargs="?", help="run directory holding timeline/rank*.json")
    ap.add_argument("--out", help="PNG path (default RUN_DIR/timeline.png)")
    ap.add_argument("--predict", metavar="KIND", help="draw schedule KIND's ideal timeline instead")
    ap.add_argument("--pp", type=int, default=4, help="pipeline stages p (default 4)")
    ap.add_argument("--micro-batches", type=int, default=8, help="micro-batches m (default 8)")
    ap.add_argument("--chunks-per-rank", type=int, default=1,
                    help="model chunks per rank v: interleaved, 2 for zbv and dualpipev "
                         "(default 1)")
    args = ap.parse_args(argv)
    try:
        if args.predict:
            p, m, v = args.pp, args.micro_batches, args.chunks_per_rank
            validate_args(args.predict, p, m, v)
            events = predicted(args.predict, p, m, v)
            out = args.out or f"{args.predict}_p{p}_m{m}_v{v}.png"
            title = f"predicted {args.predict} p={p} m={m} v={v}"
            render(events, out, title, unit="forward times")
        else:
            if not args.run_dir:
                raise ValueError("give RUN_DIR or --predict KIND")
            events, meta = load(args.run_dir)
            out = args.out or str(Path(args.run_dir) / "timeline.png")
            render(events, out, meta.get("title", f"measured {args.run_dir}"))
    except (ScheduleError, ValueError, FileNotFoundError) as exc:
        print(f"shardwise timeline: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(out)
    return 0
