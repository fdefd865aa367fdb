"""Point-to-point send / recv / exchange and the barrier, counted and bounded by the timeout
like the collectives, and ordered with them (they run on the same FIFO as async collectives).

``async_op=True`` returns a ``Handle`` at once (``wait()`` blocks until the message is sent /
received and raises its error), like ``torch.distributed.isend`` / ``irecv``; the transfer
runs on comm's one communication thread in posting order, so it keeps its place among the
process's collectives. ``exchange`` is the batched form (``torch.distributed.
batch_isend_irecv``): every receive and send of one round posted together, so two ranks that
send to each other at the same moment proceed together.
"""

from __future__ import annotations

from typing import Sequence

import torch

from shardwise.comm import check
from shardwise.comm.api import _launch, _tensor
from shardwise.comm.primitives import Call, group_info, group_rank_of, settings


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, async_op: bool = False):
    """Send ``tensor`` to global rank ``dst``.

    Blocks until sent, or with ``async_op=True`` returns a ``Handle`` at once; then the
    tensor must not be modified before ``wait()`` (a non-contiguous one is copied at the
    call, so only contiguous tensors are sent from their own storage).
    """
    _tensor(tensor, "send")
    info = group_info(group, "send")
    peer = group_rank_of(info, dst, "send", "dst")
    data = tensor.detach().contiguous()

    def run() -> None:
        call = Call("send", "p2p", info, data.numel() * data.element_size(), data.dtype, tag=tag)
        call.exchange(1, sends=[(peer, data.view(-1))])
        call.close()

    return _launch(run, async_op, "send")


def recv(tensor: torch.Tensor, src: int, group=None, tag: int = 0, async_op: bool = False):
    """Receive into ``tensor`` from global rank ``src``.

    Blocks until received, or with ``async_op=True`` returns a ``Handle`` whose ``wait()``
    returns once ``tensor`` holds the data. The sender's tensor must have the same number of
    bytes (a larger message makes gloo abort the process: there is no argument check on
    plain p2p).
    """
    _tensor(tensor, "recv")
    info = group_info(group, "recv")
    peer = group_rank_of(info, src, "recv", "src")

    def run() -> None:
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        call = Call("recv", "p2p", info, buf.numel() * buf.element_size(), buf.dtype, tag=tag)
        call.exchange(1, recvs=[(peer, buf.view(-1))])
        call.close()
        if buf is not tensor:
            tensor.copy_(buf)

    return _launch(run, async_op, "recv", (tensor,))


def exchange(sends: Sequence[tuple[torch.Tensor, int]] = (),
             recvs: Sequence[tuple[torch.Tensor, int]] = (), group=None, tag: int = 0,
             async_op: bool = False):
    """Post every receive ``(buffer, src)`` and every send ``(tensor, dst)`` (global ranks)
    in one round and wait for all of them (``async_op=True``: return a ``Handle``).

    Messages between one pair of ranks match in posting order, so both sides must list them
    in one order. Receive buffers must be contiguous; sent tensors must not change before
    the round is done.
    """
    info = group_info(group, "exchange")
    s = []
    for i, (t, dst) in enumerate(sends):
        _tensor(t, "exchange", f"sends[{i}]")
        s.append((group_rank_of(info, dst, "exchange", "dst"), t.detach().contiguous().view(-1)))
    r = []
    for i, (buf, src) in enumerate(recvs):
        _tensor(buf, "exchange", f"recvs[{i}]")
        if not buf.is_contiguous():
            raise ValueError(f"exchange: receive buffer recvs[{i}] must be contiguous")
        r.append((group_rank_of(info, src, "exchange", "src"), buf.view(-1)))
    nbytes = sum(t.numel() * t.element_size() for _, t in s)
    dtype = (s or r)[0][1].dtype if (s or r) else None

    def run() -> None:
        call = Call("sendrecv", "p2p", info, nbytes, dtype, tag=tag)
        call.exchange(1, sends=s, recvs=r)
        call.close()

    return _launch(run, async_op, "sendrecv", [buf for buf, _ in recvs])


def barrier(group=None, algorithm: str = "dissemination") -> None:
    """Return on every rank only once all ranks of ``group`` have entered it.

    "dissemination" (Hensgen, Finkel & Manber 1988), ceil(log2 N) steps. With the argument
    check on (the default) the check's rounds are the barrier, and they also catch a rank
    that called another collective instead. "shm": one round of the group's shared-memory
    segment (ranks of one host; no argument check).
    """
    if algorithm not in ("dissemination", "shm"):
        raise ValueError(f"barrier: algorithm must be dissemination or shm, got {algorithm!r}")
    info = group_info(group, "barrier")

    def run() -> None:
        if info.size == 1:
            return
        if algorithm == "shm":
            from shardwise.comm import shm
            call = Call("barrier", "shm", info, 0)
            shm.barrier(shm.segment(info), call)
            call.close()
            return
        if settings.check:
            check.agree(info, "barrier(dissemination)",
                        check.fingerprint(info, "barrier", "dissemination", "-", None, 0, -1))
            return
        n, r = info.size, info.rank
        dev = check.group_device(info.group)
        token = torch.zeros(1, dtype=torch.uint8, device=dev)
        got = torch.empty(1, dtype=torch.uint8, device=dev)
        call = Call("barrier", "dissemination", info, 1, torch.uint8)
        k, step = 1, 1
        while k < n:
            call.exchange(step, sends=[((r + k) % n, token)], recvs=[((r - k) % n, got)])
            k, step = 2 * k, step + 1
        call.close()

    _launch(run, False, "barrier")
