"""Context parallelism applied to a model's pipeline chunks: the engine's one object for cp.

``ContextParallel(ring)`` is this rank's place on the ring of cp ranks; with ``heads`` (an
all-to-all group, ``ulysses``) attention is DeepSpeed-Ulysses' all-to-all over it, then ring
attention on ``ring`` when the ring has more than one rank (the hybrid), and ``whole`` is
all the cp ranks (the ring's when not given). The engine

1. cuts every batch it trains or evaluates on (``shard``): token ids and targets (B, T) ->
   (B, T / cp), chunks ``i`` and ``2cp-1-i`` of each sequence (``sharding``);
2. holds that shard (``current``, a ``models.sequence.SequenceShard``), which the engine
   sets around every forward of its chunks (recomputation included; the executor does it
   per micro-batch, adding the document ids of packed sequences), so the model reads the
   true positions of its tokens, attends through ``ring_attention`` on this ring and sums
   per-sequence statistics over it (``sequence.sequence_total``: the MoE's token counts
   per expert). Nothing of the model is replaced: a model that reads positions and attends
   through ``models.sequence`` and ``models.gpt.causal_attention``
   (``ModelDescription.context_parallel``) is ready;
3. folds cp into the gradient sync's group (``topology.dp_cp``): the cp ranks hold the same
   parameters and each computed the gradient of its own tokens' loss (the mean over its
   T / cp tokens of each sequence), so averaging over dp x cp gives the gradient of the mean
   over all tokens (every rank holds the same number of tokens).

Generation sets no shard: each cp rank then runs whole sequences of any length, its weights
being whole.
"""

from __future__ import annotations

import torch

from shardwise.models import sequence
from shardwise.parallel.context.ring_attention import ring_attention
from shardwise.parallel.context.ring_comm import Ring
from shardwise.parallel.context.sharding import check_length, local_positions, shard_sequence
from shardwise.parallel.context.ulysses import Heads, ulysses_attention


class ContextParallel:
    """This rank's shard of every sequence and its ring (see module docstring).

    ``ring``: the ranks ring attention passes K/V around (``ring_comm.Ring``); ``heads``:
    the all-to-all's head group (``ulysses.Heads``) or None (ring attention only);
    ``whole``: every cp rank, as a ``Ring`` (for ``total`` and the layout; default
    ``ring``). ``device``: where positions live.
    """

    def __init__(self, ring: Ring, device: torch.device | str = "cpu",
                 heads: Heads | None = None, whole: Ring | None = None):
        self.ring, self.device, self.heads = ring, torch.device(device), heads
        self.whole = ring if whole is None else whole
        self.size, self.rank = self.whole.size, self.whole.rank
        self.current: sequence.SequenceShard | None = None
        self._shards: dict[int, sequence.SequenceShard] = {}

    def check(self, T: int) -> None:
        """``ValueError`` (one line) unless ``T`` is divisible by ``2 cp``."""
        check_length(T, self.size)

    def shard(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's tokens of each (B, T, ...) tensor along dim 1 (``shard_sequence``),
        and the shard of length T made current for the chunks' next forwards."""
        T = tensors[0].shape[1]
        self.current = self._shard_of(T)
        return tuple(shard_sequence(t, self.size, self.rank, dim=1) for t in tensors)

    def _shard_of(self, T: int) -> sequence.SequenceShard:
        if T not in self._shards:
            ring, heads = self.ring, self.heads

            def attention(q, k, v, dropout_p: float = 0.0, impl: str = "sdpa",
                          window: int | None = None, scale: float | None = None,
                          documents: torch.Tensor | None = None,
                          softcap: float | None = None, local=None):
                if heads is not None and heads.size > 1:
                    return ulysses_attention(q, k, v, heads, ring, local=local,
                                             dropout_p=dropout_p,
                                             impl=impl, window=window, scale=scale,
                                             documents=documents, softcap=softcap)
                # refused at the door (the [model] section's context_parallel_refusal)
                assert softcap is None, "ring attention's block kernels have no soft cap"
                return ring_attention(q, k, v, ring, causal=True, dropout_p=dropout_p,
                                      impl=impl, window=window, scale=scale,
                                      documents=documents)

            self._shards[T] = sequence.SequenceShard(
                local_positions(T, self.size, self.rank, self.device), attention,
                self.whole.total)
        return self._shards[T]
