"""The attention calls the engine makes at cp = 1, as the planner prices them.

``models.gpt.causal_attention`` runs a block's attention on s tokens as one of:

- no sliding window, or one of W >= s: one call over the whole (s, s) causal triangle,
  ``is_causal`` (a fused kernel that may skip the blocks above the diagonal, as
  FlashAttention-2's causal mode does), or, with document ids
  (``model.attention_mask = "block_causal"``), given the (B, 1, s, s) mask "same document
  and causal";
- a window of W < s: below 2W one call with the (s, s) band as its mask; from 2W on, the
  queries in chunks of c = ``models.gpt.window_chunk`` tokens, each one call against its
  keys [i c - W + 1, (i + 1) c), masked by its band (ANDed with the documents).

The planner prices the attention core as GEMMs at the rate of its count of FLOPs, and
counts PaLM's way (appendix B): the causal triangle whole, s keys a query
(``ModelSpec.attn_keys``, the FLOPs MFU counts), for a fused kernel given ``is_causal``
that scores about half of it. So a pair a fused kernel scores is priced ``FUSED_PAIR`` = 2
(of the counted pairs) wherever it runs: in a call given a mask, which scores every pair of
its call, and in the ring's boxes under cp (``simulate.attention_keys``); an attention that
writes its scores out (``ModelSpec.written_scores``: the math path, Gemma 2's soft cap) is
two GEMMs over every pair of its calls, masked or not, at 1 a pair. A query is then priced
against s keys in a plain causal block, 2 s in a whole call with document masks, and
2 P / s for P pairs scored by chunks (about 2 (c + W - 1), where MFU counts the band,
min(s, W)); written out, s and P / s.

Measured (``benchmarks/attention_pair_price.py``, ``attention_pair_price_results/``): on
the 2-core CPU, fp32, the same causal triangle given as a mask took 1.42, 1.55 and 2.21
times the ``is_causal`` call at T = 1024, 2048 and 4096, forward and backward: the fused
kernel's skipping pays more as T grows, toward the 2 priced (shorter sequences are priced
high). On CUDA, where FlashAttention-2 skips the blocks above the diagonal and a mask rules
it out for the memory-efficient kernel, the ratio is to be measured (the script takes
``--device cuda``).

A written-out attention (``ModelSpec.written_scores``) keeps its calls' scores: P per head
a block, s^2 for a whole call. The masks (``models.gpt._mask``): SDPA keeps an additive mask
in the activations' dtype (e bytes an element), the written-out scores a bool one (1); the
engine builds each distinct mask once and shares it while a graph holds it, so a
micro-batch keeps one document mask per distinct (window, chunk) of its blocks
(``block_causal``: P elements a sequence, s^2 for a whole call), and, without documents,
the process one band per chunk shape (and, written out, the causal triangle) for all its
micro-batches. Built under ``no_grad`` by a recomputed forward, a mask is kept only while
its chunk's backward runs: one micro-batch's. Not priced: under context parallelism, the
ring's per-block masks (rebuilt per block pair, none kept), and the rows CUDA pads to 16
elements (``models.gpt.MASK_ROW_ALIGN``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

FUSED_PAIR = 2.0
"""Price of a (query, key) pair a fused attention kernel scores, in PaLM's counted pairs:
an ``is_causal`` call scores about half of the s^2 it is counted for (module docstring)."""


@dataclass(frozen=True)
class AttentionCalls:
    """The engine's attention at cp = 1 on s tokens (module docstring), per block averaged
    over the model's blocks unless said otherwise."""

    priced_keys: float
    """Keys a query is priced against (s for a plain causal block)."""
    written_keys: float
    """Scores a query writes per head when the attention writes its scores out."""
    document_mask: float
    """Elements of the document masks one sequence of a micro-batch keeps, over all blocks
    (each distinct mask once); 0 without documents."""
    shared_mask: float
    """Elements of the masks kept once for every micro-batch: without documents, the window
    bands (one per chunk shape) and, written out, the causal triangle."""
    mask_bytes: int | None
    """Bytes a mask element takes: 1 (bool) written out; None: the activations' (SDPA's
    additive mask)."""


def _chunks(s: int, w: int) -> list[tuple[int, int, int]]:
    """The engine's calls of a window of ``w`` < ``s`` tokens: (queries, keys, first key's
    offset behind the first query) per call (``models.gpt._windowed``)."""
    from shardwise.models.gpt import window_chunk  # the engine's own rule

    c = window_chunk(s, w)
    calls = []
    for start in range(0, s, c):
        end, first = min(start + c, s), max(0, start - w + 1)
        calls.append((end - start, end - first, start - first))
    return calls


@lru_cache(maxsize=1024)
def attention_calls(s: int, windows: tuple, documents: bool, written: bool) -> AttentionCalls:
    """``AttentionCalls`` of blocks with sliding windows ``windows`` (one per block, None:
    none; (): no block has one) on ``s`` tokens, with document masks or not, the scores
    written out or a fused kernel."""
    priced = scores = 0.0
    docs, shared = {}, {}
    for w in windows or (None,):
        if w is None or w >= s:  # one call over the whole triangle
            pairs, masked = s * s, documents
            if documents:
                docs[None] = s * s
            elif written:  # the written-out scores' causal triangle
                shared[(s, s, 0, None)] = s * s
        else:
            calls = _chunks(s, w)
            pairs, masked = sum(q * k for q, k, _ in calls), True
            docs[w] = pairs
            for q, k, off in calls:
                shared[(q, k, off, w)] = q * k
        priced += pairs / s * (FUSED_PAIR if masked and not written else 1.0)
        scores += pairs / s
    n = len(windows) or 1
    return AttentionCalls(priced / n, scores / n,
                          float(sum(docs.values())) if documents else 0.0,
                          0.0 if documents else float(sum(shared.values())),
                          1 if written else None)
