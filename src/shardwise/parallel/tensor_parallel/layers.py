"""Column-parallel and row-parallel linear layers and the vocab-parallel embedding.

Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053, section 3). For ``y = x W^T + b`` with
``W`` of shape (out, in):

- ``ColumnParallelLinear`` splits W by output features: rank r holds rows
  ``[r*out/N, (r+1)*out/N)`` and the matching slice of b; its input is replicated (``f``:
  identity forward, all-reduce of the input gradient backward), its output is split along
  the last dim unless ``gather_output``.
- ``RowParallelLinear`` splits W by input features: rank r holds columns
  ``[r*in/N, (r+1)*in/N)``; its input is split along the last dim (``input_is_parallel``,
  else it is scattered here), partial outputs are summed (``g``: all-reduce forward), and
  the bias, replicated, is added once after the sum.
- ``VocabParallelEmbedding`` splits the table by vocabulary rows; ids outside this rank's
  range look up zeros, and the sum over ranks (``g``) completes every row.

With ``tp.sequence_parallel`` (Korthikanti et al. 2022, arXiv:2205.05198) the replicated
input of a column layer arrives split along the sequence and is all-gathered, and the
all-reduce after a row layer / the embedding becomes a reduce-scatter along the sequence.

Every layer is initialised from the full unsharded layer (``master``, or one built here
from the current RNG exactly as ``nn.Linear`` / ``nn.Embedding`` would), so a sharded model
equals, slice for slice, the unsharded model built from the same seed. Sharded parameters
carry ``tp_dim`` (the dim they are split along); replicated ones do not.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise import comm
from shardwise.parallel.lora import delta as lora_delta
from shardwise.parallel.lora import has_lora
from shardwise.parallel.tensor_parallel.group import RankGroup
from shardwise.parallel.tensor_parallel.mappings import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    linear_reduce,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
)


def shard_tensor(full: torch.Tensor, dim: int, tp: RankGroup) -> torch.Tensor:
    """This rank's contiguous 1/N slice of ``full`` along ``dim`` (a copy)."""
    n = tp.shard(full.shape[dim], f"size of dim {dim}")
    return full.detach().narrow(dim, tp.rank * n, n).clone().contiguous()


@torch.no_grad()
def gather_tensor(local: torch.Tensor, dim: int, tp: RankGroup) -> torch.Tensor:
    """Concatenate every rank's ``local`` along ``dim`` in rank order (no autograd)."""
    if tp.size == 1:
        return local.detach().clone()
    out = torch.empty((tp.size,) + tuple(local.shape), dtype=local.dtype, device=local.device)
    comm.all_gather_into_tensor(out, local.detach().contiguous(), group=tp.group,
                                algorithm=tp.gather)
    return torch.cat(out.unbind(0), dim=dim)


def _sharded(t: torch.Tensor, dim: int) -> nn.Parameter:
    p = nn.Parameter(t)
    p.tp_dim = dim  # marks a sharded parameter (grad norms, gathering, checkpoints)
    return p


def enter_region(x: torch.Tensor, tp: RankGroup, tag: str = "") -> torch.Tensor:
    """A column-parallel region's input communication: f (identity forward, all-reduce
    backward), or under sequence parallelism the all-gather of the sequence (B, T / N, C)
    -> (B, T, C)."""
    if tp.sequence_parallel:
        return gather_from_sequence(x, tp, tag=tag)
    return copy_to_region(x, tp, tag=tag)


