"""All-to-all context parallelism (DeepSpeed-Ulysses), and its hybrid with the ring.

Jacobs et al. 2023, "DeepSpeed Ulysses" (arXiv:2309.14509), section 3: before attention an
all-to-all over the A ranks of a head group turns each rank's "all heads, 1/A of the
sequence" into "1/A of the heads, the whole sequence"; attention then runs locally, with the
model's own kernel (``local``, the model's single-process attention: ``models.gpt.
causal_attention`` passes itself, with causal, document masks, sliding windows and
soft-capping unchanged); a second all-to-all turns the output back. q, k and v travel in one
all-to-all (their blocks for each rank side by side). Backward is the inverse all-to-all of
each (``HeadsToSequence``, ``SequenceToHeads``). Per rank each all-to-all sends (A - 1) / A
of the tensors it is given (q, k and v, the output; their gradients backward).

The hybrid (Megatron-Core's ``cp_comm_type = "a2a+p2p"``): cp = A x R, the head groups of A
consecutive cp ranks (``parallel.cp_a2a``; inside a node), the rings of R ranks across them
(ring attention, ``ring_attention``, on what the all-to-all gathered). Pure all-to-all is
R = 1, pure ring A = 1. The load-balanced layout (``sharding``: cp rank i holds chunks i and
2cp-1-i) composes: head group g (cp ranks gA .. gA + A - 1) holds exactly the ring's chunks
g and 2R-1-g of the sequence cut into 2R, so after the all-to-all and a reordering of its
chunks (``ring_order``) each rank holds the ring's own layout; with R = 1 that is the
sequence in its original order (positions, rotary angles and masks as one process's).

Grouped-query attention: the key/value heads must divide by A, or A by them; in the second
case each key/value head is repeated A / Hkv times first (as DeepSpeed does), the gradients
of the copies summed by autograd.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardwise import comm
from shardwise.models import sequence
from shardwise.parallel.context.ring_attention import ring_attention
from shardwise.parallel.context.ring_comm import Ring


@dataclass(frozen=True)
class Heads:
    """The head group of the all-to-all: its process group (None with one rank), its global
    ranks in cp order, this rank's index, and the all-to-all algorithm
    (``comm.ALL_TO_ALL_ALGORITHMS``; ``parallel.all_to_all``)."""

    group: Any = None
    ranks: tuple[int, ...] = (0,)
    rank: int = 0
    algorithm: str = "native"

    @property
    def size(self) -> int:
        """Ranks in the head group (the all-to-all degree A)."""
        return len(self.ranks)


def _swap(send: torch.Tensor, heads: Heads) -> torch.Tensor:
    """(A, ...) -> (A, ...): block j to index j of ``heads``, block i from index i."""
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group=heads.group, algorithm=heads.algorithm,
                           check=False)
    return recv


def _to_sequence(xs: tuple[torch.Tensor, ...], heads: Heads) -> tuple[torch.Tensor, ...]:
    """Each (B, H, T, D) -> (B, H / A, A T, D), in one all-to-all: my heads of every rank's
    tokens, rank-major (block j of every tensor side by side, to rank j)."""
    n = heads.size
    sends = [x.reshape(x.shape[0], n, x.shape[1] // n, *x.shape[2:]).transpose(0, 1)
             .reshape(n, -1) for x in xs]  # (A, B H/A T D) each
    recv = _swap(torch.cat(sends, dim=1), heads)
    out, at = [], 0
    for x, s in zip(xs, sends):
        B, H, T, D = x.shape
        part = recv[:, at:at + s.shape[1]].reshape(n, B, H // n, T, D)
        out.append(part.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * T, D))
        at += s.shape[1]
    return tuple(out)


def _to_heads(ys: tuple[torch.Tensor, ...], heads: Heads) -> tuple[torch.Tensor, ...]:
    """Each (B, H / A, A T, D) -> (B, H, T, D), in one all-to-all: the inverse of
    ``_to_sequence``."""
    n = heads.size
    sends = [y.reshape(y.shape[0], y.shape[1], n, y.shape[2] // n, y.shape[3])
             .permute(2, 0, 1, 3, 4).reshape(n, -1) for y in ys]  # (A, B h T D) each
    recv = _swap(torch.cat(sends, dim=1), heads)
    out, at = [], 0
    for y, s in zip(ys, sends):
        B, h, nT, D = y.shape
        part = recv[:, at:at + s.shape[1]].reshape(n, B, h, nT // n, D)
        out.append(part.transpose(0, 1).reshape(B, n * h, nT // n, D))
        at += s.shape[1]
    return tuple(out)


class HeadsToSequence(torch.autograd.Function):
    """One all-to-all forward (each (B, H, T, D) -> (B, H / A, A T, D), ``_to_sequence``:
    q, k and v together), its inverse backward (Jacobs et al. 2023, section 3.1)."""

    @staticmethod
    def forward(ctx, heads: Heads, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each (B, H, T, D) -> (B, H / A, A T, D)."""
        ctx.heads = heads
        return _to_sequence(xs, heads)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        """The inverse all-to-all on the gradients (an unused output's: zeros), one call."""
        return (None, *_to_heads(grads, ctx.heads))


