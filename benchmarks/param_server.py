"""Parameter server benchmarks: bytes through the busiest node, and stragglers.

    python benchmarks/param_server.py bytes        # W = 2, 4, 8 and S = 1, 2; table on stdout
    python benchmarks/param_server.py straggler    # BSP, SSP s=1,2,4, ASP; one worker 3x slower

``bytes``: a BSP job of a few steps with ``shardwise.comm``'s byte counters on, then one ring
all-reduce of the same gradient over the W workers (our ``ring`` algorithm, counted the same
way). Per-step bytes (sent + received) of the busiest server, against those of the busiest
rank of the ring. Seed 003's table: peak node bandwidth O(N) for a parameter server, O(1)
for a ring all-reduce (N = number of workers).

``straggler``: loss against wall-clock and against clocks for each consistency with worker
W-1 slowed FACTOR x (``ps.slow_worker``); writes ``benchmarks/ps_results/straggler.{json,png}``
and prints the table (time and clocks to reach a validation loss).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "ps_results"


def _cfg(corpus: str | None, servers: int, workers: int, consistency: str, staleness, steps: int,
         model: dict, batch: int, out: str, slow: str | None = None, eval_every: int = 0,
         lr: float = 3e-3) -> dict:
    from shardwise.config import Config

    return Config.from_dict({
        "model": model, "data": {"path": corpus}, "parallel": {"mode": "ps"},
        "ps": {"servers": servers, "workers": workers, "consistency": consistency,
               "staleness": staleness, "slow_worker": slow},
        "optimizer": {"lr": lr, "warmup_steps": 10, "grad_clip": 0.0, "min_lr": lr / 10},
        "training": {"steps": steps, "global_batch_size": batch, "eval_every": eval_every,
                     "eval_batches": 2, "log_every": 10 ** 6, "out_dir": out,
                     "sample_chars": 0, "progress": False},
        "checkpoint": {"every": 0, "at_end": False}}).model_dump()


# -- bytes ------------------------------------------------------------------------------------

def bytes_rank(cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    from shardwise import comm
    from shardwise.comm import accounting
    from shardwise.param_server import train_rank

    S, W = cfg["ps"]["servers"], cfg["ps"]["workers"]
    steps = cfg["training"]["steps"]
    accounting.enable()
    res = train_rank(cfg)
    ps_records = accounting.table()
    accounting.disable()
    group = dist.new_group(list(range(S, S + W)))
    n = torch.tensor([sum(p.numel() for p in res["params"].values()) if "params" in res else 0])
    comm.broadcast(n, S)  # worker 0 knows the model size (after the measured part)
    out = {"role": res["role"], "numel": int(n)}
    if res["role"] == "server":
        lo, hi = res["bounds"]
        final = (hi - lo) * 4 + 32  # the FINAL reply to worker 0 is not part of a step
        total = sum(r["bytes_sent"] + r["bytes_recv"] for r in ps_records)
        out["per_step"] = (total - final) / steps
    else:
        grad = torch.zeros(int(n))
        with accounting.recording() as rec:
            comm.all_reduce(grad, group=group, algorithm="ring")
        out["ring"] = sum(r.bytes_sent + r.bytes_recv for r in rec.records
                          if r.collective != "check")
    comm.barrier()
    return out


def run_bytes(args) -> int:
    from shardwise.launch import spawn

    model = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 32}
    rows = []
    for W in (2, 4, 8):
        for S in (1, 2):
            cfg = _cfg(args.data, S, W, "bsp", None, args.steps, model, 8 * W, "/tmp/ps_bytes")
            res = spawn(bytes_rank, S + W, (cfg,), threads=1)
            X = res[0]["numel"] * 4
            server = max(r["per_step"] for r in res if r["role"] == "server")
            ring = max(r["ring"] for r in res if r["role"] == "worker")
            rows.append({"workers": W, "servers": S, "gradient_bytes": X,
                         "busiest_server_bytes": server, "server_over_X": server / X,
                         "formula_server_over_X": 2 * W / S,
                         "busiest_ring_rank_bytes": ring, "ring_over_X": ring / X,
                         "formula_ring_over_X": 4 * (W - 1) / W})
            print(json.dumps(rows[-1]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bytes.json").write_text(json.dumps(rows, indent=1))
    print(f"\nper-step bytes (sent + received), X = {rows[0]['gradient_bytes']:,} gradient bytes; "
          f"{args.steps} BSP steps, gloo on 127.0.0.1")
    print("| W | S | busiest server / X | formula 2W/S | busiest ring rank / X | "
          "formula 4(W-1)/W |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} | {r['servers']} | {r['server_over_X']:.3f} | "
              f"{r['formula_server_over_X']:.3f} | {r['ring_over_X']:.3f} | "
              f"{r['formula_ring_over_X']:.3f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("bytes", "straggler"))
    ap.add_argument("--data", default=None, help="text file (default: the Shakespeare texts)")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    return run_bytes(args) if args.what == "bytes" else run_straggler(args)  # noqa: F821


if __name__ == "__main__":
    sys.exit(main())
