"""Tokens/s and bytes per rank of every feasible layout of one small decoder (a GPT or a
Llama) at a given world size.

For each world size, one spawn of local gloo ranks (1 torch thread each) trains, in turn,
every dp x tp x pp layout whose sizes divide the model (heads, and the Llama's key/value
heads and SwiGLU width, by tp; layers by pp) and the global batch, with ZeRO-0 and ZeRO-1
(and ZeRO-3 where pp = 1), on the same Shakespeare batches: ``--warmup`` untimed steps, then
``--steps`` timed ones. Reports the median step time as tokens/s (global batch x context /
step) and the largest total of bytes any rank holds (``Engine.memory_bytes``: parameters,
gradients, optimizer states). Writes ``OUT/{prefix}layouts_wsN.json``, a table
``OUT/{prefix}layouts.txt`` and a PNG ``OUT/{prefix}layouts.png``, the prefix "" for the GPT
and "llama_" for the Llama.

    python benchmarks/layouts.py --world-size 4 8 --steps 6 --out benchmarks/layout_results
    python benchmarks/layouts.py --world-size --vs-torch 3 --steps 6   # only the torch pair
    python benchmarks/layouts.py --model llama --world-size 4 8 --vs-torch 3 --steps 6

``--model``: ``gpt`` (4 x 128, tied, the default), ``llama`` (4 x 128, GQA with 4 query and
2 key/value heads, SwiGLU width 352, untied, rotary), or both.

``--vs-torch R`` also times dp2 x tp2 x pp2 (1F1B) against PyTorch's own composition of the
same layout (FSDP2 + DTensor TP + ``torch.distributed.pipelining``) on the same untied model,
R alternated repeats in one spawn of 8 ranks; with ``--world-size`` and no sizes only that
pair runs, and its lines go to ``OUT/{prefix}vs_torch.txt``.

On a 2-core machine 8 ranks share 2 cores: the figures rank layouts by what they cost in
compute and messages here, not by what they would do with a core per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "tie_weights": True}
# The Llama: the GPT's depth, width and context; grouped-query attention (2 key/value heads
# for 4 query heads) and SwiGLU at Llama's 8h/3 rule rounded up to 32; untied, as Llama 2.
LLAMA = {"kind": "llama", "n_layer": 4, "n_head": 4, "n_kv_heads": 2, "n_embd": 128,
         "ffn_hidden": 352, "block_size": 64, "tie_weights": False}
MODELS = {"gpt": MODEL, "llama": LLAMA}
PREFIX = {"gpt": "", "llama": "llama_"}  # results files: layouts.txt, llama_layouts.txt
BATCH = 16


def _tp_divides(model: dict) -> list[int]:
    """The sizes tp must divide: heads, and the Llama's key/value heads and SwiGLU width."""
    return [model[k] for k in ("n_head", "n_kv_heads", "ffn_hidden") if k in model]


def layouts(ws: int, model: str = "gpt") -> list[dict]:
    """Every (dp, tp, pp, zero) at world size ``ws`` that the model and batch allow."""
    mdl = MODELS[model]
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if (ws % (tp * pp) or any(n % tp for n in _tp_divides(mdl))
                    or pp > mdl["n_layer"] + 2):
                continue
            dp = ws // (tp * pp)
            m = 2 * pp if pp > 1 else 1
            if BATCH % (dp * m):
                continue
            for zero in ((0, 1, 3) if pp == 1 else (0, 1)):
                out.append({"dp": dp, "tp": tp, "pp": pp, "zero": zero, "micro_batches": m})
    return out


def _config(layout: dict, steps: int, model: str = "gpt") -> dict:
    from shardwise.base.config import Config

    return Config.from_dict({
        "model": MODELS[model], "parallel": dict(layout, schedule="1f1b"),
        "optimizer": {"warmup_steps": 2},
        "training": {"steps": steps, "global_batch_size": BATCH, "eval_every": 0,
                     "progress": False, "sample_chars": 0, "out_dir": "/tmp/shardwise-layouts"},
        "checkpoint": {"at_end": False}}).model_dump()


