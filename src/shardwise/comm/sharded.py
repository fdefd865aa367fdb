"""All-gather and reduce-scatter: collectives over a vector cut into N equal shards.

Shard i (``block`` = input numel elements) belongs to group rank i, as in
``torch.distributed.all_gather_into_tensor`` / ``reduce_scatter_tensor``. Algorithms:
"ring" (Patarasuk & Yuan 2009: N-1 steps, (N-1) block bytes sent per rank),
"shm" (ranks of one host, through a shared-memory segment: ``shm.py``) and
"recursive_doubling" / "recursive_halving" (Thakur et al. 2005: log2 N steps for powers of
two, log2 p + 2 otherwise; same bytes per rank for powers of two), "native", or "auto"
(native on NCCL, ring elsewhere: what ZeRO uses).
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from shardwise.comm import halving_doubling, ring, shm
from shardwise.comm.api import (
    _NATIVE_OPS,
    ALL_GATHER_ALGORITHMS,
    REDUCE_SCATTER_ALGORITHMS,
    _agree,
    _call,
    _Flat,
    _launch,
    _pick,
    _tensor,
    resolve_auto,
)
from shardwise.comm.primitives import check_op, finish_, group_info, native_buffer

# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor for the *_single
# names (same arguments), which torch 2.11 lacks: the newer name where it exists
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None,
                           async_op: bool = False, algorithm: str = "ring",
                           check: bool | None = None):
    """``output`` (N * input.numel() elements, any shape) receives every rank's ``input``
    in group-rank order. X (for accounting) is the output's size in bytes. ``check``
    overrides ``settings.check`` for this call (see ``all_reduce``)."""
    _tensor(output, "all_gather", "output")
    _tensor(input, "all_gather", "input")
    info = group_info(group, "all_gather")
    algo = resolve_auto(_pick(algorithm, ALL_GATHER_ALGORITHMS, "all_gather"), group,
                        "all_gather")
    n, m = info.size, input.numel()
    if output.numel() != n * m or output.dtype != input.dtype:
        raise ValueError(f"all_gather: output must hold {n} x {m} elements of {input.dtype}, "
                         f"got {output.numel()} of {output.dtype}")

    def run() -> None:
        _agree(info, "all_gather", algo, "-", input, m, enabled=check)
        out = _Flat(output)
        out.flat[info.rank * m:(info.rank + 1) * m].copy_(input.reshape(-1))
        if n > 1:
            call = _call("all_gather", algo, info, output)
            if algo == "native":
                mine, _ = native_buffer(group, out.flat[info.rank * m:(info.rank + 1) * m].clone())
                buf, done = native_buffer(group, out.flat, fill=False)
                call.wait_native(_ALL_GATHER(buf, mine, group=group, async_op=True))
                done()
            elif algo == "ring":
                ring.all_gather(call, out.flat, [i * m for i in range(n + 1)])
            elif algo == "shm":
                shm.all_gather(shm.segment(info), call, out.flat, [i * m for i in range(n + 1)])
            else:
                halving_doubling.all_gather(call, out.flat, m)
            call.close()
        out.done()

    return _launch(run, async_op, "all_gather", (output,))


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None,
               async_op: bool = False, algorithm: str = "ring"):
    """``tensor_list[i]`` receives group rank i's ``tensor`` (list of N like-shaped tensors)."""
    _tensor(tensor, "all_gather")
    n = group_info(group, "all_gather").size
    if len(tensor_list) != n:
        raise ValueError(f"all_gather: tensor_list must hold {n} tensors, got {len(tensor_list)}")
    out = torch.empty(n * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    handle = all_gather_into_tensor(out, tensor, group, True, algorithm)

    def unpack() -> None:
        handle.wait()
        for i, t in enumerate(tensor_list):
            t.copy_(out[i * tensor.numel():(i + 1) * tensor.numel()].view_as(t))

    if async_op:
        from shardwise.comm.async_ import executor
        return executor.submit(unpack)
    unpack()
    return None


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                          group=None, async_op: bool = False, algorithm: str = "ring",
                          check: bool | None = None):
    """``output`` (m elements) on group rank i receives shard i of the reduction of every
    rank's ``input`` (N * m elements). ``input`` is left unchanged. X is the input's size.
    ``check`` overrides ``settings.check`` for this call (see ``all_reduce``)."""
    _tensor(output, "reduce_scatter", "output")
    _tensor(input, "reduce_scatter", "input")
    info = group_info(group, "reduce_scatter")
    check_op(op, input.dtype, "reduce_scatter")
    algo = resolve_auto(_pick(algorithm, REDUCE_SCATTER_ALGORITHMS, "reduce_scatter"), group,
                        "reduce_scatter")
    n, m = info.size, output.numel()
    if input.numel() != n * m or output.dtype != input.dtype:
        raise ValueError(f"reduce_scatter: input must hold {n} x {m} elements of "
                         f"{output.dtype}, got {input.numel()} of {input.dtype}")

    def run() -> None:
        _agree(info, "reduce_scatter", algo, op, input, input.numel(), enabled=check)
        out = _Flat(output)
        work = input.detach().reshape(-1).clone()
        call = _call("reduce_scatter", algo, info, input)
        r = info.rank
        if n == 1:
            pass
        elif algo == "native":
            res = torch.empty_like(work[:m])
            src, _ = native_buffer(group, work)
            buf, done = native_buffer(group, res, fill=False)
            call.wait_native(_REDUCE_SCATTER(buf, src, _NATIVE_OPS[op], group=group,
                                             async_op=True))
            done()
            finish_(res, op, n)
            work[r * m:(r + 1) * m].copy_(res)
        elif algo == "ring":
            ring.reduce_scatter(call, work, [i * m for i in range(n + 1)], op)
        elif algo == "shm":
            shm.reduce_scatter(shm.segment(info), call, work, [i * m for i in range(n + 1)], op,
                               finish_n=n)
        else:
            halving_doubling.reduce_scatter(call, work, m, op)
        call.close()
        out.flat.copy_(work[r * m:(r + 1) * m])
        out.done()

    return _launch(run, async_op, "reduce_scatter", (output,))


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: str = "sum",
                   group=None, async_op: bool = False, algorithm: str = "ring"):
    """``output`` on group rank i receives the reduction of ``input_list[i]`` over ranks."""
    flat = torch.cat([t.reshape(-1) for t in input_list])
    return reduce_scatter_tensor(output, flat, op, group, async_op, algorithm)
