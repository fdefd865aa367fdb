"""How much this machine's speed moves over minutes on its own: the floor under every
measurement ``benchmarks/planner_local.py`` compares the planner with.

Every ``--every`` seconds for ``--minutes``, nothing else of ours running, two of the
local cluster's own measurements (``planner.hardware``), each taken as the planner takes
it:

- ``calibrate_local`` of the GPT of ``benchmarks/layouts.py`` (4 x 128, context 64): the
  block's FLOP/s and fixed seconds per pass (one thread's CPU seconds, the fastest of 15
  passes at 1 and 8 sequences) and the optimizer step per parameter;
- one rank alone training ``probe_spec``'s model (``shared_seconds``' "alone" spawn: 16
  steps of 2 sequences), a fifth of the way up its sorted wall seconds.

Reports each series' least, median and greatest value, the greatest over the least, and the
load average before and after. Writes ``OUT/machine_drift.txt``.

    python benchmarks/machine_drift.py --out benchmarks/planner_results
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import planner_local as P  # noqa: E402  (the planner's spec of the benchmark's GPT)


def sample(spec) -> dict:
    """One of each measurement, now."""
    from shardwise.planner import hardware as H

    # the uncached call: calibrate_local keeps its first answer for the process
    cal = H.calibrate_local.__wrapped__(spec.n_embd, spec.block_size, spec.n_head, spec)
    walls, _ = H._probe_steps(H.probe_spec(spec, spec.block_size), 1, 1)
    alone = sorted(walls)[len(walls) // H.PROBE_QUANTILE]
    return {"block GFLOP/s": cal["block_flops"] / 1e9, "fixed ms a pass": cal["overhead_s"] * 1e3,
            "optimizer ns a parameter": cal["optimizer_param_s"] * 1e9,
            "one rank's probe step ms": alone * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--every", type=float, default=15.0, help="seconds between samples")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "planner_results"))
    a = ap.parse_args()
    import torch

    spec = P.spec_of("gpt", 65)
    load0, t0 = os.getloadavg(), time.monotonic()
    rows = []
    while time.monotonic() - t0 < 60 * a.minutes and len(rows) < 1000:
        start = time.monotonic()
        rows.append(sample(spec))
        print(f"{time.monotonic() - t0:6.0f} s  " + "  ".join(
            f"{k} {v:.3g}" for k, v in rows[-1].items()), flush=True)
        time.sleep(max(0.0, a.every - (time.monotonic() - start)))
    load1 = os.getloadavg()
    lines = [f"the GPT of benchmarks/layouts.py (4 x 128, context 64); {os.cpu_count()} cores, "
             f"torch {torch.__version__}; {len(rows)} samples every {a.every:g} s over "
             f"{(time.monotonic() - t0) / 60:.1f} min; load average (1, 5, 15 min) before "
             f"{', '.join(f'{x:.2f}' for x in load0)}, after "
             f"{', '.join(f'{x:.2f}' for x in load1)}",
             f"{'measurement':28s} {'least':>8s} {'median':>8s} {'greatest':>8s} {'ratio':>6s}"]
    for k in rows[0]:
        v = [r[k] for r in rows]
        lines.append(f"{k:28s} {min(v):8.3g} {statistics.median(v):8.3g} {max(v):8.3g} "
                     f"{max(v) / min(v):6.2f}")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "machine_drift.txt").write_text(text)


if __name__ == "__main__":
    main()
