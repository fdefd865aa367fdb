"""Mixture of experts: step time and all-to-all bytes against ep, on CPU gloo ranks.

One spawn of ``--ranks`` ranks (1 torch thread each) trains the same MoE Llama (Shakespeare,
``--experts`` experts top-``--top-k``, dropless) at dp = ranks with ep in ``--eps`` (ep folded
over dp: each rank holds E / ep experts), for each all-to-all algorithm in ``--algorithms``
(``native``: gloo's; ``pairwise``, ``linear``: ours on send/recv). Layouts alternate order
from repeat to repeat. Per run: ``--warmup`` untimed steps, then ``--steps`` timed ones
(median step seconds over the ranks' maxima), then one step under ``comm.accounting``:

- all-to-all bytes each rank sends per step (ours only; gloo's own are not counted), against
  the uniform-routing expectation ``4 L m (1 - 1/ep) (B/dp/m) T k C b``: per MoE layer L and
  micro-batch m, the dispatch and the combine forward and their reverses backward, each rank
  keeping the 1/ep of its rows whose experts it holds;
- gradient all-reduce bytes per rank (``parallel.allreduce = ring``, counted): with ep the
  expert gradients are reduced over the dp / ep ranks holding the same experts only;
- parameter bytes per rank (``Engine.memory_bytes``).

Writes ``benchmarks/moe_results/moe.json`` and ``moe.txt`` (the table printed)::

    python benchmarks/moe.py                       # 4 ranks, ep 1 2 4, native and pairwise
    python benchmarks/moe.py --repeats 5 --steps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "moe_results"


def config(args, ep: int, algorithm: str) -> dict:
    from shardwise.base.config import Config

    return Config.from_dict({
        "model": {"kind": "llama", "n_layer": args.layers, "n_head": 4, "n_embd": args.width,
                  "block_size": args.seq, "n_experts": args.experts, "top_k": args.top_k,
                  "moe_ffn_hidden": args.expert_width, "tie_weights": False},
        "parallel": {"dp": args.ranks, "ep": ep, "all_to_all": algorithm, "allreduce": "ring",
                     "micro_batches": args.micro_batches},
        "optimizer": {"warmup_steps": 2},
        "training": {"steps": 10 ** 6, "global_batch_size": args.batch, "eval_every": 0,
                     "progress": False, "sample_chars": 0, "out_dir": "/tmp/shardwise-moe-bench"},
        "checkpoint": {"every": 0, "at_end": False},
    }).model_dump()


def run(cfg_dict: dict, steps: int, warmup: int) -> dict:
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.base.config import Config
    from shardwise.comm import accounting

    trainer = build_trainer(Config.from_dict(cfg_dict))
    for _ in range(warmup):
        trainer.train_step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts until its slowest rank ends
        times.append(float(t))
    with accounting.recording() as rec:
        info = trainer.train_step()
    rows = accounting.table(rec.records)
    a2a = [r for r in rows if r["collective"] == "all_to_all"]
    grads = [r for r in rows if r["collective"] == "all_reduce" and r["nbytes"] > 64]
    counted = all(r["bytes_sent"] is not None for r in a2a)
    mem = trainer.engine.memory_bytes()
    expert = sum(p.numel() * p.element_size() for n, p in trainer.engine.named_parameters()
                 if ".experts." in n)
    return {"step_s": statistics.median(times), "a2a_calls": len(a2a),
            "a2a_sent": sum(r["bytes_sent"] for r in a2a) if counted else None,
            "grad_allreduce_sent": sum(r["bytes_sent"] or 0 for r in grads),
            "params_bytes": mem["params"], "expert_bytes": expert,
            "load": info["expert_load"], "loss": info["loss"]}


def worker(args_dict: dict) -> dict:
    from shardwise import comm

    torch.set_num_threads(1)
    comm.configure(check=False)
    args = argparse.Namespace(**args_dict)
    out: dict[str, list] = {}
    for r in range(args.repeats):
        eps = args.eps if r % 2 == 0 else list(reversed(args.eps))
        for ep in eps:
            for algo in args.algorithms:
                res = run(config(args, ep, algo), args.steps, args.warmup)
                out.setdefault(f"ep{ep}-{algo}", []).append(res)
    return out


def main(argv: list[str] | None = None) -> int:
    from shardwise.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--eps", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    ap.add_argument("--algorithms", type=lambda s: s.split(","), default=["native", "pairwise"])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--expert-width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="global batch, sequences")
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    res = spawn(worker, args.ranks, (vars(args),), threads=1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [(f"MoE Llama {args.layers} x {args.width}, {args.experts} experts top-{args.top_k} "
              f"of width {args.expert_width}, dropless; batch {args.batch} x {args.seq} tokens, "
              f"m={args.micro_batches}; dp={args.ranks} gloo ranks on the CPU, 1 thread each; "
              f"{args.repeats} alternated repeats of {args.steps} steps"),
             (f"{'layout':>14} {'step ms':>8} {'a2a KiB/rank':>13} {'uniform KiB':>12} "
              f"{'grad AR KiB/rank':>17} {'expert KiB/rank':>16} {'params KiB/rank':>16}")]
    summary = {}
    for key in res[0]:
        ep = int(key[2:].split("-")[0])
        step = statistics.median(x["step_s"] for x in res[0][key])
        sent = [x["a2a_sent"] for rank in res for x in rank[key][:1]]
        a2a = None if None in sent else statistics.mean(sent)
        uniform = (4 * args.layers * (1 - 1 / ep) * (args.batch // args.ranks) * args.seq
                   * args.top_k * args.width * 4)
        grad = statistics.mean(x["grad_allreduce_sent"] for rank in res for x in rank[key][:1])
        first = res[0][key][0]
        summary[key] = {"ep": ep, "step_ms": 1000 * step, "a2a_sent_per_rank": a2a,
                        "a2a_uniform": uniform, "grad_allreduce_sent_per_rank": grad,
                        "expert_bytes": first["expert_bytes"], "params_bytes": first["params_bytes"],
                        "a2a_calls": first["a2a_calls"],
                        "runs_ms": [round(1000 * x["step_s"], 1) for x in res[0][key]]}
        lines.append(f"{key:>14} {1000 * step:8.1f} "
                     f"{'-' if a2a is None else f'{a2a / 1024:.1f}':>13} {uniform / 1024:12.1f} "
                     f"{grad / 1024:17.1f} {first['expert_bytes'] / 1024:16.1f} "
                     f"{first['params_bytes'] / 1024:16.1f}")
    text = "\n".join(lines)
    print(text)
    (out / "moe.txt").write_text(text + "\n")
    (out / "moe.json").write_text(json.dumps({"args": vars(args), "summary": summary,
                                              "raw": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
