"""Peak device memory per rank, for the train rows of ``metrics.jsonl`` and the progress bar.

On CUDA each train row carries, for every rank of the run (index = global rank):

    peak_allocated_mib   [r0, r1, ...]   torch.cuda.max_memory_allocated (tensors), MiB
    peak_reserved_mib    [r0, r1, ...]   torch.cuda.max_memory_reserved (the caching
                                         allocator's segments: what nvidia-smi sees of it)

Each value is the high-water mark of one logging window: the peaks are reset
(``torch.cuda.reset_peak_memory_stats``) when the loop starts and after every train row, so
a row says how much its own ``log_every`` steps needed (the first row: training steps only,
not the model's construction). MiB = 2**20 bytes. The ranks' values reach rank 0 in one
``comm.all_reduce`` (sum) of a (world, 2) float64 tensor in which each rank fills its own
row: one small collective per logged step, only on CUDA, over the group the application
names (``TrainTask.memory_group``; "local": none, this rank's value alone).

On the CPU nothing is added to the rows (no collective, no read: the CPU path costs nothing);
TensorBoard / W&B still get rank 0's peak resident set (``loggers``: ``memory/max_rss_mib``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise import comm

MiB = 2 ** 20
KEYS = ("peak_allocated_mib", "peak_reserved_mib")


def reset_peaks(device: torch.device) -> None:
    """Start a window: the CUDA peaks of ``device`` reset to what is held now (CPU: nothing)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def local_peaks(device: torch.device) -> tuple[float, float]:
    """(peak allocated, peak reserved) of ``device`` since the last reset, MiB."""
    return (torch.cuda.max_memory_allocated(device) / MiB,
            torch.cuda.max_memory_reserved(device) / MiB)


def peak_memory(device: torch.device, group="local", reset: bool = True) -> dict:
    """``{"peak_allocated_mib": [...], "peak_reserved_mib": [...]}`` over the ranks of
    ``group`` (None: the world, every rank must call; "local": this rank alone), each list
    indexed by rank in the group; ``{}`` on the CPU. With ``reset`` the next window starts
    here. Collective over ``group`` on CUDA (see the module docstring)."""
    if device.type != "cuda":
        return {}
    mine = local_peaks(device)
    if reset:
        reset_peaks(device)
    cols = gather_per_rank(list(mine), group, device)
    return {k: [round(v, 1) for v in col] for k, col in zip(KEYS, cols)}


def gather_per_rank(values: list[float], group, device: torch.device) -> list[list[float]]:
    """Each rank's ``values`` (k floats) on every rank of ``group``, as k lists indexed by
    group rank: one ``comm.all_reduce`` (sum) of a (ranks, k) float64 tensor on ``device``
    in which each rank fills its own row. ``group`` "local" or no torch.distributed: this
    rank's values alone, no collective."""
    if group == "local" or not (dist.is_available() and dist.is_initialized()):
        return [[v] for v in values]
    n, r = dist.get_world_size(group), dist.get_rank(group)
    t = torch.zeros(n, len(values), dtype=torch.float64, device=device)
    t[r] = torch.tensor(values, dtype=torch.float64, device=device)
    comm.all_reduce(t, op="sum", group=group, check=False)  # fixed shape: no agreement round
    return t.t().tolist()


def memory_postfix(row: dict) -> str | None:
    """The progress bar's memory field: the largest peak allocated / peak reserved over the
    ranks of ``row``, GiB, e.g. ``"12.3/14.0G"`` (with more than one rank the busiest rank's
    index follows: ``"12.3/14.0G@r3"``); None without memory in the row (the CPU)."""
    alloc, res = row.get(KEYS[0]), row.get(KEYS[1])
    if not alloc or not res:
        return None
    top = max(range(len(alloc)), key=alloc.__getitem__)
    text = f"{alloc[top] / 1024:.1f}/{max(res) / 1024:.1f}G"
    return text + (f"@r{top}" if len(alloc) > 1 else "")
