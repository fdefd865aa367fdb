"""Helpers shared by the test modules and the rank functions of the ``*_workers.py``
modules (imported by bare name, ``from helpers import rel_err``: conftest puts tests/ on
``sys.path``, and spawned ranks inherit it). Kept light: no pytest, no conftest (a spawned
rank imports this module too)."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Per-tensor relative error ``|a - b| / |b|`` (Frobenius norms, float64, on the CPU;
    ``|b|`` clamped at 1e-30 so that a zero reference does not divide by zero). fp32 sums
    in another order differ by ~1e-7 per element, and Adam turns that into relative noise on
    entries near zero, so an elementwise relative bound would be meaningless there; the
    tensor-level one is not. Either tensor may be on CUDA or require grad."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))

