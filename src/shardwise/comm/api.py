"""Public collectives: argument checks, algorithm dispatch, sync / async.

Semantics follow ``torch.distributed``: tensors are reduced / overwritten in place, ``src``
and ``dst`` are global ranks, ``group=None`` is the world, ``async_op=True`` returns a handle
whose ``wait()`` blocks until the tensor holds the result (and raises the collective's
error), otherwise ``None`` is returned. Any shape is accepted (the tensor is treated as its
flat contiguous storage; a non-contiguous tensor is copied in and out). Reduce ops: "sum",
"mean" (floating / complex only; the sum divided by the group size), "max", "min".
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from shardwise.base.config import ALLREDUCE_ALGORITHMS  # one list, read by the config too
from shardwise.comm import (
    accounting,
    check,
    cost,
    flat,
    halving_doubling,
    hierarchical,
    replay,
    ring,
    shm,
    tree,
)
from shardwise.comm.async_ import executor
from shardwise.comm.primitives import (
    Call,
    GroupInfo,
    backend_of,
    check_op,
    finish_,
    group_info,
    group_rank_of,
    native_buffer,
    settings,
)

ALL_GATHER_ALGORITHMS = ("native", "ring", "recursive_doubling", "shm", "auto")
REDUCE_SCATTER_ALGORITHMS = ("native", "ring", "recursive_halving", "shm", "auto")
BROADCAST_ALGORITHMS = ("native", "tree", "shm", "auto")
REDUCE_ALGORITHMS = ("native", "tree")
# "auto" for the collectives without a cost model: the backend's own on NCCL (NVLink, many
# channels), ours elsewhere (gloo: bytes counted, and its CUDA tensors staged per message)
_AUTO_OURS = {"all_gather": "ring", "reduce_scatter": "ring", "broadcast": "tree"}


def resolve_auto(algorithm: str, group, collective: str) -> str:
    """``algorithm``, with "auto" made concrete for ``collective`` on ``group``: "native" when
    the group's backend is NCCL, else ``_AUTO_OURS[collective]``."""
    if algorithm != "auto":
        return algorithm
    return "native" if backend_of(group) == "nccl" else _AUTO_OURS[collective]


_ALL_REDUCE: dict[str, Callable] = {
    "ring": ring.all_reduce, "halving_doubling": halving_doubling.all_reduce,
    "tree": tree.all_reduce, "naive": flat.naive_all_reduce,
    "sequential": flat.sequential_all_reduce, "parallel": flat.parallel_all_reduce,
    "shm": lambda call, buf, op: shm.all_reduce(shm.segment(call.info), call, buf, op),
    "hierarchical": hierarchical.all_reduce,
}
_NATIVE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM,
               "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _pick(algorithm: str, allowed: tuple[str, ...], collective: str) -> str:
    if algorithm not in allowed:
        raise ValueError(f"{collective}: algorithm must be one of {allowed}, got {algorithm!r}")
    return "halving_doubling" if algorithm == "rabenseifner" else algorithm


def _tensor(t, collective: str, what: str = "tensor") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{collective}: {what} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _launch(fn: Callable[[], None], async_op: bool, collective: str,
            outputs: Sequence[torch.Tensor] = ()):
    """Run the collective ``fn`` (blocking, or queued with a handle back for ``async_op``).
    Every collective passes here, naming itself and the tensors it writes (``outputs``), so
    a region being recorded or replayed for recomputation (``replay.py``) sees each one."""
    log = replay.current()
    if log is not None:
        return log.launch(collective, outputs, fn, async_op)
    if async_op:
        return executor.submit(fn)
    executor.run(fn)
    return None


def _agree(info: GroupInfo, collective: str, algorithm: str, op: str, t: torch.Tensor | None,
           numel: int, root: int = -1, enabled: bool | None = None) -> None:
    if (settings.check if enabled is None else enabled) and info.size > 1:
        check.agree(info, f"{collective}({algorithm})",
                    check.fingerprint(info, collective, algorithm, op,
                                      None if t is None else t.dtype, numel, root),
                    device=None if t is None else t.device)