class SequenceToHeads(torch.autograd.Function):
    """All-to-all forward ((B, H / A, A T, D) -> (B, H, T, D), ``_to_heads``), its inverse
    backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, heads: Heads) -> torch.Tensor:
        """(B, H / A, A T, D) -> (B, H, T, D)."""
        ctx.heads = heads
        return _to_heads((y,), heads)[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """The inverse all-to-all on the gradient."""
        return _to_sequence((grad,), ctx.heads)[0], None


@functools.lru_cache(maxsize=64)
def _order(n: int, c: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    order = ring_order(n, c, device)
    return order, torch.argsort(order)


def ring_order(n: int, c: int, device=None) -> torch.Tensor:
    """(2 n c,) int64: the gathered tokens (member j's chunks j-first then j-second, c tokens
    each, members in order) reordered to the ring's layout: every member's first chunk in
    order, then their second chunks in reverse order (module docstring)."""
    first = [torch.arange(j * 2 * c, j * 2 * c + c, device=device) for j in range(n)]
    second = [torch.arange(j * 2 * c + c, (j + 1) * 2 * c, device=device)
              for j in reversed(range(n))]
    return torch.cat(first + second)


_LOCAL = {}  # document ids -> the shard of whole sequences local attention reads (masks kept)


def _local_shard(documents: torch.Tensor | None) -> sequence.SequenceShard | None:
    """The shard local attention runs under: none (whole sequences), or one carrying the
    document ids, the same object for every layer of a micro-batch (its masks shared)."""
    if documents is None:
        return None
    from torch.utils.weak import WeakIdKeyDictionary

    kept = _LOCAL.setdefault("kept", WeakIdKeyDictionary())
    shard = kept.get(documents)
    if shard is None:
        shard = kept[documents] = sequence.SequenceShard(documents=documents)
    return shard


def check_heads(H: int, Hkv: int, a2a: int) -> str | None:
    """Why ``H`` query and ``Hkv`` key/value heads (a tensor-parallel rank's) cannot be split
    over ``a2a`` ranks, or None."""
    if H % a2a:
        return f"{H} query heads per tensor-parallel rank are not divisible by {a2a}"
    if Hkv % a2a and a2a % Hkv:
        return (f"{Hkv} key/value heads per tensor-parallel rank neither divide nor are "
                f"divisible by {a2a}")
    return None


@torch.compiler.disable  # collectives run eagerly: a compiled block breaks here
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: Heads,
                      ring: Ring, *, local: Callable[..., torch.Tensor] | None = None,
                      dropout_p: float = 0.0, impl: str = "sdpa",
                      window: int | None = None, scale: float | None = None,
                      documents: torch.Tensor | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """Causal attention over the whole sequence from this rank's shard of it, by all-to-all
    over ``heads`` (A ranks) then, with a ``ring`` of R > 1 ranks, ring attention across.

    ``q`` (B, H, T_local, D), ``k`` and ``v`` (B, Hkv, T_local, D(v)): this rank's tokens in
    the load-balanced layout over all A R cp ranks. ``local``: the single-process attention
    run on the whole sequence when R = 1, ``(q, k, v, dropout_p, impl, window=, scale=,
    softcap=)`` under the shard of ``documents`` (``models.gpt.causal_attention``'s
    signature). ``window``, ``scale``, ``documents`` ((B, T) ids of the whole sequences)
    and ``softcap`` as its (a soft cap only with R = 1). Returns (B, H, T_local, Dv). Collective over ``heads`` and ``ring``.
    ``ValueError`` (one line) for attention dropout, heads A does not split, or a soft cap
    with a ring."""
    if dropout_p > 0.0:
        raise ValueError(f"all-to-all attention: dropout_p={dropout_p}: attention dropout is "
                         "not supported under context parallelism; set model.dropout = 0")
    n = heads.size
    why = check_heads(q.shape[1], k.shape[1], n)
    if why:
        raise ValueError(f"parallel.cp_a2a={n}: {why}")
    if local is None and ring.size == 1:
        raise ValueError("all-to-all attention: no local attention to run on the whole "
                         "sequence (models.gpt.causal_attention passes itself as local)")
    if softcap is not None and ring.size > 1:
        raise ValueError(f"model.attn_logit_softcapping={softcap} with a ring of {ring.size}: "
                         "ring attention's block kernels have no soft cap; use "
                         "parallel.cp_comm = \"all_to_all\"")
    B, H, T, D = q.shape
    if k.shape[1] < n:  # fewer key/value heads than ranks: repeat each (DeepSpeed)
        k, v = (t.repeat_interleave(n // k.shape[1], dim=1) for t in (k, v))
    order, back = _order(n, T // 2, q.device)
    qs, ks, vs = (t.index_select(2, order) for t in HeadsToSequence.apply(heads, q, k, v))
    if ring.size > 1:
        y = ring_attention(qs, ks, vs, ring, causal=True, impl=impl, window=window,
                           scale=scale, documents=documents)
    else:
        with sequence.use(_local_shard(documents)):
            y = local(qs, ks, vs, 0.0, impl, window=window, scale=scale, softcap=softcap)
    return SequenceToHeads.apply(y.index_select(2, back), heads)  # (B, H, T_local, Dv)
