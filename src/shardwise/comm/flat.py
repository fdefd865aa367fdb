"""One-hop patterns: the parameter-server all-reduce ("naive"), the pass-along chain
("sequential"), the all-to-all exchange ("parallel"), and linear gather / scatter.

These are the naive rows of the comparison table in the seeds (MIT 6.S965 lecture on
distributed training; Li et al. 2014 "Scaling Distributed Machine Learning with the
Parameter Server"), kept to show why ring and halving-doubling exist. For X bytes on N ranks:

    naive       2 steps          root receives (N-1) X, then sends (N-1) X
    sequential  2 (N-1) steps    a rank passes its running sum to the next; the last rank
                                 holds the result and it travels back down the chain;
                                 inner ranks send 2 X, the ranks together 2 (N-1) X
    parallel    1 step           every rank sends X to every other: (N-1) X each, N(N-1) X
                                 in all; each rank reduces all N vectors in rank order
"""

from __future__ import annotations

import torch

from shardwise.comm.primitives import Call, combine_, combine_into, finish_, scratch


def naive_all_reduce(call: Call, buf: torch.Tensor, op: str, root: int = 0) -> int:
    """Everyone sends to ``root``, which reduces in rank order and sends the result back."""
    n, r = call.size, call.rank
    if r == root:
        m = buf.numel()
        space = scratch.get((n - 1) * m, buf.dtype, buf.device)
        peers = [p for p in range(n) if p != root]
        parts = [space[i * m:(i + 1) * m] for i in range(n - 1)]
        call.exchange(1, recvs=list(zip(peers, parts)))
        for part in parts:
            combine_(buf, part, op)
        finish_(buf, op, n)
        call.exchange(2, sends=[(p, buf) for p in peers])
    else:
        call.exchange(1, sends=[(root, buf)])
        call.exchange(2, recvs=[(root, buf)])
    return 2


def sequential_all_reduce(call: Call, buf: torch.Tensor, op: str) -> int:
    """Chain 0 -> 1 -> ... -> N-1 accumulating, then N-1 -> ... -> 0 copying."""
    n, r = call.size, call.rank
    if r > 0:  # step r: receive the running reduction of ranks 0..r-1
        tmp = scratch.get(buf.numel(), buf.dtype, buf.device)
        call.exchange(r, recvs=[(r - 1, tmp)])
        combine_(buf, tmp, op)
    if r < n - 1:
        call.exchange(r + 1, sends=[(r + 1, buf)])
    else:
        finish_(buf, op, n)
    # way back: rank N-1-j sends in step N-1+j+1
    if r < n - 1:
        call.exchange(2 * n - 2 - r, recvs=[(r + 1, buf)])
    if r > 0:
        call.exchange(2 * n - 1 - r, sends=[(r - 1, buf)])
    return 2 * (n - 1)


def parallel_all_reduce(call: Call, buf: torch.Tensor, op: str) -> int:
    """Every rank sends its vector to every other and reduces all N in rank order.

    ((v_0 + v_1) + v_2) + ... on every rank, so all ranks hold the same bits. Rank r
    accumulates v_0..v_{r-1} in the receive space, then adds that into its own ``buf`` (the
    operation is commutative elementwise, so acc + v_r and v_r + acc are the same bits)
    and goes on in ``buf``: N-1 reductions of X, no copies.
    """
    n, r = call.size, call.rank
    m = buf.numel()
    space = scratch.get(n * m, buf.dtype, buf.device)
    parts = [space[i * m:(i + 1) * m] for i in range(n)]
    others = [p for p in range(n) if p != r]
    call.exchange(1, sends=[(p, buf) for p in others],
                  recvs=[(p, parts[p]) for p in others])
    acc = buf if r == 0 else parts[0]
    for i in range(1, n):
        if i == r:
            combine_into(acc, buf, buf, op)
            acc = buf
        else:
            combine_(acc, parts[i], op)
    finish_(buf, op, n)
    return 1


def gather(call: Call, buf: torch.Tensor, out: list[torch.Tensor] | None, root: int) -> int:
    """Linear gather: rank i's ``buf`` lands in ``out[i]`` on ``root`` (one step)."""
    if call.rank == root:
        assert out is not None
        out[root].copy_(buf)
        call.exchange(1, recvs=[(p, out[p]) for p in range(call.size) if p != root])
    else:
        call.exchange(1, sends=[(root, buf)])
    return 1


def scatter(call: Call, buf: torch.Tensor, parts: list[torch.Tensor] | None, root: int) -> int:
    """Linear scatter: ``parts[i]`` of ``root`` lands in rank i's ``buf`` (one step)."""
    if call.rank == root:
        assert parts is not None
        call.exchange(1, sends=[(p, parts[p]) for p in range(call.size) if p != root])
        buf.copy_(parts[root])
    else:
        call.exchange(1, recvs=[(root, buf)])
    return 1
