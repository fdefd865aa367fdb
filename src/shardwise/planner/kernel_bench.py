"""Measure the kernels the planner prices on this device (``shardwise bench calibrate``): a
kernel profile (format: ``planner.kernels``).

Sections, each timed on the chosen device (CUDA: CUDA events around ``inner`` back-to-back
calls after a warm-up, the median of the repeats; CPU: ``time.perf_counter``):

- ``gemm``: the (tokens x in) @ (in x out) GEMMs of one of the model's blocks as
  ``compute.block_ops`` prices them (``block_gemm_shapes``: Q K V, output projection, MLP;
  column-parallel outputs and row-parallel inputs divided by tp), at a few micro-batches and
  tp sizes; FLOP/s, and the efficiency against the datasheet peak where ``perf.gpus`` knows
  the GPU (None on a CPU);
- ``attention``: ``F.scaled_dot_product_attention``, causal, forward and backward, at a few
  sequence lengths, per SDPA backend the device runs (the others listed as unavailable);
- ``memory``: an element-wise add (reads two, writes one) at a few sizes, bytes/s;
- ``optimizer``: AdamW over the block's parameters as the engine builds it
  (``engine.optimizer``: ``fused=True`` on CUDA, ``foreach=False`` on the CPU), fp32
  masters, seconds per parameter;
- ``collectives``: not measured here: the comm profile in use (``comm.cost``), which
  ``shardwise bench comm --calibrate`` measures.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
import warnings

from shardwise.perf.gpus import gpu_peak
from shardwise.planner.kernels import FORMAT, PEAK_KIND
from shardwise.planner.specs import ModelSpec

DTYPES = tuple(PEAK_KIND)
MICRO_BATCHES, QUICK_MICRO_BATCHES = (1, 2, 4, 8), (1,)
TP_SIZES, QUICK_TP_SIZES = (1, 2, 4, 8), (1, 2)
MEMORY_MB, QUICK_MEMORY_MB = (0.25, 1, 10, 100, 400), (0.25, 4)
SDPA_BACKENDS = ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def block_gemm_shapes(spec: ModelSpec, tokens: int, tp: int = 1) -> list[tuple[str, int, int,
                                                                               int]]:
    """One block's linear-layer GEMMs on a tp rank as ``(name, tokens, in, out)``: the shapes
    whose FLOPs 2 T in out are ``compute.block_ops``' gemms but the attention core's
    (``gemms[1:3]``, timed as attention) for a dense block; with experts, the MLP rows are
    one expert's, on its T k / E tokens at ep = 1 (balanced routing, as ``block_ops``);
    MLA's attention as its dense equivalent, Q K V h -> H D + 2 k. Column-parallel layers
    split their outputs by ``tp``, row-parallel ones their inputs."""
    h, att = spec.n_embd, spec.attn_width
    k = spec.kv_heads * (att // spec.n_head)
    f, t = spec.ffn, tokens
    if spec.moe:
        f, t = spec.expert_ffn, max(1, tokens * spec.top_k // spec.n_experts)
    rows = [("qkv", tokens, h, (att + 2 * k) // tp), ("attn_out", tokens, att // tp, h)]
    rows += [("mlp_in", t, h, f // tp)] * (2 if spec.gated else 1)
    rows += [("mlp_out", t, f // tp, h)]
    return rows


def device_name(device: str) -> str:
    """The GPU's name (``torch.cuda.get_device_name``) or the CPU's model (/proc/cpuinfo's
    "model name", else ``platform``)."""
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


class Timer:
    """Median seconds per call of a function on ``device`` (see the module docstring)."""

    def __init__(self, device: str, repeats: int, warmup: int):
        import torch

        self.cuda = device == "cuda"
        self.repeats, self.warmup = repeats, warmup
        self.torch = torch

    def __call__(self, fn, inner: int = 1) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            if self.cuda:
                start = self.torch.cuda.Event(enable_timing=True)
                end = self.torch.cuda.Event(enable_timing=True)
                self.torch.cuda.synchronize()
                start.record()
                for _ in range(inner):
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / inner)
            else:
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                times.append((time.perf_counter() - t0) / inner)
        return statistics.median(times)


def measure(spec: ModelSpec, device: str = "cpu", dtype: str = "fp32",
            quick: bool = False) -> dict:
    """The kernel profile of ``spec``'s block on ``device`` in ``dtype`` (``DTYPES``), as a
    JSON-ready dict (``planner.kernels`` reads it). ``quick``: fewer shapes and repeats."""
    import torch

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    dev = torch.device(device)
    name = device_name(device)
    peak = gpu_peak(name, PEAK_KIND[dtype]) if device == "cuda" else None
    timer = Timer(device, repeats=2 if quick else 5, warmup=1 if quick else 3)
    inner = 10 if device == "cuda" else 1
    s = spec.block_size
    gemm = []
    seen = set()
    for mb in QUICK_MICRO_BATCHES if quick else MICRO_BATCHES:
        for tp in QUICK_TP_SIZES if quick else TP_SIZES:
            for op, T, n_in, n_out in block_gemm_shapes(spec, mb * s, tp):
                if (T, n_in, n_out) in seen or min(n_in, n_out) < 1:
                    continue
                seen.add((T, n_in, n_out))
                x = torch.randn(T, n_in, device=dev, dtype=dt)
                w = torch.randn(n_in, n_out, device=dev, dtype=dt)
                sec = timer(lambda: torch.matmul(x, w), inner)
                flops = 2.0 * T * n_in * n_out
                rate = flops / sec
                gemm.append({"op": op, "micro_batch": mb, "tp": tp, "tokens": T, "in": n_in,
                             "out": n_out, "flops": flops, "seconds": sec, "flops_per_s": rate,
                             "efficiency": rate / peak.flops if peak and peak.flops else None})
    attention, unavailable = _attention(spec, dev, dt, timer, inner, quick)
    memory = []
    for mb in QUICK_MEMORY_MB if quick else MEMORY_MB:
        e = torch.empty((), dtype=dt).element_size()
        n = max(1, int(mb * 1e6 / (3 * e)))
        a, b, c = (torch.randn(n, device=dev, dtype=dt) for _ in range(3))
        sec = timer(lambda: torch.add(a, b, out=c), inner)
        memory.append({"op": "add", "elements": n, "bytes": 3 * n * e, "seconds": sec,
                       "bytes_per_s": 3 * n * e / sec})
    return {"format": FORMAT, "device": name, "device_type": device, "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dtype": dtype, "model": spec.name, "quick": quick,
            "peak_flops": peak.flops if peak else None,
            "peak_source": peak.source if peak else "no datasheet peak for a CPU",
            **_host(),
            "units": {"seconds": "s", "flops_per_s": "FLOP/s", "bytes_per_s": "bytes/s",
                      "bytes": "bytes read and written", "efficiency": "of peak_flops"},
            "gemm": gemm, "attention": attention, "attention_unavailable": unavailable,
            "memory": memory, "optimizer": _optimizer(spec, dev, timer),
            "collectives": _collectives()}


def _attention(spec: ModelSpec, dev, dt, timer: Timer, inner: int,
               quick: bool) -> tuple[list, dict]:
    """SDPA forward and backward (causal, one sequence, the model's heads and head size) at
    a few lengths per backend; FLOPs as the planner prices them (4 s^2 H D forward: the
    triangle counted whole, ``compute.attention_keys``)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    a, d = spec.n_head, spec.attn_width // spec.n_head
    s = spec.block_size
    lengths = (s,) if quick else sorted({max(16, s // 4), max(16, s // 2), s, 2 * s})
    rows, unavailable = [], {}
    for backend in SDPA_BACKENDS:
        for n in lengths:
            q, k, v = (torch.randn(1, a, n, d, device=dev, dtype=dt, requires_grad=True)
                       for _ in range(3))
            try:
                with sdpa_kernel(getattr(SDPBackend, backend)), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    g = torch.randn_like(out)
                    fwd = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                inner)
                    bwd = timer(lambda: out.backward(g, retain_graph=True), inner)
            except RuntimeError as exc:  # no such kernel here, or out of memory (the math
                # path writes the s x s scores): this length and longer ones not timed
                first = (str(exc).strip().splitlines() or ["RuntimeError"])[0][:200]
                unavailable[backend.lower()] = f"seq {n}: {first}"
                del q, k, v
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                break
            flops = 4.0 * n * n * a * d
            rows.append({"kernel": backend.lower(), "seq": n, "batch": 1, "heads": a,
                         "head_dim": d, "causal": True, "forward_s": fwd, "backward_s": bwd,
                         "forward_flops": flops, "forward_flops_per_s": flops / fwd,
                         "backward_over_forward": bwd / fwd})
    return rows, unavailable


def _optimizer(spec: ModelSpec, dev, timer: Timer) -> dict:
    """AdamW over fp32 copies of one block's weights (tp = 1) and its vectors, as the
    engine builds it (``engine.optimizer.build_adamw``) with the kernel it picks for the
    device (fused on CUDA, else the loop, ``foreach=False``)."""
    import torch

    from shardwise.engine.optimizer import build_adamw

    shapes = [(n_in, n_out) for _, _, n_in, n_out in block_gemm_shapes(spec, 1)]
    shapes += [(spec.n_embd,)] * 4
    params = [torch.nn.Parameter(torch.randn(*sh, device=dev) * 0.02) for sh in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    fused = dev.type == "cuda"
    opt = build_adamw(params, [p.dim() >= 2 for p in params], lr=1e-4, fused=fused)
    n = sum(p.numel() for p in params)
    sec = timer(opt.step)
    return {"kernel": "fused" if fused else "foreach=False", "params": n,
            "seconds": sec, "seconds_per_param": sec / n}


def _host() -> dict:
    """Where the profile is measured: ``comm.cost.host_meta``'s host, machine, cores and
    Python, as a comm profile records them."""
    from shardwise.comm.cost import host_meta

    return host_meta()


def _collectives() -> dict:
    """The comm profile collectives are priced with (``comm.cost.active_profile``, which
    picks it: ``use_profile``'s, $SHARDWISE_COMM_PROFILE, the repository's when measured on
    this host, else the built-in): not re-measured here; ``shardwise bench comm
    --calibrate`` measures it."""
    from shardwise.comm import cost

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = cost.active_profile()
    return {"measured_by": "shardwise bench comm --calibrate", "name": prof.name,
            "backend": prof.meta.get("backend"), "device": prof.meta.get("device"),
            "host": prof.meta.get("host")}
