"""Model FLOPs, device peaks and MFU (model FLOPs utilisation).

``flops_per_token(cfg)`` counts the training FLOPs of one token of a GPT;
``peak_flops(device, dtype, tf32)`` is the device's peak (a table of known GPUs, a measured
matmul probe on the CPU); ``Throughput`` turns tokens per second into FLOP/s per rank and MFU.
"""

from shardwise.perf.flops import flops_per_token, matmul_parameters
from shardwise.perf.peak import GPU_PEAKS, Peak, cached_cpu_peak, cpu_peak, peak_flops
from shardwise.perf.throughput import Throughput

__all__ = ["GPU_PEAKS", "Peak", "Throughput", "cached_cpu_peak", "cpu_peak", "flops_per_token",
           "matmul_parameters", "peak_flops"]
