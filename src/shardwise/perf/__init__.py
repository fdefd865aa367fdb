"""Model FLOPs, device peaks and MFU (model FLOPs utilisation).

``flops_per_token(cfg)`` counts the training FLOPs of one token of a GPT;
``peak_flops(device, dtype, tf32)`` is the device's peak (a table of known GPUs, a measured
matmul probe on the CPU); ``Throughput`` turns tokens per second into FLOP/s per rank and MFU.
"""

from shardwise.base.lazy import lazy_exports

# public name -> its submodule, loaded on first use (``perf.gpus``, the planner's, has no torch)
_EXPORTS: dict[str, str] = {
    "flops_per_token": "flops", "matmul_parameters": "flops", "GPU_PEAKS": "gpus",
    "Peak": "gpus", "cached_cpu_peak": "peak", "cpu_peak": "peak", "peak_flops": "peak",
    "Throughput": "throughput",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["GPU_PEAKS", "Peak", "Throughput", "cached_cpu_peak", "cpu_peak", "flops_per_token",
           "matmul_parameters", "peak_flops"]
