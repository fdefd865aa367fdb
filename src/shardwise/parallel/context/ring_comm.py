"""Where ring attention talks to the network: one shift around the cp ring, or one direct
hop, through comm.

Every step of ring attention passes blocks one hop around the ring of context-parallel ranks
(Liu et al. 2023, "Ring Attention with Blockwise Transformers", arXiv:2310.01889, figure 2):
each rank sends what it holds to the next rank and receives the previous rank's, in one
``shardwise.comm.exchange`` (every receive and send of the round posted together, so no rank
waits for its neighbour to finish sending first; counted as "sendrecv" by comm's accounting).
The exchange is posted asynchronously, on comm's FIFO thread, so the caller computes on the
block it holds while the next one travels, and waits only when it needs it. ``hop`` is the
direct form a sliding window takes when some ranks need no block of some others
(``ring_attention.kv_transfers``): this rank's tensors to the rank ``h`` places on and,
independently, as many from the rank ``h`` places back, either half left out where not
needed (no call when both are). ``total`` is the ring's one other call: a per-sequence
statistic summed over its ranks (the mixture of experts' token counts per expert,
``models.moe.load_balancing_loss``).

Under selective recomputation (``parallel.activation_checkpoint``) a layer's collectives are
recorded in forward and replayed when it is recomputed (``comm.replay``), but the shifts run
again (``comm.replay.run_again``), and so do the hops: keeping the blocks a rank receives
would hold up to cp - 1 key/value blocks per layer, while in the recomputation they only
feed attention kernels whose outputs are kept. Every rank of the ring recomputes the same
layer at the same point of backward, so the transfers run again in the same order on all.
``total`` is replayed (its (S, E) counts are small).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardwise import comm


@dataclass(frozen=True)
class Ring:
    """The context-parallel ranks of this rank's ring.

    group: their ``torch.distributed`` process group (None with one rank).
    ranks: their global ranks, in ring (cp coordinate) order; ``rank``: this rank's index.
    """

    group: Any = None
    ranks: tuple[int, ...] = (0,)
    rank: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < len(self.ranks):
            raise ValueError(f"Ring: index {self.rank} outside a ring of {len(self.ranks)} ranks")

    @property
    def size(self) -> int:
        """Ranks in the ring."""
        return len(self.ranks)

    @property
    def next(self) -> int:
        """Global rank this rank sends to."""
        return self.ranks[(self.rank + 1) % self.size]

    @property
    def prev(self) -> int:
        """Global rank this rank receives from."""
        return self.ranks[(self.rank - 1) % self.size]

    def source(self, step: int) -> int:
        """Ring index of the rank whose block this rank holds after ``step`` shifts."""
        return (self.rank - step) % self.size

    @torch.compiler.disable  # a collective: a compiled layer (the MoE's counts) breaks here
    def total(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ring's ranks, in place (one ``comm.all_reduce``, blocking;
        no autograd). Returns ``t``. Every rank of the ring must call it."""
        if self.size > 1:
            comm.all_reduce(t, group=self.group, check=False)
        return t

    def shift(self, tensors: Sequence[torch.Tensor]):
        """Send ``tensors`` to the next rank and receive as many, shaped alike, from the
        previous one, asynchronously. Returns ``(received, handle)``: ``received`` holds the
        data once ``handle.wait()`` returned; ``tensors`` must not change before then."""
        sends = [t.contiguous() for t in tensors]
        recvs = [torch.empty_like(t) for t in sends]
        with comm.replay.run_again():  # recomputed, the ring travels again (module docstring)
            handle = comm.exchange([(t, self.next) for t in sends],
                                   [(r, self.prev) for r in recvs], group=self.group,
                                   async_op=True)
        return recvs, handle

    def hop(self, tensors: Sequence[torch.Tensor], distance: int, send: bool,
            receive: bool):
        """One direct transfer ``distance`` places round the ring, asynchronously: ``tensors``
        to ring index ``rank + distance`` (when ``send``), and as many, shaped alike, from
        ``rank - distance`` (when ``receive``; indices mod the size), in one
        ``comm.exchange``. Returns ``(received or None, handle)``, the handle None when
        there is nothing to do (no call is made). ``tensors`` must not change before
        ``handle.wait()`` returned. The caller guarantees that the peers post the matching
        halves in the same order (``ring_attention._Routes``: one schedule of hops for all
        ranks)."""
        if not (send or receive):
            return None, None
        sends = [t.contiguous() for t in tensors]
        recvs = [torch.empty_like(t) for t in sends] if receive else []
        dst = self.ranks[(self.rank + distance) % self.size]
        src = self.ranks[(self.rank - distance) % self.size]
        with comm.replay.run_again():  # as ``shift``'s, recomputed blocks travel again
            handle = comm.exchange([(t, dst) for t in sends] if send else [],
                                   [(r, src) for r in recvs], group=self.group,
                                   async_op=True)
        return recvs or None, handle