def worker(configs: list[dict], warmup: int) -> list[dict]:
    from shardwise import comm
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.base.config import Config

    torch.set_num_threads(1)
    out = []
    for c in configs:
        cfg = Config.from_dict(c)
        trainer = build_trainer(cfg)
        times = []
        for i in range(cfg.training.steps):
            comm.barrier()  # every rank starts the step together
            t0 = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - t0)
        mem = trainer.engine.memory_bytes()
        out.append({"step_s": statistics.median(times[warmup:]), "bytes": mem["total"],
                    "loss": trainer.history[-1]})
    return out


def run(ws: int, steps: int, warmup: int, model: str = "gpt") -> list[dict]:
    from shardwise.launch import spawn

    lays = layouts(ws, model)
    configs = [_config(lay, steps + warmup, model) for lay in lays]
    results = spawn(worker, ws, (configs, warmup))
    tokens = BATCH * MODELS[model]["block_size"]
    rows = []
    for i, lay in enumerate(lays):
        step = max(r[i]["step_s"] for r in results)
        rows.append({**lay, "tokens_per_s": tokens / step,
                     "max_bytes_per_rank": max(r[i]["bytes"] for r in results),
                     "loss": results[0][i]["loss"]})
    return rows


VOCAB, M = 65, 4  # the torch comparison: random tokens, 4 micro-batches


def _batches(n: int, model: str = "gpt") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    T = MODELS[model]["block_size"]
    return [torch.randint(0, VOCAB, (BATCH, T), generator=g) for _ in range(n)]


def _untied(model: str):
    """The untied model config of the torch comparison (``GPTConfig`` / ``LlamaConfig``)."""
    from shardwise.models import GPTConfig, LlamaConfig

    sizes = {k: v for k, v in MODELS[model].items() if k != "kind"}
    sizes["tie_weights"] = False
    return (GPTConfig if model == "gpt" else LlamaConfig)(vocab_size=VOCAB, **sizes)


def _build(model: str):
    from shardwise.models import GPT, Llama

    return (GPT if model == "gpt" else Llama)(_untied(model))


# PyTorch's tensor-parallel plan of one block, per model: (module, "col" | "row"), as the
# shardwise plans (GPT: Megatron's; Llama: torchtitan's parallelize_llama), on the blocks
TORCH_TP = {
    "gpt": [("attn.q_proj", "col"), ("attn.k_proj", "col"), ("attn.v_proj", "col"),
            ("attn.out_proj", "row"), ("mlp.fc", "col"), ("mlp.proj", "row")],
    "llama": [("self_attn.q_proj", "col"), ("self_attn.k_proj", "col"),
              ("self_attn.v_proj", "col"), ("self_attn.o_proj", "row"),
              ("mlp.gate_proj", "col"), ("mlp.up_proj", "col"), ("mlp.down_proj", "row")],
}


def _ours_3d(topo, model: str = "gpt"):
    from shardwise.engine import Engine, EngineConfig

    T = MODELS[model]["block_size"]
    engine = Engine(_untied(model), topo, EngineConfig(
        seq_len=T, parallel={"schedule": "1f1b", "micro_batches": M, "zero": 2},
        optimizer={"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.01,
                   "grad_clip": 0.0},
        training={"seed": 0, "global_batch_size": BATCH}))
    share = BATCH // topo.dp

    def step(idx):
        x = idx[topo.dp_rank * share:(topo.dp_rank + 1) * share]
        return engine.train_step(x, (x + 1) % VOCAB)["loss"]  # mean over dp replicas
    return step


