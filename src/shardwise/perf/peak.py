"""Peak FLOP/s of the device a rank computes on: the denominator of MFU.

GPUs: dense (no 2:4 sparsity) tensor-core peaks from NVIDIA's datasheets, per dtype:
``bf16`` (also fp16), ``tf32`` (fp32 matmuls with ``training.tf32``) and ``fp32`` (CUDA
cores). Datasheets quote the sparse figure for bf16/tf32; the dense one is half of it.

- H100 SXM5 and H200 SXM: 989.4 bf16, 494.7 tf32, 66.9 fp32 TFLOP/s (NVIDIA H100 Tensor Core
  GPU datasheet, 2023; NVIDIA H200 datasheet, 2024);
- H100 PCIe: 756.5 bf16, 378 tf32, 51.2 fp32 (the same H100 datasheet);
- A100 40 GB / 80 GB (SXM4 and PCIe): 312 bf16, 156 tf32, 19.5 fp32 (NVIDIA A100 datasheet,
  2021);
- L40S: 362.05 bf16, 183 tf32, 91.6 fp32 (NVIDIA L40S datasheet, 2023).

CPUs have no table: ``cpu_peak`` times a square matmul in the compute dtype with the rank's
torch threads and caches the result per (CPU model, threads, dtype, torch version) in
``$XDG_CACHE_HOME/shardwise/peak.json`` (``~/.cache`` by default), so MFU on the CPU means
"of what this machine's matmul reaches". The cache keeps the highest measurement, and
every training run and ``benchmarks/gpu_mfu.py --device cpu`` measure again, so a reading
taken while other processes held the cores does not stand.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

TFLOPS = 1e12

# name fragment (matched against torch.cuda.get_device_name, first match wins) -> peaks
GPU_PEAKS: list[tuple[tuple[str, ...], str, dict[str, float]]] = [
    (("H100", "PCIE"), "H100 PCIe", {"bf16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (("H100",), "H100 SXM", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (("H200",), "H200 SXM", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (("A100",), "A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (("L40S",), "L40S", {"bf16": 362.05, "tf32": 183.0, "fp32": 91.6}),
]


@dataclass(frozen=True)
class Peak:
    """``flops``: peak FLOP/s (None: unknown, MFU not reported); ``source``: where it came from."""

    flops: float | None
    source: str


def peak_kind(dtype: torch.dtype, tf32: bool) -> str:
    """The row of the table a run uses: bf16 (and fp16), tf32 or fp32."""
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    return "tf32" if tf32 else "fp32"


def gpu_peak(name: str, kind: str) -> Peak:
    """The table's peak for a GPU called ``name`` (``torch.cuda.get_device_name``)."""
    upper = name.upper()
    for fragments, label, peaks in GPU_PEAKS:
        if all(f in upper for f in fragments):
            return Peak(peaks[kind] * TFLOPS, f"{label} {kind} datasheet peak")
    return Peak(None, f"{name!r} is not in the table of known GPUs (set training.peak_tflops)")


def peak_flops(device: torch.device, dtype: torch.dtype, tf32: bool = True,
               override_tflops: float | None = None) -> Peak:
    """Peak FLOP/s of one rank on ``device`` computing in ``dtype``: ``override_tflops``
    (``training.peak_tflops``) if given, the table on CUDA, ``cpu_peak`` on the CPU."""
    if override_tflops is not None:
        return Peak(override_tflops * TFLOPS, "training.peak_tflops")
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), peak_kind(dtype, tf32))
    if device.type == "cpu":
        return cpu_peak(dtype)
    return Peak(None, f"no peak known for device {device.type!r}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "shardwise" / "peak.json"


def measure_matmul(dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 0.3,
                   device: torch.device | str = "cpu") -> float:
    """Best FLOP/s of ``n x n @ n x n`` products in ``dtype`` over three timed rounds of at
    least ``seconds`` / 3 each (2 n^3 FLOPs per product), with the current torch threads."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b  # warm-up: thread pool, kernel choice
    best = 0.0
    for _ in range(3):
        reps, t0 = 0, time.perf_counter()
        while True:
            a @ b
            reps += 1
            dt = time.perf_counter() - t0
            if dt >= seconds / 3:
                break
        best = max(best, 2.0 * n ** 3 * reps / dt)
    return best


def cpu_peak(dtype: torch.dtype = torch.float32, refresh: bool = False,
             seconds: float = 0.3) -> Peak:
    """This CPU's matmul FLOP/s with ``torch.get_num_threads()`` threads in ``dtype``:
    measured once by ``measure_matmul`` and cached (see module docstring). ``refresh``:
    measure again (``seconds`` long); the cache keeps the highest measurement, since a probe
    that competed with other processes for the cores reads low."""
    threads = torch.get_num_threads()
    key = f"{_cpu_name()}|threads={threads}|{str(dtype).removeprefix('torch.')}|torch={torch.__version__}"
    path = _cache_path()
    cache: dict = {}
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if not isinstance(cache, dict):
        cache = {}
    value = cache.get(key)
    known = isinstance(value, (int, float)) and value > 0
    if refresh or not known:
        measured = measure_matmul(dtype, seconds=seconds)
        # a probe that shared its cores with other work reads low: the highest one stands
        value = max(measured, value) if known else measured
        cache[key] = value
        try:  # atomic: ranks probing at once never leave half a file
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home: measured again next time
    return Peak(float(value), f"1024^3 matmul probe, {threads} thread(s), "
                f"{str(dtype).removeprefix('torch.')}")