class ColumnParallelLinear(nn.Module):
    """Linear layer with W split by output features. (..., in) -> (..., out / N), or
    (..., out) with ``gather_output``. Under sequence parallelism the input is
    (B, T / N, in) and is all-gathered along the sequence first.

    ``enters=False``: the input has already entered the region (an enclosing module called
    ``enter`` once for several column layers reading it: Q, K and V). Raises ValueError
    (naming the size) when ``out_features`` is not divisible by tp.
    """

    def __init__(self, in_features: int, out_features: int, tp: RankGroup, bias: bool = True,
                 gather_output: bool = False, master: nn.Linear | None = None,
                 tag: str = "column", enters: bool = True):
        super().__init__()
        self.tp, self.gather_output, self.tag, self.enters = tp, gather_output, tag, enters
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = tp.shard(out_features, f"{tag}: out_features")
        master = master if master is not None else nn.Linear(in_features, out_features, bias)
        self.weight = _sharded(shard_tensor(master.weight, 0, tp), 0)    # (out / N, in)
        self.bias = (_sharded(shard_tensor(master.bias, 0, tp), 0)       # (out / N,)
                     if bias and master.bias is not None else None)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The input's communication (``enter_region``). Layers that share one input (Q, K,
        V) call it once and then ``local`` for each."""
        return enter_region(x, self.tp, self.tag)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output columns, no communication. (..., in) -> (..., out / N); plus a
        LoRA adapter's, B split as W (``parallel.lora``)."""
        y = F.linear(x, self.weight, self.bias)
        return y + lora_delta(self, x) if has_lora(self) else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., in)`` -> ``(..., out / N)`` (``gather_output``: ``(..., out)``); the input enters
        the region first unless another layer already did (``enters``)."""
        y = self.local(self.enter(x) if self.enters else x)      # (..., out / N)
        return gather_from_region(y, self.tp, tag=self.tag) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Linear layer with W split by input features. (..., in / N) with
    ``input_is_parallel`` (else (..., in), scattered here) -> (..., out); under sequence
    parallelism the output is (B, T / N, out).

    ``reduces=False``: the output stays this rank's partial sum, (..., out) unreduced (an
    enclosing module reduces it once for several partial sums: a mixture of experts under
    sequence parallelism, ``plan``'s "moe" style); then no bias.

    Raises ValueError (naming the size) when ``in_features`` is not divisible by tp, or for
    a bias with ``reduces=False``.
    """

    def __init__(self, in_features: int, out_features: int, tp: RankGroup, bias: bool = True,
                 input_is_parallel: bool = False, master: nn.Linear | None = None,
                 tag: str = "row", reduces: bool = True):
        super().__init__()
        self.tp, self.input_is_parallel, self.tag, self.reduces = tp, input_is_parallel, tag, reduces
        if not reduces and bias and (master is None or master.bias is not None):
            raise ValueError(f"{tag}: a row-parallel layer whose partial sums an enclosing "
                             "module reduces cannot add a bias")
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = tp.shard(in_features, f"{tag}: in_features")
        master = master if master is not None else nn.Linear(in_features, out_features, bias)
        self.weight = _sharded(shard_tensor(master.weight, 1, tp), 1)    # (out, in / N)
        # replicated, added once after the reduction
        self.bias = (nn.Parameter(master.bias.detach().clone())
                     if bias and master.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., in / N)`` (or ``(..., in)``, scattered first) -> ``(..., out)``: partial sums
        all-reduced, or reduce-scattered over the sequence ``(B, T / N, out)`` with sequence
        parallelism; bias added after."""
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.tp, tag=self.tag)      # (..., in / N)
        adapter = has_lora(self)
        if self.reduces and self.tp.size > 1 and comm.replay.active() and not adapter:
            # selective recomputation: keep the reduced output only, not the partial sums
            y = linear_reduce(x, self.weight, self.tp, tag=self.tag)
            return y if self.bias is None else y + self.bias
        y = F.linear(x, self.weight)                             # partial sums (..., out)
        if adapter:  # a LoRA adapter's partial sum too, A split as W (parallel.lora)
            y = y + lora_delta(self, x)
        if not self.reduces:
            return y
        if self.tp.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.tp, tag=self.tag)  # (B, T / N, out)
        else:
            y = reduce_from_region(y, self.tp, tag=self.tag)
        return y if self.bias is None else y + self.bias


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The smallest multiple of ``tp_size`` >= ``vocab_size``."""
    return -(-vocab_size // tp_size) * tp_size


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows. (B, T) int64 -> (B, T, dim), or
    (B, T / N, dim) under sequence parallelism.

    A vocabulary not divisible by tp is padded with zero rows up to ``padded_vocab_size``;
    no id ever looks them up, so they change nothing. Rank r holds padded rows
    ``[vocab_start, vocab_end)``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: RankGroup,
                 master: nn.Embedding | None = None, tag: str = "vocab_embedding"):
        super().__init__()
        self.tp, self.tag = tp, tag
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padded = padded_vocab_size(num_embeddings, tp.size)
        per = self.padded // tp.size
        self.vocab_start, self.vocab_end = tp.rank * per, (tp.rank + 1) * per
        master = master if master is not None else nn.Embedding(num_embeddings, embedding_dim)
        full = torch.zeros(self.padded, embedding_dim, dtype=master.weight.dtype,
                           device=master.weight.device)  # meta when built on meta
        full[:num_embeddings] = master.weight.detach()
        self.weight = _sharded(shard_tensor(full, 0, tp), 0)     # (V_pad / N, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` -> ``(B, T, dim)``: ids outside this rank's vocabulary slice give
        zeros, then all-reduced (reduce-scattered to ``(B, T / N, dim)`` with sequence parallelism).
        """
        if self.tp.size == 1:
            return F.embedding(idx, self.weight)
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        y = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.tp.sequence_parallel:
            return reduce_scatter_to_sequence(y, self.tp, tag=self.tag)  # (B, T / N, dim)
        return reduce_from_region(y, self.tp, tag=self.tag)              # (B, T, dim)