class _Flat:
    """The flat contiguous view of a tensor, through a copy if it is not contiguous."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.copy = None if t.is_contiguous() else t.contiguous()
        self.flat = (t if self.copy is None else self.copy).view(-1)

    def done(self) -> None:
        if self.copy is not None:
            self.t.copy_(self.copy)


def choose(info: GroupInfo, t: torch.Tensor) -> str:
    """The ``auto`` all-reduce for this group and tensor: ``cost.choose_all_reduce`` over the
    send/recv algorithms, plus "shm" when every rank is on one host, or "hierarchical" when
    the group spans hosts of equally many ranks (CPU tensors, ``shm.available()``). Learning
    the hosts is collective (once per group, see ``hierarchical.layout``); the choice is the
    same on every rank given the same profile. Only a profile calibrated on this group's
    backend and this tensor's device kind chooses; otherwise (CUDA tensors on NCCL with the
    CPU profile of the repository, say) the answer is "native", the backend's own."""
    nbytes = t.numel() * t.element_size()
    where = (backend_of(info.group), cost.device_kind(t.device))
    if info.size > 1 and t.device.type == "cpu" and shm.available():
        lay = hierarchical.layout(info)
        if lay.one_host:
            return cost.choose_all_reduce(info.size, nbytes, ("shm",), 1, *where)
        if lay.uniform:
            return cost.choose_all_reduce(info.size, nbytes, ("hierarchical",), len(lay.hosts),
                                          *where)
    return cost.choose_all_reduce(info.size, nbytes, (), 1, *where)


def _call(name: str, algorithm: str, info: GroupInfo, t: torch.Tensor) -> Call:
    nbytes = t.numel() * t.element_size()
    c = Call(name, algorithm, info, nbytes, t.dtype, account=algorithm != "native")
    if algorithm == "native" and accounting.log.enabled:
        accounting.native_record(name, info.size, info.rank, info.global_rank, nbytes, t.dtype)
    return c


# ---------------------------------------------------------------------------- all-reduce

def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, algorithm: str = "native",
               async_op: bool = False, check: bool | None = None):
    """Reduce ``tensor`` (any shape, X = numel * element_size bytes) across ``group`` in place.

    algorithm: one of ``ALLREDUCE_ALGORITHMS``: "ring" (Patarasuk & Yuan 2009),
    "halving_doubling" / "rabenseifner" (Thakur et al. 2005), "tree" (binomial reduce +
    broadcast), "naive" (parameter server at group rank 0), "sequential" (pass-along chain),
    "parallel" (all-to-all), "shm" (shared memory, every rank on one host: ``shm.py``),
    "hierarchical" (shared memory inside hosts, ring across: ``hierarchical.py``), "native"
    (the backend's own), "auto" (cheapest by ``choose`` for this group and X; the choice is
    the same on every rank given the same profile). All ranks end with bitwise identical
    results.
    Raises ValueError / TypeError for bad arguments, ``CommError`` when ranks disagree,
    ``CommTimeoutError`` after ``configure(timeout_s=...)`` seconds without progress.
    ``check`` overrides ``settings.check`` for this call: a caller that has verified the
    shapes once (DDP at construction, as PyTorch's DDP does) skips the agreement round.
    """
    _tensor(tensor, "all_reduce")
    info = group_info(group, "all_reduce")
    check_op(op, tensor.dtype, "all_reduce")
    algo0 = _pick(algorithm, ALLREDUCE_ALGORITHMS, "all_reduce")

    def run() -> None:
        algo = choose(info, tensor) if algo0 == "auto" else algo0
        _agree(info, "all_reduce", algo, op, tensor, tensor.numel(), enabled=check)
        if info.size == 1:
            return
        f = _Flat(tensor)
        call = _call("all_reduce", algo, info, tensor)
        if algo == "native":
            buf, done = native_buffer(group, f.flat)
            call.wait_native(dist.all_reduce(buf, _NATIVE_OPS[op], group=group, async_op=True))
            done()
            finish_(f.flat, op, info.size)
        else:
            _ALL_REDUCE[algo](call, f.flat, op)
        call.close()
        f.done()

    return _launch(run, async_op, "all_reduce", (tensor,))


# ---------------------------------------------------------------------------- rooted

def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False,
              algorithm: str = "tree", check: bool | None = None):
    """Copy ``tensor`` of global rank ``src`` into ``tensor`` on every rank of ``group``.

    "tree": binomial tree, ceil(log2 N) steps, each a message of the whole tensor. "shm":
    through the root's shared-memory slot (ranks of one host), one round per slot's worth.
    "auto": "native" on NCCL, "tree" elsewhere.
    ``check`` overrides ``settings.check`` for this call (see ``all_reduce``).
    """
    _tensor(tensor, "broadcast")
    info = group_info(group, "broadcast")
    algo = resolve_auto(_pick(algorithm, BROADCAST_ALGORITHMS, "broadcast"), group, "broadcast")
    root = group_rank_of(info, src, "broadcast", "src")

    def run() -> None:
        _agree(info, "broadcast", algo, "-", tensor, tensor.numel(), src, enabled=check)
        if info.size == 1:
            return
        f = _Flat(tensor)
        call = _call("broadcast", algo, info, tensor)
        if algo == "native":
            buf, done = native_buffer(group, f.flat)
            call.wait_native(dist.broadcast(buf, src, group=group, async_op=True))
            done()
        elif algo == "shm":
            shm.broadcast(shm.segment(info), call, f.flat, root)
        else:
            tree.broadcast(call, f.flat, root)
        call.close()
        f.done()

    return _launch(run, async_op, "broadcast", (tensor,))


