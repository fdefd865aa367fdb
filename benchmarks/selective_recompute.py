"""Selective recomputation with collectives: the numbers behind tests/test_recompute.py.

For every layout of the test's ``LAYOUTS`` (2 and 4 local gloo ranks, the tiny GPT or the
MoE Llama of 4 experts, 3 steps of 16 sequences of 32 tokens on Shakespeare), trained without
recomputation and with ``parallel.recompute = "selective"``, one line:

- ``err_plain``: the largest relative error (Frobenius, per tensor) of any rank's parameters
  with selective recomputation against the same layout without it (0: bit for bit);
- ``err_one``: the same against one process (nan: the dropout layout, whose masks depend on
  the layout);
- ``calls`` / ``sent``: rank 0's collective calls in the last step and the payload bytes it
  sent, plain -> selective (tp's collectives are the backend's own, "native": counted as
  calls of a size, their bytes unknown to ``comm.accounting``; equal sizes and calls are
  asserted by the test);
- ``held``: per rank, the bytes its forwards held when backward began, plain -> selective
  (``recompute_workers.step_held``: malloc's count, glibc thread caches off), and what
  ``planner.memory.activation_bytes`` predicts for the busiest rank, both ways.

    python benchmarks/selective_recompute.py        # ~40 s on 2 cores
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests")]
os.environ["GLIBC_TUNABLES"] = "glibc.malloc.tcache_count=0"  # before the ranks start


def main() -> None:
    from helpers import rel_err
    from recompute_workers import recompute_worker, run
    from test_recompute import LAYOUTS, _config

    from shardwise.data import shakespeare_files
    from shardwise.launch import spawn
    from shardwise.planner.memory import activation_bytes
    from shardwise.planner.specs import ModelSpec

    tmp = Path(tempfile.mkdtemp())
    corpus = tmp / "text.txt"
    corpus.write_text("".join(f.read_text(encoding="utf-8")
                              for f in shakespeare_files()[:1])[:120_000], encoding="utf-8")
    refs: dict = {}
    for ws in (2, 4):
        names = [n for n, (w, *_) in LAYOUTS.items() if w == ws]
        cfgs = [_config(corpus, tmp / n, *LAYOUTS[n][1:3]) for n in names]
        ranks = spawn(recompute_worker, ws, (cfgs,))
        for i, (name, cfg) in enumerate(zip(names, cfgs)):
            model, one = LAYOUTS[name][1], LAYOUTS[name][3]
            if one and str(model) not in refs:
                refs[str(model)] = run(_config(corpus, tmp / "one", model, {}), measure=False)
            runs = [r[i] for r in ranks]
            err_plain = max(rel_err(s["params"][k], p["params"][k])
                            for p, s in runs for k in p["params"])
            err_one = (max(rel_err(s["params"][k], refs[str(model)]["params"][k])
                           for _, s in runs for k in s["params"]) if one else float("nan"))
            p0, s0 = runs[0]
            calls = f"{len(p0['traffic'][-1])}->{len(s0['traffic'][-1])}"
            sent = (f"{sum(r[3] or 0 for r in p0['traffic'][-1])}->"
                    f"{sum(r[3] or 0 for r in s0['traffic'][-1])}")
            held = ", ".join(f"{p['held']}->{s['held']}" for p, s in runs)
            pred = ""
            par, m = cfg["parallel"], p0["model"]
            if not cfg["model"]["n_experts"]:
                spec = ModelSpec("t", m["n_layer"], m["n_embd"], m["n_head"], m["vocab_size"],
                                 m["block_size"], m["tie_weights"], m["bias"])
                kw = dict(mb=cfg["training"]["global_batch_size"] // par["dp"]
                          // par["micro_batches"], tp=par["tp"], pp=par["pp"],
                          micro_batches=par["micro_batches"], sp=par["sequence_parallel"],
                          precision="fp32", cp=par["cp"], schedule=par["schedule"])
                pred = (f"  predicted {activation_bytes(spec, **kw):.0f}->"
                        f"{activation_bytes(spec, recompute='selective', **kw):.0f}")
            print(f"{name:15s} err_plain {err_plain:.1e} err_one {err_one:.1e} calls {calls} "
                  f"sent {sent} held {held}{pred}", flush=True)


if __name__ == "__main__":
    main()
