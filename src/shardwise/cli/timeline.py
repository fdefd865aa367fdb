"""``shardwise timeline``: draw a run's recorded pipeline timeline, or a schedule's prediction
(``shardwise.parallel.pipeline.timeline`` records and renders them)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from shardwise.cli.common import Parser
from shardwise.parallel.pipeline.schedules import ScheduleError, validate_args
from shardwise.parallel.pipeline.timeline import load, predicted, render


def main(argv: Sequence[str] | None = None) -> int:
    """``shardwise timeline``: draw RUN_DIR's recorded timeline, or a schedule's prediction.
    Returns 0, or 2 with a one-line error on stderr."""
    ap = Parser(prog="shardwise timeline", description=main.__doc__)
    ap.add_argument("run_dir", nargs="?", help="run directory holding timeline/rank*.json")
    ap.add_argument("--out", help="PNG path (default RUN_DIR/timeline.png)")
    ap.add_argument("--predict", metavar="KIND", help="draw schedule KIND's ideal timeline instead")
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--v", type=int, default=1)
    args = ap.parse_args(argv)
    try:
        if args.predict:
            validate_args(args.predict, args.p, args.m, args.v)
            events = predicted(args.predict, args.p, args.m, args.v)
            out = args.out or f"{args.predict}_p{args.p}_m{args.m}_v{args.v}.png"
            title = f"predicted {args.predict} p={args.p} m={args.m} v={args.v}"
            render(events, out, title, unit="forward times")
        else:
            if not args.run_dir:
                raise ValueError("give RUN_DIR or --predict KIND")
            events, meta = load(args.run_dir)
            out = args.out or str(Path(args.run_dir) / "timeline.png")
            render(events, out, meta.get("title", f"measured {args.run_dir}"))
    except (ScheduleError, ValueError, FileNotFoundError) as exc:
        print(f"shardwise timeline: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0