def reduce(tensor: torch.Tensor, dst: int, op: str = "sum", group=None, async_op: bool = False,
           algorithm: str = "tree"):
    """Reduce ``tensor`` of every rank onto global rank ``dst``, in place there.

    Other ranks' tensors are left unchanged. "tree": binomial, ceil(log2 N) steps.
    """
    _tensor(tensor, "reduce")
    info = group_info(group, "reduce")
    check_op(op, tensor.dtype, "reduce")
    algo = _pick(algorithm, REDUCE_ALGORITHMS, "reduce")
    root = group_rank_of(info, dst, "reduce", "dst")

    def run() -> None:
        _agree(info, "reduce", algo, op, tensor, tensor.numel(), dst)
        if info.size == 1:
            return
        mine = info.rank == root
        f = _Flat(tensor if mine else tensor.detach().clone())
        call = _call("reduce", algo, info, tensor)
        if algo == "native":
            buf, done = native_buffer(group, f.flat)
            call.wait_native(dist.reduce(buf, dst, _NATIVE_OPS[op], group=group,
                                         async_op=True))
            done()
            if mine:
                finish_(f.flat, op, info.size)
        else:
            tree.reduce(call, f.flat, root, op)
        call.close()
        if mine:
            f.done()

    return _launch(run, async_op, "reduce", (tensor,) if info.rank == root else ())


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group=None, async_op: bool = False):
    """Linear gather: ``gather_list[i]`` on global rank ``dst`` receives group rank i's tensor.

    ``gather_list`` (N tensors shaped like ``tensor``) is required on ``dst`` only. One step;
    the root receives (N-1) X bytes.
    """
    _tensor(tensor, "gather")
    info = group_info(group, "gather")
    root = group_rank_of(info, dst, "gather", "dst")
    if info.rank == root:
        _check_list(gather_list, info.size, tensor, "gather", "gather_list")

    def run() -> None:
        _agree(info, "gather", "linear", "-", tensor, tensor.numel(), dst)
        outs = [_Flat(t) for t in gather_list] if info.rank == root else None
        call = _call("gather", "linear", info, tensor)
        flat.gather(call, _Flat(tensor).flat, None if outs is None else [o.flat for o in outs],
                    root)
        call.close()
        for o in outs or ():
            o.done()

    return _launch(run, async_op, "gather", gather_list if info.rank == root else ())


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group=None, async_op: bool = False):
    """Linear scatter: group rank i's ``tensor`` receives ``scatter_list[i]`` of global ``src``.

    ``scatter_list`` (N tensors shaped like ``tensor``) is required on ``src`` only.
    """
    _tensor(tensor, "scatter")
    info = group_info(group, "scatter")
    root = group_rank_of(info, src, "scatter", "src")
    if info.rank == root:
        _check_list(scatter_list, info.size, tensor, "scatter", "scatter_list")

    def run() -> None:
        _agree(info, "scatter", "linear", "-", tensor, tensor.numel(), src)
        f = _Flat(tensor)
        parts = ([p.contiguous().view(-1) for p in scatter_list] if info.rank == root else None)
        call = _call("scatter", "linear", info, tensor)
        flat.scatter(call, f.flat, parts, root)
        call.close()
        f.done()

    return _launch(run, async_op, "scatter", (tensor,))


def _check_list(lst, n: int, like: torch.Tensor, collective: str, what: str) -> None:
    if lst is None or len(lst) != n:
        raise ValueError(f"{collective}: {what} must hold {n} tensors (one per group rank) on "
                         f"the root, got {None if lst is None else len(lst)}")
    for i, t in enumerate(lst):
        _tensor(t, collective, f"{what}[{i}]")
        if t.numel() != like.numel() or t.dtype != like.dtype:
            raise ValueError(f"{collective}: {what}[{i}] is {tuple(t.shape)} {t.dtype}, "
                             f"expected {like.numel()} elements of {like.dtype}")
