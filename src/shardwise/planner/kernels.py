"""Kernel profiles: what ``shardwise bench calibrate`` measured on a device, and a GPU preset
priced from it (``shardwise plan --kernels-profile PATH``).

A profile is one JSON object (written by ``planner.kernel_bench.measure``): ``format``
(``FORMAT``), ``device`` (the GPU's ``torch.cuda.get_device_name`` or the CPU's model),
``device_type`` (cuda, cpu), ``torch``, ``date`` (UTC, ISO 8601), ``dtype``, ``model``, and
the measured rows: ``gemm`` (tokens, in, out, flops, seconds, flops_per_s, efficiency
against ``peak_flops``), ``attention`` (per SDPA kernel and length: forward_s, backward_s),
``memory`` (bytes, seconds, bytes_per_s of an element-wise add), ``optimizer`` (AdamW's
seconds_per_param) and ``collectives`` (the comm profile in use, not re-measured).

``apply``: the preset's ``OpModel`` with its GEMM and memory-bound efficiency tables
replaced by the profile's rows (the one path; no per-device branch): a GEMM of F FLOPs at
the measured FLOP/s of the largest measured GEMM F reaches, over the preset's datasheet
peak (the smallest row's below every row), capped at 1: the datasheet stays the ceiling;
likewise a memory-bound operation at the measured bytes/s of the largest measured size it
reaches over the preset's memory bandwidth. Piecewise constant in FLOPs and bytes, as the
Calculon tables it replaces (``hardware.CALCULON_GEMM``, ``CALCULON_MEM``). The rest of the
preset (FP8 peak, ``COMPILED_MEM``, ``FLASH_BACKWARD``, ``STEP_S``, links) is kept.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from shardwise.perf.gpus import GPU_PEAKS
from shardwise.planner.hardware import Cluster
from shardwise.planner.specs import SpecError

FORMAT = "shardwise-kernels/1"
PEAK_KIND = {"bf16": "bf16", "fp16": "bf16", "fp32": "fp32"}  # perf.gpus: bf16 is fp16's too
FIELDS = ("device", "torch", "date", "dtype")


def gpu_label(name: str) -> str | None:
    """The ``perf.gpus`` table's label of a GPU called ``name`` (None: not in the table)."""
    upper = name.upper()
    return next((label for frags, label, _ in GPU_PEAKS if all(f in upper for f in frags)),
                None)


def load(path: str | Path) -> dict:
    """The profile at ``path``, checked: ``SpecError`` naming ``--kernels-profile`` and
    what is wrong (unreadable, not a profile, a field missing, a row not positive)."""
    where = f"--kernels-profile {path}"
    try:
        prof = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"{where}: cannot read it ({exc})") from None
    if not isinstance(prof, dict) or prof.get("format") != FORMAT:
        raise SpecError(f"{where}: not a kernel profile (expected \"format\": \"{FORMAT}\", "
                        "as shardwise bench calibrate writes)")
    for key in FIELDS:
        if not isinstance(prof.get(key), str) or not prof[key]:
            raise SpecError(f"{where}: field {key!r} missing")
    if prof["dtype"] not in PEAK_KIND:
        raise SpecError(f"{where}: dtype {prof['dtype']!r}: expected one of "
                        f"{', '.join(PEAK_KIND)}")
    for section, keys in (("gemm", ("flops", "flops_per_s")), ("memory", ("bytes",
                                                                          "bytes_per_s"))):
        rows = prof.get(section)
        if not isinstance(rows, list) or not rows:
            raise SpecError(f"{where}: no {section!r} rows")
        for i, row in enumerate(rows):
            for k in keys:
                v = row.get(k) if isinstance(row, dict) else None
                if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                    raise SpecError(f"{where}: {section}[{i}].{k} must be a number > 0")
    return prof


def table(points: list[tuple[float, float]], ceiling: float,
          unit: float) -> tuple[tuple[float, float], ...]:
    """An ``OpModel`` efficiency table from measured (size, rate) points: (threshold in
    ``unit``, mean rate there / ``ceiling`` capped at 1), descending, the smallest threshold
    0 so every size finds a row."""
    by_size: dict[float, list[float]] = {}
    for size, rate in points:
        by_size.setdefault(size, []).append(rate)
    rows = sorted(((size / unit, min(1.0, sum(r) / len(r) / ceiling))
                   for size, r in by_size.items()), reverse=True)
    rows[-1] = (0.0, rows[-1][1])
    return tuple(rows)


def apply(cluster: Cluster, prof: dict, path: str = "") -> Cluster:
    """``cluster`` (a GPU preset under the per-operation model) with its GEMM and memory
    efficiency tables from the profile ``prof`` (``load``; see the module docstring).
    ``SpecError`` where the preset has no per-operation model (``local``, ``--compute
    fixed``), or the profile's device is not the preset's GPU, or its dtype not the
    preset's precision."""
    where = f"--kernels-profile {path}" if path else "--kernels-profile"
    if cluster.ops is None or cluster.cores:
        raise SpecError(f"{where}: prices a GPU preset's per-operation model (--compute "
                        f"per-op), not {cluster.name}")
    mine, theirs = gpu_label(cluster.gpu), gpu_label(prof["device"])
    if mine is None or mine != theirs:
        raise SpecError(f"{where}: measured on {prof['device']!r}, but {cluster.name}'s GPU "
                        f"is the {cluster.gpu}; calibrate on that GPU")
    if PEAK_KIND[prof["dtype"]] != cluster.precision:
        raise SpecError(f"{where}: measured in {prof['dtype']}, {cluster.name} computes in "
                        f"{cluster.precision}")
    gemm = table([(r["flops"], r["flops_per_s"]) for r in prof["gemm"]],
                 cluster.ops.matrix_flops, 1e9)
    mem = table([(r["bytes"], r["bytes_per_s"]) for r in prof["memory"]],
                cluster.ops.mem_bw, 1e6)
    what = f"kernel profile {Path(path).name or 'given'} ({prof['device']}, torch " \
           f"{prof['torch']}, {prof['date']})"
    ops = replace(cluster.ops, name=f"{cluster.gpu} per-op, {what}", gemm_eff=gemm,
                  mem_eff=mem, source=what)
    return replace(cluster, ops=ops, source=f"{cluster.source}; GEMMs and memory: {what}")
