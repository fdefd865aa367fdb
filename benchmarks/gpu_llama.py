"""A Llama of about 1B parameters on one GPU: tokens/s and MFU of the engine, and the
torchtitan recipe as the peer (issue 23).

    python benchmarks/gpu_llama.py                       # every row, CUDA
    python benchmarks/gpu_llama.py --rows ours,peer      # a subset
    python benchmarks/gpu_llama.py --steps 3 --warmup 1 --layers 2 --tag smoke

The model is Llama-3.2-1B's shape (Meta's config.json: 16 layers, width 2048, 32 query
heads, 8 key/value heads, SwiGLU width 8192, vocabulary 128,256, tied embeddings, RoPE
theta 500,000), 1.24B parameters, on sequences of 2048 tokens, random weights and random
tokens (only speed is measured). Global batch ``--batch`` sequences in ``--micro-batches``
micro-batches.

Rows (``shardwise.engine.Engine`` at dp = 1, the path `shardwise train` runs):

- ``ours bf16``: bf16 compute, fp32 master weights, fused attention (SDPA), fused AdamW,
  every block compiled (``training.compile``), the loss compiled;
- ``ours bf16 + selective recompute``: the same with ``parallel.recompute = "selective"``
  (matmul and attention outputs kept, element-wise ops recomputed): less memory, some time;
- ``ours fp8 tensorwise`` / ``rowwise``: ``training.precision = "fp8"`` (torchao's float8
  training, ``training.fp8_recipe``), when the GPU and torchao support it;
- ``peer: torchtitan recipe``: what torchtitan's ``train.py`` does on one GPU, reproduced
  here on the same model module: fp32 parameters under bf16 autocast (its
  ``maybe_enable_amp`` when FSDP is off, as it is at dp_shard = 1), ``torch.compile`` of
  each block and of the loss, SDPA, fused AdamW, gradient clipping at 1.0. The package
  itself (``torchtitan`` 0.3.0) is tried first and the reason it cannot run is recorded.

MFU = (6 N + 12 L H D T) x tokens/s / peak (N counted on meta; PaLM appendix B), the peak
the GPU's datasheet dense bf16 figure (``shardwise.perf``), also for the fp8 rows, so that
their speed-up reads directly. Results go to ``benchmarks/gpu_results/<tag>.json``/``.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shardwise.base.topology import Topology  # noqa: E402
from shardwise.engine import Engine, EngineConfig  # noqa: E402
from shardwise.models import describe  # noqa: E402
from shardwise.models.llama import Llama, LlamaConfig  # noqa: E402
from shardwise.perf import peak_flops  # noqa: E402

LLAMA_1B = dict(vocab_size=128256, block_size=2048, n_layer=16, n_head=32, n_kv_heads=8,
                n_embd=2048, ffn_hidden=8192, rope_theta=500000.0, tie_weights=True)
DEVICE = torch.device("cuda", 0)  # the CPU only in the smoke test of this script
ROWS = ("ours", "ours-selective", "ours-fp8-tensorwise", "ours-fp8-rowwise", "peer")


def _time(step, batches, warmup: int, steps: int) -> tuple[float, float]:
    for i in range(warmup):
        loss = step(*batches[i % len(batches)])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step(*batches[i % len(batches)])
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps, float(loss)


def ours(cfg: LlamaConfig, batch: int, micro: int, precision: str,
         recompute: bool | str = False, **extra):
    s = EngineConfig(seq_len=cfg.block_size,
                     parallel={"micro_batches": micro, "recompute": recompute},
                     optimizer={"lr": 3e-4, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1,
                                "grad_clip": 1.0, "fused": True},
                     training={"precision": precision, "seed": 0, "global_batch_size": batch,
                               "compile": True, **extra})
    engine = Engine(cfg, Topology.build(1, 1, 1), s, DEVICE)
    return lambda x, y: engine.train_step(x, y, sync=False)["loss"]


def peer(cfg: LlamaConfig, batch: int, micro: int):
    """torchtitan's single-GPU recipe on the same module (see the module docstring)."""
    torch.manual_seed(0)
    net = Llama(cfg).to(DEVICE)
    for i, block in enumerate(net.blocks):
        net.blocks[i] = torch.compile(block)
    loss_fn = torch.compile(lambda logits, y: F.cross_entropy(logits.flatten(0, 1).float(),
                                                              y.flatten()))
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)

    def step(x, y):
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                h = net.embed(xm)
                for block in net.blocks:
                    h = block(h)
                loss = loss_fn(net.head(h), ym) / micro
            loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach() * micro
    return step


