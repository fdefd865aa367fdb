"""Non-blocking send / receive of pipeline activations and gradients: ``shardwise.comm``'s
public p2p with ``async_op=True``.

``exchange`` posts a batch of sends and receives at once (Megatron's batched
``send_forward_recv_backward``): two neighbours that each send to the other in the same
instant then proceed together instead of one waiting for the other's FIFO to reach the
receive.

The transfers run on comm's one FIFO communication thread (so they keep their order with
every other collective of the process) and return a ``Handle`` at once. Because the thread
runs a rank's transfers one at a time in posting order, a schedule must be deadlock-free
under blocking semantics, which ``shardwise.pipeline.check`` verifies.
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.comm import Handle


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> Handle:
    """Post a send of ``tensor`` to global rank ``dst``; do not modify it until ``wait()``."""
    return comm.send(tensor, dst, group=group, tag=tag, async_op=True)


def irecv(tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> Handle:
    """Post a receive into contiguous ``tensor`` (preallocated, exactly the sender's bytes)
    from global rank ``src``; it holds the data once ``wait()`` returns."""
    if not tensor.is_contiguous():
        raise ValueError("irecv: the receive buffer must be contiguous")
    return comm.recv(tensor, src, group=group, tag=tag, async_op=True)


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
             group=None, tag: int = 0) -> Handle:
    """Post every receive ``(buffer, src)`` and every send ``(tensor, dst)`` (global ranks)
    in one round, return at once; ``wait()`` returns when all are done. Messages between
    one pair of ranks match in posting order, so both sides must list them in one order."""
    return comm.exchange(sends, recvs, group=group, tag=tag, async_op=True)
