"""Which tokens of each sequence a model's layers see, and how their attention reaches the rest.

One process sees whole sequences: token ``t`` sits at position ``t``, and attention reads
every key. Under context parallelism (``parallel.cp > 1``) a rank holds only some chunks of
every sequence (``parallel.context.sharding``: chunks ``i`` and ``2cp-1-i``), so a model must
not assume ``arange(T)``: it asks ``positions(T, device)`` for the true positions of the
tokens it holds (the learned position table of the GPT, the rotary angles of the Llama), and
its attention goes through ``models.gpt.causal_attention``, which hands the call to
``current().attention`` (ring attention) when one is set. A layer that needs a statistic of
whole sequences (the mixture of experts' load-balancing loss counts the tokens each expert
took in a sequence) sums its own tokens' share with ``sequence_total``.

The engine sets a ``SequenceShard`` around each forward of its pipeline chunks (``use``, a
context manager on a ``contextvars.ContextVar``: per thread, nothing left behind after an
exception), as ``torch.autocast`` sets a dtype; with none set, the two functions are the
single-process ones. A model that reads positions and attends this way says so in its
description (``ModelDescription.context_parallel``); the engine refuses ``cp > 1`` for any
other (its positions would be silently wrong). Sources: torchtitan's ``context_parallel``
(which shards the rotary buffer and swaps ``scaled_dot_product_attention`` for the run of
a context manager) and Megatron-LM's ``get_pos_emb_on_this_cp_rank``.

Packed sequences (``model.attention_mask = "block_causal"``): a shard may also carry the
document id of every token of each micro-batch's sequences (``documents``, from
``document_ids``: the end-of-text token closes its document), and ``causal_attention`` then
lets a token attend only to earlier tokens of its own document (Llama 3, Grattafiori et al.
2024, arXiv:2407.21783, sec. 3.2; torchtitan's ``attn_mask_type = "block_causal"``). The
engine sets one shard per micro-batch around every forward of its chunks on every pipeline
stage (``engine.Engine``), so no layer takes a new argument.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SequenceShard:
    """The tokens of each sequence this rank holds, and its attention over all of them
    (context parallelism sets one per micro-batch with ``use``). Each field is described
    where it is declared; the default shard is whole sequences on one rank."""

    # (T_local,) int64: the position in the whole sequence of each local token, in local
    # order (not sorted: chunk i then chunk 2cp-1-i); None: whole sequences (arange(T))
    positions: torch.Tensor | None = None
    # (q, k, v, dropout_p, impl, window, scale, documents, softcap, local) -> out over
    # (B, H, T_local, D)
    # tensors, causal over the whole sequence, within a sliding window of ``window`` tokens
    # of it when that is not None, the scores scaled by ``scale`` (None: 1 / sqrt(D)),
    # within documents when ``documents`` is not None, soft-capped by ``softcap`` when not
    # None (ring or all-to-all attention bound to its groups; ``local``: the caller's
    # single-process attention, which the all-to-all runs on whole sequences);
    # None: the single-process kernel
    attention: Callable[..., torch.Tensor] | None = None
    # t -> t, summing a tensor of per-sequence statistics over the ranks holding the other
    # tokens of the same sequences, in place (an all-reduce over the cp group; no
    # gradient); None when this rank holds whole sequences
    total: Callable[[torch.Tensor], torch.Tensor] | None = None
    # (B, T) int64: the document id of every token of the whole sequences of this forward's
    # micro-batch (document_ids; not sharded over cp: a rank reads its own tokens' at
    # ``positions``); None: one document per sequence (plain causal). Read, never written
    # in place: the masks built from it are kept (``masks``)
    documents: torch.Tensor | None = None
    # not a constructor argument: the attention masks built from ``documents``
    # (shared_mask), weakly: the layers, query chunks and recomputation of this micro-batch
    # take the same tensor while any of them (an autograd graph that saved it) still holds
    # it. A new shard (dataclasses.replace) starts empty
    masks: weakref.WeakValueDictionary = field(
        default_factory=weakref.WeakValueDictionary, init=False, repr=False, compare=False)


_CURRENT: contextvars.ContextVar[SequenceShard | None] = contextvars.ContextVar(
    "shardwise_sequence_shard", default=None)
# whether any ``use`` has set a shard in this process. Until one has, ``current`` answers
# None without reading the ContextVar: torch.compile cannot trace ``ContextVar.get`` (a
# graph break in every attention and rotary layer) but reads a module's bool under a guard,
# so a compiled block of a single-process, plain causal run is one graph. Never reset: a
# context copied for a later recomputation (``parallel.activation_checkpoint``) or another
# thread may still hold a shard
_SHARDED = False


def current() -> SequenceShard | None:
    """The shard set by the innermost ``use``, or None (whole sequences)."""
    if not _SHARDED:
        return None
    return _CURRENT.get()


@contextlib.contextmanager
def use(shard: SequenceShard | None) -> Iterator[None]:
    """Within the block, ``positions`` and ``causal_attention`` follow ``shard`` (None:
    whole sequences, even inside an outer ``use``)."""
    global _SHARDED
    _SHARDED = _SHARDED or shard is not None
    token = _CURRENT.set(shard)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def positions(T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(T,) int64 positions of the ``T`` tokens a layer holds: ``arange(T)`` for whole
    sequences, the shard's ``positions`` under context parallelism. Raises ``ValueError``
    when a shard is set and holds another number of tokens (a layer that split the sequence
    itself, e.g. one running after a sequence-parallel scatter, must slice them further)."""
    shard = current()
    if shard is None or shard.positions is None:
        return torch.arange(T, device=device)
    if shard.positions.numel() != T:
        raise ValueError(f"models.sequence.positions: a layer asked for {T} positions, but "
                         f"this context-parallel rank holds {shard.positions.numel()} tokens "
                         "of each sequence")
    return shard.positions.to(device)