def torchtitan_status() -> str:
    """Whether the torchtitan package imports its Llama 3 trainer here; the reason if not."""
    try:
        import torchtitan  # noqa: F401
        from torchtitan.models import llama3  # noqa: F401
        from torchtitan import train  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        return f"torchtitan does not run here: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return f"torchtitan {getattr(__import__('torchtitan'), '__version__', '?')} imports"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {ROWS}")
    ap.add_argument("--batch", type=int, default=16, help="sequences per optimizer step")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--layers", type=int, default=LLAMA_1B["n_layer"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--tag", default="cuda_llama1b")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu_results"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_llama.py: needs CUDA (torch.cuda.is_available() is false)", file=sys.stderr)
        return 2
    rows_wanted = a.rows.split(",")
    unknown = sorted(set(rows_wanted) - set(ROWS))
    if unknown:
        print(f"gpu_llama.py: --rows: unknown {unknown}; expected some of {ROWS}",
              file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    cfg = LlamaConfig(**{**LLAMA_1B, "n_layer": a.layers})
    with torch.device("meta"):
        meta_model = Llama(cfg)
    n_params = sum(p.numel() for p in meta_model.parameters())
    fpt = describe(cfg).flops_per_token(meta_model, cfg.block_size)
    del meta_model
    peak = peak_flops(dev, torch.bfloat16, tf32=False)
    torch.set_float32_matmul_precision("high")
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        x = torch.randint(0, cfg.vocab_size, (a.batch, cfg.block_size + 1), generator=g)
        batches.append((x[:, :-1].contiguous().to(dev), x[:, 1:].contiguous().to(dev)))
    tokens = a.batch * cfg.block_size
    name = torch.cuda.get_device_name(dev)
    titan = torchtitan_status() if "peer" in rows_wanted else "not tried"
    print(f"{name}, torch {torch.__version__}; Llama {n_params / 1e9:.3f}B ({cfg.n_layer} "
          f"layers); {a.batch} x {cfg.block_size} tokens in {a.micro_batches} micro-batches; "
          f"{fpt / 1e9:.3f} GFLOP/token; peak {peak.flops / 1e12:.0f} TFLOP/s ({peak.source}); "
          f"{titan}", flush=True)
    makers = {
        "ours": ("ours bf16", lambda: ours(cfg, a.batch, a.micro_batches, "bf16")),
        "ours-selective": ("ours bf16 + selective recompute", lambda: ours(
            cfg, a.batch, a.micro_batches, "bf16", recompute="selective")),
        "ours-fp8-tensorwise": ("ours fp8 tensorwise", lambda: ours(
            cfg, a.batch, a.micro_batches, "fp8", fp8_recipe="tensorwise")),
        "ours-fp8-rowwise": ("ours fp8 rowwise", lambda: ours(
            cfg, a.batch, a.micro_batches, "fp8", fp8_recipe="rowwise")),
        "peer": ("peer: torchtitan recipe", lambda: peer(cfg, a.batch, a.micro_batches)),
    }
    rows = []

    def write(rows):
        _write(rows, a, cfg, n_params, fpt, peak, name, titan, argv)

    for key in rows_wanted:
        label, make = makers[key]
        gc.collect()
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        try:
            step = make()
            dt, loss = _time(step, batches, a.warmup, a.steps)
        except Exception as exc:  # noqa: BLE001 - a row that cannot run says why
            traceback.print_exc(limit=3)
            rows.append({"row": label, "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(f"{label}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                  flush=True)
            write(rows)
            continue
        tps = tokens / dt
        mfu = fpt * tps / peak.flops
        mem = torch.cuda.max_memory_allocated(dev) / 2**30
        rows.append({"row": label, "step_s": dt, "tokens_per_s": tps, "mfu": mfu,
                     "loss": loss, "peak_allocated_gib": mem})
        print(f"{label:28s} {dt * 1e3:8.1f} ms/step {tps:10,.0f} tok/s  MFU {100 * mfu:5.1f}%"
              f"  peak {mem:5.1f} GiB  loss {loss:.3f}", flush=True)
        del step
        write(rows)  # after every row: a run cut short keeps what it measured
    print(f"wrote {Path(a.out) / a.tag}.json and .md")
    return 0


def _write(rows, a, cfg, n_params, fpt, peak, name, titan, argv) -> None:
    by = {r["row"]: r for r in rows if "tokens_per_s" in r}
    ratio = (by["ours bf16"]["tokens_per_s"] / by["peer: torchtitan recipe"]["tokens_per_s"]
             if "ours bf16" in by and "peer: torchtitan recipe" in by else None)
    fp8 = max((r for k, r in by.items() if k.startswith("ours fp8")),
              key=lambda r: r["tokens_per_s"], default=None)
    fp8_gain = (fp8["tokens_per_s"] / by["ours bf16"]["tokens_per_s"]
                if fp8 is not None and "ours bf16" in by else None)
    meta = {"device": name, "torch": torch.__version__, "model": {**LLAMA_1B, "n_layer": a.layers},
            "parameters": n_params, "flops_per_token": fpt, "batch": a.batch,
            "micro_batches": a.micro_batches, "steps": a.steps, "warmup": a.warmup,
            "peak_flops": peak.flops, "peak_source": peak.source, "torchtitan": titan,
            "ours_over_peer": ratio, "fp8_over_bf16": fp8_gain,
            "command": "python benchmarks/gpu_llama.py " + " ".join(argv or sys.argv[1:])}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Llama {n_params / 1e9:.2f}B on one {name}, torch {torch.__version__}", "",
             f"`{meta['command']}`", "",
             f"Llama-3.2-1B shape ({cfg.n_layer} layers), {a.batch} sequences of "
             f"{cfg.block_size} tokens per step in {a.micro_batches} micro-batches; "
             f"{a.steps} timed steps after {a.warmup}; MFU against {peak.source} "
             f"({peak.flops / 1e12:.0f} TFLOP/s). Peer: {titan}.", "",
             "| row | ms/step | tokens/s | MFU | peak allocated |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | failed: {r['error'][:100]} | | | |")
        else:
            lines.append(f"| {r['row']} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | "
                         f"{100 * r['mfu']:.1f}% | {r['peak_allocated_gib']:.1f} GiB |")
    if ratio:
        lines += ["", f"ours bf16 / torchtitan recipe: **{ratio:.2f}x**."]
    if fp8_gain:
        lines += [f"best fp8 / bf16: **{fp8_gain:.2f}x**."]
    (out / f"{a.tag}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
