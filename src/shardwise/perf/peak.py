"""Peak FLOP/s of the device a rank computes on: the denominator of MFU.

GPUs: the datasheet table of ``perf.gpus`` (``gpu_peak``), which imports no torch.

CPUs have no table: a square matmul in fp32, timed with the rank's torch threads (at most
~0.5 s, ``measure_matmul``), is the peak, cached per (CPU model, threads, dtype, torch
version) in ``$XDG_CACHE_HOME/shardwise/peak.json`` (``~/.cache`` when XDG_CACHE_HOME is
unset or not absolute; never in the repository), so MFU on the CPU means "of what this
machine's matmul reaches" and a run probes at most once per machine. bf16 and fp16 are never
probed at a run's start: without AMX/AVX512-BF16 a reduced-precision CPU matmul can run at
0.5 GFLOP/s, so its probe takes 10-18 s and reads so low that MFU looks like 60%. A run in
those dtypes states MFU only against a peak already cached for its dtype (``cpu_peak(dtype,
refresh=True)``; ``benchmarks/gpu_mfu.py --device cpu`` takes one), else none (``mfu=n/a``).
The cache keeps the highest measurement, since a probe that shared its cores reads low.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from shardwise.base.files import write_text
from shardwise.perf.gpus import GPU_PEAKS, TFLOPS, Peak, gpu_peak  # noqa: F401 (as before)


def peak_kind(dtype: torch.dtype, tf32: bool) -> str:
    """The row of the table a run uses: bf16 (and fp16), tf32 or fp32."""
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    return "tf32" if tf32 else "fp32"


def peak_flops(device: torch.device, dtype: torch.dtype, tf32: bool = True,
               override_tflops: float | None = None) -> Peak:
    """Peak FLOP/s of one rank on ``device`` computing in ``dtype``; ``Peak.flops`` is None
    when unknown (then no MFU is reported). In order: ``override_tflops``
    (``training.peak_tflops``, TFLOP/s) if given; the datasheet table on CUDA; on the CPU
    in fp32, ``cpu_peak`` (cached, else one probe of at most ~0.5 s); on the CPU in bf16 or
    fp16, the peak cached for that dtype, never a probe (see the module docstring). Never
    raises for an unknown device or dtype: it returns ``Peak(None, why)``."""
    if override_tflops is not None:
        return Peak(override_tflops * TFLOPS, "training.peak_tflops")
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), peak_kind(dtype, tf32))
    if device.type == "cpu":
        if dtype == torch.float32:
            return cpu_peak(torch.float32)
        cached = cached_cpu_peak(dtype)
        if cached is not None:
            return cached
        name = str(dtype).removeprefix("torch.")
        return Peak(None, f"no measured {name} peak for this CPU (a CPU is probed in float32 "
                    f"only; cpu_peak(torch.{name}, refresh=True) or training.peak_tflops "
                    "gives one)")
    return Peak(None, f"no peak known for device {device.type!r}")


def cpu_name() -> str:
    """This machine's CPU model (``/proc/cpuinfo``'s "model name"), else what ``platform``
    says: for benchmark tables and the peak cache's key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(root):  # the XDG spec: a relative path is invalid, ignore it
        root = str(Path.home() / ".cache")
    return Path(root) / "shardwise" / "peak.json"


def _cache_key(dtype: torch.dtype) -> str:
    return (f"{cpu_name()}|threads={torch.get_num_threads()}|"
            f"{str(dtype).removeprefix('torch.')}|torch={torch.__version__}")


def _read_cache() -> dict:
    try:
        cache = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _source(dtype: torch.dtype) -> str:
    return (f"matmul probe, {torch.get_num_threads()} thread(s), "
            f"{str(dtype).removeprefix('torch.')}")


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


def measure_matmul(dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 0.3,
                   device: torch.device | str = "cpu") -> float:
    """Best FLOP/s of square ``n x n @ n x n`` products in ``dtype`` (2 n^3 FLOPs each) over
    three timed rounds of at least ``seconds`` / 3 each, with the current torch threads.
    ``n`` is a cap: the size grows from 256 by doubling only while a product stays short
    against a round, so a slow matmul (0.5 GFLOP/s bf16) still ends in about 2 x ``seconds``
    (and a fast one reaches ``n``, whose peak a small product underestimates)."""
    def make(size):
        return (torch.randn(size, size, device=device).to(dtype),
                torch.randn(size, size, device=device).to(dtype))

    def one(size):  # the seconds of one product (the faster of two), after a warm-up
        a, b = make(size)
        _product(a, b)  # thread pool, kernel choice
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            _product(a, b)
            times.append(time.perf_counter() - t0)
        return a, b, min(times)

    # grow from 256 while 4x the last product's time fits a round: a product twice as large
    # costs 8x the FLOPs but runs more efficiently; a slow dtype stays small
    size = min(256, n)
    a, b, dt = one(size)
    while size < n and 4 * dt <= seconds / 3:
        size *= 2
        a, b, dt = one(size)
    best = 0.0
    for _ in range(3):
        reps, t0 = 0, time.perf_counter()
        while True:
            _product(a, b)
            reps += 1
            dt = time.perf_counter() - t0
            if dt >= seconds / 3:
                break
        best = max(best, 2.0 * size ** 3 * reps / dt)
    return best


def cached_cpu_peak(dtype: torch.dtype) -> Peak | None:
    """This CPU's cached matmul FLOP/s in ``dtype`` with ``torch.get_num_threads()``
    threads (see the module docstring), or None when none is cached; never measures."""
    value = _read_cache().get(_cache_key(dtype))
    if isinstance(value, (int, float)) and value > 0:
        return Peak(float(value), _source(dtype))
    return None


def cpu_peak(dtype: torch.dtype = torch.float32, refresh: bool = False,
             seconds: float = 0.3) -> Peak:
    """This CPU's matmul FLOP/s with ``torch.get_num_threads()`` threads in ``dtype``: the
    cached value, else measured by ``measure_matmul`` (about ``seconds`` long) and cached.
    ``refresh``: measure again; the cache keeps the highest measurement, since a probe that
    competed with other processes for the cores reads low. This measures in any dtype;
    ``peak_flops`` is what decides that a run measures only in fp32. A cache that cannot be
    written (read-only home) is not an error: the next call measures again."""
    cached = cached_cpu_peak(dtype)
    if cached is not None and not refresh:
        return cached
    measured = measure_matmul(dtype, seconds=seconds)
    # a probe that shared its cores with other work reads low: the highest one stands
    value = max(measured, cached.flops) if cached is not None else measured
    cache = _read_cache()
    cache[_cache_key(dtype)] = value
    path = _cache_path()
    try:  # atomic, a temporary file each: ranks probing at once never leave half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(cache, indent=1, sort_keys=True), unique=True)
    except OSError:
        pass  # a read-only home: measured again next time
    return Peak(float(value), _source(dtype))