def sequence_total(t: torch.Tensor) -> torch.Tensor:
    """``t`` (S, ...): statistics of this rank's tokens of each of S sequences (counts, sums),
    summed over every rank holding tokens of those sequences: ``t`` itself for whole
    sequences, the shard's ``total`` (the same tensor, reduced over the cp ranks) under
    context parallelism. No gradient flows through the sum; every rank holding the
    sequences must call it at the same point of its forward (a collective)."""
    shard = current()
    if shard is None or shard.total is None:
        return t
    return shard.total(t)


def document_ids(idx: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) int64 token ids of packed sequences -> (B, T) int64 document ids: 0 for the
    tokens up to and including the first ``eos_id``, 1 up to and including the second, ...
    The end-of-text token closes its document (it is the last token the document's tokens
    predict from, as Llama 3 and torchtitan's ``block_causal`` mask count it): the id of
    token t is the number of separators strictly before it."""
    sep = (idx == eos_id).to(torch.int64)
    return torch.cumsum(sep, dim=1) - sep


@functools.lru_cache(maxsize=64)
def window_band(n_q: int, n_k: int, offset: int, window: int,
                device: torch.device) -> torch.Tensor:
    """(n_q, n_k) bool: the sliding window's band between ``n_q`` queries at positions
    ``offset + r`` and ``n_k`` keys at positions ``s``: True where ``0 <= offset + r - s <
    window`` (Mistral 7B, arXiv:2310.06825, sec. 2). ``models.gpt.sliding_window_mask(T, W)``
    is ``window_band(T, T, 0, W)``, a query chunk's (``models.gpt``) is (c, c + W - 1), and
    ring attention's block pairs take theirs here too. Kept per arguments (do not modify).
    """
    d = (offset + torch.arange(n_q, device=device)).unsqueeze(1) - torch.arange(
        n_k, device=device)  # (n_q, n_k): query position - key position
    return (d >= 0) & (d < window)


def document_mask(docs_q: torch.Tensor, docs_k: torch.Tensor) -> torch.Tensor:
    """(B, 1, Tq, Tk) bool, True where query i and key j are in the same document, from
    their document ids ``docs_q`` (B, Tq) and ``docs_k`` (B, Tk); the heads' axis broadcasts.
    Causality and windows are ANDed by the caller. B Tq Tk bytes."""
    return (docs_q.unsqueeze(-1) == docs_k.unsqueeze(-2)).unsqueeze(1)


# the masks that depend on no document ids (a window's band, the causal triangle), per
# (shape, offset, window, device, form), weakly, as ``SequenceShard.masks``: shared by every
# layer and query chunk whose autograd graph still holds one, gone with the last of them
_MASKS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def shared_mask(shard: SequenceShard | None, key: Hashable,
                build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``build()``, an attention mask that ``key`` determines, or the tensor an earlier call
    with the same ``key`` built, while something still holds it: an autograd graph saves a
    mask for backward, so the L layers of a forward (and the chunks of a sliding window)
    keep one mask, not L. With the document ids of ``shard`` (``SequenceShard.documents``
    not None) the mask is the shard's (``SequenceShard.masks``: ``key`` need not name the
    documents); else the process's (``key`` must name all the mask depends on: shape,
    offset, window, device, dtype). Held weakly: nothing outlives its last user, so a
    forward under ``no_grad`` (inference, a recomputed chunk's first pass) builds its
    masks per layer as before, and nothing is kept between steps. While
    ``torch.compile`` traces, always ``build()``: the mask is then part of the graph (what
    its backward keeps is the compiler's choice); dynamo cannot trace a weak reference
    (a graph break per mask)."""
    if torch.compiler.is_compiling():
        return build()
    kept = _MASKS if shard is None or shard.documents is None else shard.masks
    mask = kept.get(key)
    if mask is None:
        mask = kept[key] = build()
    return mask
