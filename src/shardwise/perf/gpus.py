"""Peak FLOP/s of the GPUs shardwise knows, from their datasheets (no torch: the planner's
cluster presets read it too).

GPUs: dense (no 2:4 sparsity) tensor-core peaks from NVIDIA's datasheets, per dtype:
``bf16`` (also fp16), ``tf32`` (fp32 matmuls with ``training.tf32``) and ``fp32`` (CUDA
cores). Datasheets quote the sparse figure for bf16/tf32; the dense one is half of it.

- H100 SXM5 and H200 SXM: 989.4 bf16, 494.7 tf32, 66.9 fp32 TFLOP/s (NVIDIA H100 Tensor Core
  GPU datasheet, 2023; NVIDIA H200 datasheet, 2024);
- H100 PCIe: 756.5 bf16, 378 tf32, 51.2 fp32 (the same H100 datasheet);
- A100 40 GB / 80 GB (SXM4 and PCIe): 312 bf16, 156 tf32, 19.5 fp32 (NVIDIA A100 datasheet,
  2021);
- L40S: 362.05 bf16, 183 tf32, 91.6 fp32 (NVIDIA L40S datasheet, 2023).
"""

from __future__ import annotations

from dataclasses import dataclass

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


def gpu_peak(name: str, kind: str) -> Peak:
    """The table's peak for a GPU called ``name`` (``torch.cuda.get_device_name``)."""
    upper = name.upper()
    for fragments, label, peaks in GPU_PEAKS:
        if all(f in upper for f in fragments):
            return Peak(peaks[kind] * TFLOPS, f"{label} {kind} datasheet peak")
    return Peak(None, f"{name!r} is not in the table of known GPUs (set training.peak_tflops)")
