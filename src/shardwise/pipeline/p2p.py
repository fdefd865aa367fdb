"""Non-blocking send / receive of pipeline activations and gradients, through comm.

``exchange`` posts a batch of sends and receives at once (Megatron's batched
``send_forward_recv_backward``): two neighbours that each send to the other in the same
instant then proceed together instead of one waiting for the other's FIFO to reach the
receive.

``shardwise.comm.send`` / ``recv`` block; the pipeline needs them posted while compute goes
on, so these are their ``async_op=True`` twins: the same counted ``Call`` on comm's one FIFO
communication thread (so they keep their order with every other collective of the process),
returning a ``Handle`` at once. Because the thread runs a rank's transfers one at a time in
posting order, a schedule must be deadlock-free under blocking semantics, which
``shardwise.pipeline.check`` verifies. (They belong in ``comm.p2p`` as ``async_op=True``;
they live here until that file grows the option.)
"""

from __future__ import annotations

import torch

from shardwise.comm.api import _launch
from shardwise.comm.async_ import Handle
from shardwise.comm.primitives import Call, group_info, group_rank_of


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> Handle:
    """Post a send of ``tensor`` to global rank ``dst``; do not modify it until ``wait()``."""
    info = group_info(group, "send")
    peer = group_rank_of(info, dst, "send", "dst")
    data = tensor.detach().contiguous()

    def run() -> None:
        call = Call("send", "p2p", info, data.numel() * data.element_size(), data.dtype, tag=tag)
        call.exchange(1, sends=[(peer, data.view(-1))])
        call.close()

    return _launch(run, True)


def irecv(tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> Handle:
    """Post a receive into contiguous ``tensor`` (preallocated, exactly the sender's bytes)
    from global rank ``src``; it holds the data once ``wait()`` returns."""
    if not tensor.is_contiguous():
        raise ValueError("irecv: the receive buffer must be contiguous")
    info = group_info(group, "recv")
    peer = group_rank_of(info, src, "recv", "src")

    def run() -> None:
        call = Call("recv", "p2p", info, tensor.numel() * tensor.element_size(), tensor.dtype,
                    tag=tag)
        call.exchange(1, recvs=[(peer, tensor.view(-1))])
        call.close()

    return _launch(run, True)


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
             group=None, tag: int = 0) -> Handle:
    """Post every receive ``(buffer, src)`` and every send ``(tensor, dst)`` (global ranks)
    in one round, return at once; ``wait()`` returns when all are done. Messages between
    one pair of ranks match in posting order, so both sides must list them in one order."""
    info = group_info(group, "exchange")
    s = [(group_rank_of(info, dst, "exchange", "dst"), t.detach().contiguous().view(-1))
         for t, dst in sends]
    for buf, _ in recvs:
        if not buf.is_contiguous():
            raise ValueError("exchange: receive buffers must be contiguous")
    r = [(group_rank_of(info, src, "exchange", "src"), buf.view(-1)) for buf, src in recvs]
    nbytes = sum(t.numel() * t.element_size() for _, t in s)
    dtype = (s or r)[0][1].dtype if (s or r) else None

    def run() -> None:
        call = Call("sendrecv", "p2p", info, nbytes, dtype, tag=tag)
        call.exchange(1, sends=s, recvs=r)
        call.close()

    return _launch(run, True)
