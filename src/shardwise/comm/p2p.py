"""Point-to-point send / recv and the barrier, counted and bounded by the timeout like the
collectives, and ordered with them (they run on the same FIFO as async collectives)."""

from __future__ import annotations

import torch

from shardwise.comm import check
from shardwise.comm.api import _launch, _tensor
from shardwise.comm.primitives import Call, group_info, group_rank_of, settings


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
    """Send ``tensor`` (contiguous copy of it) to global rank ``dst``; blocks until sent."""
    _tensor(tensor, "send")
    info = group_info(group, "send")
    peer = group_rank_of(info, dst, "send", "dst")
    data = tensor.contiguous()

    def run() -> None:
        call = Call("send", "p2p", info, data.numel() * data.element_size(), data.dtype, tag=tag)
        call.exchange(1, sends=[(peer, data.view(-1))])
        call.close()

    _launch(run, False)


def recv(tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> None:
    """Receive into ``tensor`` from global rank ``src``; blocks until received.

    The sender's tensor must have the same number of bytes (a larger message makes gloo
    abort the process: there is no argument check on plain p2p).
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

    _launch(run, False)


def barrier(group=None) -> None:
    """Return on every rank only once all ranks of ``group`` have entered it.

    Dissemination barrier (Hensgen, Finkel & Manber 1988), ceil(log2 N) steps. With the
    argument check on (the default) the check's rounds are the barrier, and they also catch
    a rank that called another collective instead.
    """
    info = group_info(group, "barrier")

    def run() -> None:
        if info.size == 1:
            return
        if settings.check:
            check.agree(info, "barrier(dissemination)",
                        check.fingerprint(info, "barrier", "dissemination", "-", None, 0, -1))
            return
        n, r = info.size, info.rank
        token, got = torch.zeros(1, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8)
        call = Call("barrier", "dissemination", info, 1, torch.uint8)
        k, step = 1, 1
        while k < n:
            call.exchange(step, sends=[((r + k) % n, token)], recvs=[((r - k) % n, got)])
            k, step = 2 * k, step + 1
        call.close()

    _launch(run, False)
