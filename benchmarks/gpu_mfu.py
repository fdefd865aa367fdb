"""Single-device speed of the engine: tokens/s and MFU, one optimisation at a time, and a
nanoGPT-style training loop as the peer.

    python benchmarks/gpu_mfu.py                 # CUDA if present, else the CPU
    python benchmarks/gpu_mfu.py --device cpu    # the `make run` GPT on this machine's CPU

CUDA: GPT-2 small (124M: 12 layers, 768 wide, 12 heads, context 1024, vocabulary 50,304) in
bf16, 2 micro-batches of 16 sequences per optimizer step (64k tokens). CPU: the `make run` GPT
(configs/shakespeare.toml: 4 x 128, context 128, vocabulary 65) in fp32, 32 sequences per
step, the rank's torch threads set to every core.

Rows, each adding one switch to the one above (``shardwise.engine.Engine`` at dp = 1, the
path `shardwise train` runs):

1. baseline: attention written out (``model.attention = "math"``), AdamW as a loop over
   tensors, no TF32, eager;
2. + fused attention (``scaled_dot_product_attention``: FlashAttention on CUDA);
3. + fused AdamW (``optimizer.fused``);
4. + TF32 for fp32 matmuls (``training.tf32``; under bf16 only the fp32 leftovers use it);
5. + ``torch.compile`` of each block (``training.compile``).

On CUDA one more row: everything on with ``training.precision = "fp8"`` (torchao float8,
tensorwise scaling; MFU still against the bf16 peak).

The peer is nanoGPT's loop (Karpathy, github.com/karpathy/nanoGPT, train.py/model.py) written
here from its description: fused Q/K/V projection, fp32 parameters under bf16 autocast,
FlashAttention, fused AdamW, ``torch.compile`` of the whole model, TF32 on, gradient clipping.
Both see the same random tokens. MFU = (6 N + 12 L C T) x tokens/s / peak
(``shardwise.perf``; Chowdhery et al. 2022, appendix B); the peak is the GPU's datasheet dense
bf16 figure, or on the CPU the measured 1024^3 matmul (``perf.cpu_peak``).

Results go to ``benchmarks/gpu_results/<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shardwise.base.topology import Topology  # noqa: E402
from shardwise.engine import Engine, EngineConfig  # noqa: E402
from shardwise.models import GPTConfig  # noqa: E402
from shardwise.perf import cpu_peak, flops_per_token, peak_flops  # noqa: E402

GPT2_SMALL = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
MAKE_RUN = dict(vocab_size=65, block_size=128, n_layer=4, n_head=4, n_embd=128)
STEPS = [  # (label, attention, fused AdamW, tf32, compile): each adds one switch
    ("baseline", "math", False, False, False),
    ("+ fused attention", "sdpa", False, False, False),
    ("+ fused AdamW", "sdpa", True, False, False),
    ("+ TF32", "sdpa", True, True, False),
    ("+ compile", "sdpa", True, True, True),
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _time(step, batches, warmup: int, steps: int, device: torch.device) -> tuple[float, float]:
    """Seconds per step over ``steps`` timed steps after ``warmup`` (compilation, kernel
    choice), and the last loss. The loop reads nothing back inside the timed steps."""
    for i in range(warmup):
        loss = step(*batches[i % len(batches)])
    _sync(device)
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step(*batches[i % len(batches)])
    _sync(device)
    dt = (time.perf_counter() - t0) / steps
    return dt, float(loss)


def ours(model: dict, attention: str, fused: bool, tf32: bool, compile_: bool, precision: str,
         batch: int, micro: int, device: torch.device, **extra):
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    cfg = GPTConfig(**model, attention=attention)
    s = EngineConfig(seq_len=model["block_size"], parallel={"micro_batches": micro},
                     optimizer={"lr": 6e-4, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1,
                                "grad_clip": 1.0, "fused": fused},
                     training={"precision": precision, "seed": 0, "global_batch_size": batch,
                               "compile": compile_, **extra})
    engine = Engine(cfg, Topology.build(1, 1, 1), s, device)
    return lambda x, y: engine.train_step(x, y, sync=False)["loss"]


# -- the peer: nanoGPT's model and loop ---------------------------------------------------
class _PeerBlock(nn.Module):
    def __init__(self, c: int, h: int):
        super().__init__()
        self.h = h
        self.ln_1, self.ln_2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.c_attn, self.c_proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.c_fc, self.mlp_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class _PeerGPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(_PeerBlock(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def peer(model: dict, precision: str, batch: int, micro: int, device: torch.device):
    torch.set_float32_matmul_precision("high")
    torch.manual_seed(0)
    net = _PeerGPT(**model).to(device)
    decay = [p for p in net.parameters() if p.dim() >= 2]
    other = [p for p in net.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}], lr=6e-4,
                            betas=(0.9, 0.95), fused=device.type == "cuda")
    cnet = torch.compile(net)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def step(x, y):
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            with torch.autocast(device.type, dtype=dtype, enabled=precision == "bf16"):
                loss = cnet(xm, ym) / micro
            loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach() * micro
    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per row")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled rows")
    ap.add_argument("--last-only", action="store_true", help="only the last row (everything "
                    "on) and the peer, skipping the one-switch-at-a-time rows")
    ap.add_argument("--batch", type=int, default=None, help="sequences per optimizer step")
    ap.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step")
    ap.add_argument("--tag", default=None, help="results file name (default: cuda / cpu)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu_results"))
    a = ap.parse_args(argv)
    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    model, precision, batch, micro = ((GPT2_SMALL, "bf16", 32, 2) if cuda
                                      else (MAKE_RUN, "fp32", 32, 1))
    batch, micro = a.batch or batch, a.micro_batches or micro
    steps = a.steps or (20 if cuda else 30)
    warmup = a.warmup or (5 if cuda else 5)
    if not cuda:
        torch.set_num_threads(max(1, len(__import__("os").sched_getaffinity(0))))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if not cuda:  # measure the CPU's matmul again (the cache keeps the highest reading)
        cpu_peak(dtype, refresh=True, seconds=3.0)
    peak = peak_flops(device, dtype, tf32=False)
    fpt = flops_per_token(GPTConfig(**model))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        x = torch.randint(0, model["vocab_size"], (batch, model["block_size"] + 1), generator=g)
        batches.append((x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)))
    tokens = batch * model["block_size"]
    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu"
    print(f"{name}, torch {torch.__version__}, {precision}, {torch.get_num_threads()} threads; "
          f"model {model}, {batch} sequences x {micro} micro-batch(es) per step; "
          f"{fpt / 1e6:.2f} MFLOP/token; peak {peak.flops / 1e9 if peak.flops else float('nan'):,.0f} "
          f"GFLOP/s ({peak.source})", flush=True)
    rows = []
    runs = [(label, precision, peak, lambda v=v: ours(model, *v, precision, batch, micro, device))
            for label, *v in (STEPS[-1:] if a.last_only else STEPS)]
    runs.append(("peer: nanoGPT loop (compiled)", precision, peak,
                 lambda: peer(model, precision, batch, micro, device)))
    if cuda and precision == "bf16":  # training.precision = "fp8" (torchao), against the bf16 peak
        runs.append(("all on, fp8 tensorwise", "fp8", peak,
                     lambda: ours(model, "sdpa", True, True, True, "fp8", batch, micro, device,
                                  fp8_recipe="tensorwise")))
    if cuda and not a.last_only:  # TF32's own effect: everything on, fp32 compute, against the fp32 / TF32 peak
        for tf32 in (False, True):
            runs.append((f"fp32, all on, TF32 {'on' if tf32 else 'off'}", "fp32",
                         peak_flops(device, torch.float32, tf32),
                         lambda t=tf32: ours(model, "sdpa", True, t, True, "fp32", batch, micro,
                                             device)))
    for label, prec, row_peak, make in runs:
        if a.no_compile and ("compile" in label):
            continue
        _reset(device)
        try:
            step = make()
            dt, loss = _time(step, batches, warmup, steps, device)
        except Exception as exc:  # a row that cannot run says why; the others still run
            print(f"{label}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
            rows.append({"row": label, "precision": prec, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        tps = tokens / dt
        mfu = fpt * tps / row_peak.flops if row_peak.flops else None
        rows.append({"row": label, "precision": prec, "step_s": dt, "tokens_per_s": tps,
                     "mfu": mfu, "peak": row_peak.source, "loss": loss})
        print(f"{label:32s} {dt * 1e3:9.1f} ms/step {tps:12,.0f} tok/s  MFU "
              f"{100 * mfu if mfu else float('nan'):5.1f}%  loss {loss:.3f}", flush=True)
        del step
    best = max((r for r in rows if "tokens_per_s" in r and r["precision"] == precision
                and not r["row"].startswith("peer")),
               key=lambda r: r["tokens_per_s"], default=None)
    peer_row = next((r for r in rows if r["row"].startswith("peer") and "tokens_per_s" in r), None)
    ratio = best["tokens_per_s"] / peer_row["tokens_per_s"] if best and peer_row else None
    if ratio:
        print(f"ours (best row) / peer: {ratio:.2f}x", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": name, "torch": torch.__version__, "precision": precision,
            "threads": torch.get_num_threads(), "model": model, "batch": batch,
            "micro_batches": micro, "steps": steps, "warmup": warmup,
            "flops_per_token": fpt, "peak_flops": peak.flops, "peak_source": peak.source,
            "ours_over_peer": ratio}
    tag = a.tag or ("cuda" if cuda else "cpu")
    (out / f"{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# {name}: {precision}, torch {torch.__version__}, {torch.get_num_threads()} threads",
             "", f"Model {model}; {batch} sequences in {micro} micro-batch(es) per step; "
             f"{steps} timed steps after {warmup}; peak {peak.source}.", "",
             "| row | precision | ms/step | tokens/s | MFU | peak |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | | failed: {r['error'][:80]} | | | |")
        else:
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
            lines.append(f"| {r['row']} | {r['precision']} | {r['step_s'] * 1e3:.1f} | "
                         f"{r['tokens_per_s']:,.0f} | {mfu} | {r['peak']} |")
    if ratio:
        lines += ["", f"Best shardwise row / peer: **{ratio:.2f}x**."]
    (out / f"{tag}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / tag}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