def _torch_3d(model: str = "gpt"):
    """PyTorch's own composition of dp2 x tp2 x pp2: ``fully_shard`` (FSDP2, no reshard
    after forward: the ZeRO-2 peer) over dp, ``parallelize_module`` (``TORCH_TP``: Colwise
    Q/K/V and the MLP's input side, Rowwise the outputs) over tp, ``torch.distributed.
    pipelining`` 1F1B over pp, on the same chunks built from the same seed. Each attention
    module views its projections as (B, T, -1, head_dim), so under ColwiseParallel (local
    outputs) it computes on this rank's query heads and, with GQA, its key/value heads."""
    from torch.distributed import pipelining as tpp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from shardwise.parallel.pipeline.partition import balanced, gpt_layers
    from shardwise.parallel.pipeline.stage import gpt_chunks, lm_loss

    torch.manual_seed(0)
    full = _build(model)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    layers = gpt_layers(full)
    chunk = gpt_chunks(full, balanced([1.0] * len(layers), 2), [pp_rank])[pp_rank]
    plan = {}
    for j, name in enumerate(chunk.names):
        if name.startswith("blocks"):
            for sub, style in TORCH_TP[model]:
                plan[f"layers.{j}.{sub}"] = ColwiseParallel() if style == "col" else RowwiseParallel()
    parallelize_module(chunk, mesh["tp"], plan)
    fully_shard(chunk, mesh=mesh["dp"], reshard_after_forward=False)
    stage = tpp.PipelineStage(chunk, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    sched = tpp.Schedule1F1B(stage, M, loss_fn=lm_loss)
    opt = torch.optim.AdamW(chunk.parameters(), lr=1e-3, foreach=False)
    share = BATCH // 2

    def step(idx):
        x = idx[dp_rank * share:(dp_rank + 1) * share]
        losses: list = []
        if pp_rank == 0:
            sched.step(x)
        else:
            sched.step(target=(x + 1) % VOCAB, losses=losses)
        opt.step()
        opt.zero_grad()
        return float(sum(v.detach() for v in losses) / M) if losses else 0.0  # this replica's
    step.dp_group = mesh["dp"].get_group()
    return step


def torch_worker(repeats: int, steps: int, warmup: int, model: str = "gpt") -> dict:
    from shardwise import comm
    from shardwise.base.topology import Topology, init_process_groups

    torch.set_num_threads(1)
    topo = init_process_groups(Topology.build(2, 2, 2, rank=dist.get_rank(),
                                              world_size=dist.get_world_size()))
    data = _batches(warmup + steps, model)
    T = MODELS[model]["block_size"]
    out: dict = {"ours": [], "torch": [], "loss_ours": [], "loss_torch": []}
    for r in range(repeats):
        for kind in (("ours", "torch") if r % 2 == 0 else ("torch", "ours")):
            step = _ours_3d(topo, model) if kind == "ours" else _torch_3d(model)
            losses = [step(data[i]) for i in range(warmup)]
            comm.barrier()
            t0 = time.perf_counter()
            losses += [step(data[warmup + i]) for i in range(steps)]
            comm.barrier()
            out[kind].append(BATCH * T * steps / (time.perf_counter() - t0))
            if kind == "torch":  # the mean over dp replicas, as ours reports (untimed)
                t = torch.tensor(losses, dtype=torch.float64)
                dist.all_reduce(t, group=step.dp_group)
                losses = (t / 2).tolist()
            out[f"loss_{kind}"].append(losses)  # every step's, warm-up included
    return out


def vs_torch(repeats: int, steps: int, warmup: int, model: str = "gpt") -> list[str]:
    from shardwise.launch import spawn

    load = os.getloadavg()[0]
    res = spawn(torch_worker, 8, (repeats, steps, warmup, model))
    ours = [min(r["ours"][i] for r in res) for i in range(repeats)]   # the slowest rank
    theirs = [min(r["torch"][i] for r in res) for i in range(repeats)]
    last = res[2]  # global rank 2: dp 0, pp 1 (the last stage) in both rank orders
    o, t = statistics.median(ours), statistics.median(theirs)
    what = "GPT" if model == "gpt" else "Llama (GQA 4/2 heads, SwiGLU)"
    return [(f"dp2 x tp2 x pp2 (1F1B, m={M}), untied {what}, random tokens, {repeats} "
             f"alternated repeats of {steps} steps after {warmup}; load average before: "
             f"{load:.2f}:"),
            f"  shardwise (ZeRO-2)          {o:9.0f} tokens/s  runs {[round(v) for v in ours]}",
            f"  torch FSDP2 + TP + pipelining {t:7.0f} tokens/s  runs {[round(v) for v in theirs]}",
            (f"  ratio ours/torch = {o / t:.3f} (medians), "
             f"{statistics.median(a / b for a, b in zip(ours, theirs)):.3f} (median of pairs); "
             f"loss (mean over dp) at the first step: ours {last['loss_ours'][0][0]:.5f}, "
             f"torch {last['loss_torch'][0][0]:.5f}; at the last: ours "
             f"{last['loss_ours'][0][-1]:.5f}, torch {last['loss_torch'][0][-1]:.5f}")]


def _name(r: dict) -> str:
    return f"dp{r['dp']} tp{r['tp']} pp{r['pp']} z{r['zero']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["gpt"],
                    help="the model(s) to sweep: gpt (the default), llama, or both")
    ap.add_argument("--world-size", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "layout_results"))
    ap.add_argument("--vs-torch", type=int, default=0, metavar="REPEATS",
                    help="also time dp2 x tp2 x pp2 against PyTorch's composition")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for model in a.model:
        sweep(model, a, out)


def _title(model: str) -> str:
    m = MODELS[model]
    if model == "gpt":
        return f"GPT {m['n_layer']} x {m['n_embd']}"
    return (f"Llama {m['n_layer']} x {m['n_embd']} (heads {m['n_head']}, kv heads "
            f"{m['n_kv_heads']}, SwiGLU {m['ffn_hidden']}, untied)")


def sweep(model: str, a: argparse.Namespace, out: Path) -> None:
    """The layout sweep of ``model`` and, with ``--vs-torch``, its torch comparison."""
    prefix = PREFIX[model]
    lines = [(f"{_title(model)}, context {MODELS[model]['block_size']}, "
              f"global batch {BATCH}; {os.cpu_count()} cores, gloo, 1 thread per rank, "
              f"torch {torch.__version__}; median of {a.steps} steps after {a.warmup}; "
              f"load average before: {os.getloadavg()[0]:.2f}")]
    if a.world_size:
        lines.append(f"{'ws':>3} {'layout':<20} {'m':>3} {'tokens/s':>9} {'MiB/rank':>9}")
    all_rows = {}
    for ws in a.world_size:
        rows = run(ws, a.steps, a.warmup, model)
        all_rows[ws] = rows
        (out / f"{prefix}layouts_ws{ws}.json").write_text(json.dumps(rows, indent=1))
        for r in sorted(rows, key=lambda r: -r["tokens_per_s"]):
            lines.append(f"{ws:>3} {_name(r):<20} {r['micro_batches']:>3} "
                         f"{r['tokens_per_s']:>9.0f} {r['max_bytes_per_rank'] / 2**20:>9.2f}")
    if a.vs_torch:
        lines += [""] + vs_torch(a.vs_torch, a.steps, a.warmup, model)
    name = "layouts.txt" if all_rows else "vs_torch.txt"
    (out / f"{prefix}{name}").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if all_rows:
        _plot(all_rows, out / f"{prefix}layouts.png", lines[0])


def _plot(all_rows: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_rows), figsize=(6 * len(all_rows), 5), squeeze=False)
    for ax, (ws, rows) in zip(axes[0], all_rows.items()):
        for z, marker in ((0, "o"), (1, "s"), (3, "^")):
            pts = [r for r in rows if r["zero"] == z]
            ax.scatter([r["max_bytes_per_rank"] / 2**20 for r in pts],
                       [r["tokens_per_s"] for r in pts], marker=marker, label=f"ZeRO-{z}")
            for r in pts:
                ax.annotate(f"{r['dp']}x{r['tp']}x{r['pp']}",
                            (r["max_bytes_per_rank"] / 2**20, r["tokens_per_s"]), fontsize=7)
        ax.set_xlabel("largest bytes held by a rank (MiB)")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"world size {ws} (labels: dp x tp x pp)")
        ax.legend()
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
