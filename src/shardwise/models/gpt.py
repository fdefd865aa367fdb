"""Decoder-only GPT from separable building blocks.

Token + learned position embedding, ``n_layer`` pre-LayerNorm blocks (causal multi-head
self-attention, then a GELU MLP, each inside a residual), a final LayerNorm and an LM head,
tied to the token embedding or not. Follows Radford et al. 2019 (GPT-2) with the
residual-projection init scaled by 1/sqrt(2 * n_layer).

The pieces are kept apart on purpose: attention has separate Q, K, V and output
projections (tensor parallelism splits Q/K/V by heads as column-parallel and the output as
row-parallel), the MLP is ``fc`` then ``proj`` (column then row), and the model is
``embed -> blocks[i] -> head`` so pipeline parallelism can cut it into stages by layer.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.base.model_config import ATTENTION_MASKS, GPTModelConfig, section_dataclass
from shardwise.models import sequence
from shardwise.models.sampling import DecoderLM, generate, sample_next  # noqa: F401 (re-exported)
from shardwise.models.sequence import window_band

# the MLP's GELU: exact (erf), or the tanh approximation of GPT-2 (F.gelu's "tanh")
ACTIVATIONS = {"gelu": "none", "gelu_tanh": "tanh"}


class GPTConfig(section_dataclass("_GPTFields", GPTModelConfig, (
        "block_size", "n_layer", "n_head", "n_embd", "dropout", "bias", "tie_weights",
        "attention", "activation", "k_bias", "norm_eps", "attention_mask"))):
    """Sizes of one GPT: the fields of ``base.model_config.GPTModelConfig`` (the ``[model]``
    section of ``model.kind = "gpt"``, each described there), ``vocab_size`` first and
    required, the first ones in the order callers may pass them by position
    (``GPTConfig(V, T, L, H, C)``). Raises ``ValueError`` (one line naming the field) for an
    unknown activation or mask, or a key bias without biases.
    """

    def __post_init__(self):
        if self.attention_mask not in ATTENTION_MASKS:
            raise ValueError(f"model.attention_mask={self.attention_mask!r}: expected "
                             f"{' or '.join(ATTENTION_MASKS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"model.activation={self.activation!r}: expected "
                             f"{' or '.join(ACTIVATIONS)}")
        if self.k_bias and not self.bias:
            raise ValueError("model.k_bias=true with model.bias=false: a key bias needs the "
                             "other biases too")



@functools.lru_cache(maxsize=16)
def sliding_window_mask(T: int, window: int, device: torch.device) -> torch.Tensor:
    """(T, T) bool, True where query ``i`` may attend to key ``j``: ``i - window < j <= i``,
    the causal band of a sliding window of ``window`` tokens, the query's own included
    (Beltagy et al. 2020, "Longformer", arXiv:2004.05150, sec. 3.1; Jiang et al. 2023,
    "Mistral 7B", arXiv:2310.06825, sec. 2: each layer attends to the previous W tokens;
    transformers' ``sliding_window_causal_mask_function``: ``kv_idx > q_idx - W`` and
    ``kv_idx <= q_idx``). Built once per (T, window, device) and kept: T^2 bytes."""
    return window_band(T, T, 0, window, device)


# Sliding windows at cp = 1 attend in query chunks of WINDOW_CHUNK tokens (at least W) once
# the sequence is WINDOW_CHUNKED_FROM windows long; below that, one call with the (T, T)
# band. Chosen from benchmarks/windowed_attention.py (docs/models.md, "Sliding windows").
WINDOW_CHUNK = 256
WINDOW_CHUNKED_FROM = 2


def window_chunk(T: int, window: int) -> int:
    """Queries per call of a sliding window of ``window`` tokens over T > window tokens:
    T (one call, the whole (T, T) band) below ``WINDOW_CHUNKED_FROM`` windows, else
    max(``window``, ``WINDOW_CHUNK``)."""
    return T if T < WINDOW_CHUNKED_FROM * window else max(window, WINDOW_CHUNK)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                     impl: str = "sdpa", window: int | None = None, scale: float | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """Causal softmax(Q K^T / sqrt(D)) V: ``q`` (B, H, T, D), ``k`` (B, Hkv, T, D) and ``v``
    (B, Hkv, T, Dv) with Hkv dividing H (grouped-query attention: key/value head j serves
    query heads j rep .. (j + 1) rep - 1, rep = H / Hkv, HF's ``repeat_kv``); Dv may differ
    from D (DeepSeek's latent attention); returns (B, H, T, Dv).

    ``scale``: the scores' factor in place of 1 / sqrt(D) (Gemma 2 and 3:
    ``query_pre_attn_scalar ** -0.5``); None: 1 / sqrt(D). ``softcap``: the scores S
    (after the scale) become ``softcap * tanh(S / softcap)`` before the mask and the
    softmax (Gemma 2's attention-logit soft cap, Gemma Team 2024, arXiv:2408.00118,
    sec. 2; transformers' ``eager_attention_forward`` of ``modeling_gemma2.py``, softmax in
    fp32). No fused kernel takes it, so with a cap the scores are written out (B, H, T, T),
    or per query chunk under a window, whatever ``impl`` says; not under context parallelism
    (the ring's block kernels have no cap: refused by the config).

    ``window``: a sliding window of W tokens (``sliding_window_mask``: query i sees keys
    i - W < j <= i), or None (every earlier key). With T <= W the window hides nothing and
    the plain causal kernel runs. With T > W the queries go in chunks of c tokens
    (``window_chunk``: c = T, one call, below 2W; else c = max(W, 256)): chunk [s, s + c)
    needs only keys [s - W + 1, s + c), so each chunk is one call against those keys with
    the (c, c + W - 1) band (``window_band``), and the outputs are concatenated; no
    log-sum-exp merge, every query's keys are inside its one call (Mistral 7B,
    arXiv:2310.06825, sec. 2; Longformer's banded attention, Beltagy et al. 2020, sec. 3.1,
    which computes the band in overlapping blocks the same way). Cost T (c + W - 1) scores
    instead of T^2, (c, c + W - 1) masks (see "Masks" below) and, written out,
    (B, H, c, c + W - 1) scores at a time instead of (B, H, T, T). The band is a mask, so
    on CUDA SDPA takes its memory-efficient kernel, not FlashAttention (which takes no
    mask). Dropout draws per chunk: the same distribution as one call's, other random
    numbers.

    ``impl="sdpa"``: ``F.scaled_dot_product_attention``, which on CUDA dispatches to
    FlashAttention-2 (Dao 2023) or memory-efficient attention (Rabe & Staats 2021) and never
    materialises the (T, T) scores; on the CPU it is a fused kernel of the same maths.
    ``impl="math"``: the scores written out (B, H, T, T), as in Vaswani et al. 2017; the
    baseline ``benchmarks/gpu_mfu.py`` measures fused attention against.

    Packed sequences (``model.attention_mask = "block_causal"``): when the current shard
    carries document ids (``SequenceShard.documents``, (B, T), set by the engine per
    micro-batch), a query sees only keys of its own document: the (B, 1, T, T) mask
    ``same document AND causal`` (AND the window's band, per chunk from the chunk's query
    and key ids) goes to SDPA or the written-out scores (on CUDA a mask rules out
    FlashAttention, SDPA takes its memory-efficient kernel). Without document ids nothing
    changes (``is_causal``, no mask).

    Masks, built once and shared (``_mask``, ``models.sequence.shared_mask``): SDPA takes
    an additive mask in q's dtype (0 where a query attends, -inf elsewhere: what it would
    make of a bool mask, afresh on every call), the written-out scores a bool one (True
    where hidden); both save it for backward. Every layer and query chunk that asks for the
    same mask (query and key ranges, window, dtype) gets the same tensor while an autograd
    graph holds it, so a micro-batch keeps each distinct mask once, not once per layer and
    chunk: under ``block_causal`` one (B, 1, T, T) mask, B T^2 x itemsize bytes (4 in fp32,
    2 in bf16, 1 written out), on the micro-batch's shard, or under a window one
    (B, 1, c, c + W - 1) per chunk; without document ids one band per chunk shape (the
    first chunk's, the later ones', a shorter last one's), (c, c + W - 1) x itemsize
    bytes, and the (T, T) triangle of the written-out scores (on CUDA an additive mask's
    rows are allocated in multiples of 16 elements, ``MASK_ROW_ALIGN``, so that the
    memory-efficient kernel does not pad a copy of it per call). Held weakly: nothing is kept
    after the graph that saved it is freed (a forward under ``no_grad`` builds per call).
    While ``torch.compile`` traces, masks are built in the graph, not shared.

    Under context parallelism (``models.sequence.current()`` set by the engine) the call
    goes to that shard's attention instead: ring attention over every rank's keys, or the
    all-to-all's (``parallel.cp_comm``), T being this rank's tokens of the sequence, the
    window applied to their true positions (``parallel.context``), the document ids to
    every block pair.

    Raises ``ValueError`` (one line) for an ``impl`` other than "sdpa" or "math", document
    ids of another length than T, or a ``softcap`` under ring attention.
    """
    shard = sequence.current()
    docs = None if shard is None else shard.documents  # (B, T) or None
    if shard is not None and shard.attention is not None:  # ring or all-to-all attention
        return shard.attention(q, k, v, dropout_p=dropout_p, impl=impl, window=window,
                               scale=scale, documents=docs, softcap=softcap,
                               local=causal_attention)  # the all-to-all runs it whole
    if impl not in ("sdpa", "math"):
        raise ValueError(f"model.attention={impl!r}: expected 'sdpa' or 'math'")
    # (B, Hkv, T, D) -> (B, H, T, D), once: a chunk's keys are then views of it (repeating
    # each chunk's slice instead would keep ~(c + W) / c times the heads for backward)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    T = q.shape[-2]
    if docs is not None and docs.shape[-1] != T:
        raise ValueError(f"models.sequence.documents: {docs.shape[-1]} tokens per "
                         f"sequence, attention holds {T}")
    if window is not None and T > window:
        return _windowed(q, k, v, window, window_chunk(T, window), shard, dropout_p, impl,
                         scale, softcap)
    mask = None  # causal: is_causal, or the triangle (ANDed with the documents)
    if docs is not None or not _fused(impl, softcap):
        mask = _mask(shard, 0, T, 0, None, _form(q, impl, softcap), q.device)
    return _attend(q, k, v, mask, dropout_p, impl, scale, softcap)


def _windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, chunk: int,
              shard: sequence.SequenceShard | None, dropout_p: float, impl: str,
              scale: float | None, softcap: float | None) -> torch.Tensor:
    """A sliding window of ``window`` tokens over (B, H, T, D) q, k, v (heads repeated) in
    query chunks of ``chunk`` tokens (``causal_attention``): chunk [s, e) against keys
    [max(0, s - W + 1), e), masked by their band (``window_band``) and, with the document
    ids of ``shard`` (B, T), by the chunk's query and key ids (``_mask``). (B, H, T, Dv)."""
    T, W = q.shape[-2], window
    form = _form(q, impl, softcap)
    n = -(-T // chunk)
    if n == 1:
        return _attend(q, k, v, _mask(shard, 0, T, 0, W, form, q.device), dropout_p, impl,
                       scale, softcap)

    def keys(x):  # n x (B, H, c + W - 1, D): chunk i's keys [i c - W + 1, (i + 1) c)
        # one overlapping view of x padded with W - 1 rows in front and to n c behind: the
        # chunks' gradients then meet in one unfold backward (slicing x per chunk would
        # write a whole (B, H, T, D) gradient per chunk)
        x = F.pad(x, (0, 0, W - 1, n * chunk - T))
        return x.unfold(-2, chunk + W - 1, chunk).transpose(-1, -2).unbind(2)

    out = []
    for i, (qc, kc, vc) in enumerate(zip(q.split(chunk, dim=-2), keys(k), keys(v))):
        s = i * chunk
        e, a = s + qc.shape[-2], max(0, s - W + 1)  # queries [s, e), keys [a, e)
        cut = slice(a - (s - W + 1), e - (s - W + 1))  # the padding off
        out.append(_attend(qc, kc[..., cut, :], vc[..., cut, :],
                           _mask(shard, s, e, a, W, form, q.device), dropout_p, impl, scale,
                           softcap))
    return torch.cat(out, dim=-2)


# elements per row an additive mask is allocated in multiples of, per device type (_mask)
MASK_ROW_ALIGN = {"cuda": 16}


def _fused(impl: str, softcap: float | None) -> bool:
    """Whether ``_attend`` calls SDPA (else it writes the scores out)."""
    return impl == "sdpa" and softcap is None


def _form(q: torch.Tensor, impl: str, softcap: float | None) -> torch.dtype | None:
    """The mask ``_attend`` takes (``_mask``): additive in the queries' dtype for SDPA, None
    (bool, True where hidden) for written-out scores."""
    return q.dtype if _fused(impl, softcap) else None


def _mask(shard: sequence.SequenceShard | None, s: int, e: int, a: int,
          window: int | None, form: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """Queries [s, e) against keys [a, e) (positions in the sequence): (e - s, e - a), or
    (B, 1, e - s, e - a) with the document ids (B, T) of ``shard``; a query sees keys
    within ``window`` tokens of it (``window_band``; None: every earlier key) and, with
    document ids, of its own document. In the form ``_attend`` takes (``form``): a float
    of that dtype, 0 where the query attends and -inf elsewhere (what SDPA turns a bool
    mask into, afresh on every call), or, None, bool, True where hidden (what
    ``masked_fill`` saves). One tensor for every layer and chunk that asks for the same
    (``sequence.shared_mask``): SDPA and ``masked_fill`` save their mask for backward,
    so separate tensors would be kept once per layer and chunk."""
    docs = None if shard is None else shard.documents
    n_q, n_k, offset = e - s, e - a, s - a

    def build() -> torch.Tensor:
        # no window: causal, a band as wide as the keys
        sees = window_band.__wrapped__(  # built, not kept by window_band's own cache
            n_q, n_k, offset, n_k if window is None else window, device)
        if docs is not None:
            sees = sequence.document_mask(docs[:, s:e], docs[:, a:e]) & sees
        if form is None:
            return ~sees
        # rows padded to MASK_ROW_ALIGN elements, sliced back: CUDA's memory-efficient SDPA
        # kernel wants every stride but the last a multiple of 8 elements and pads a copy of
        # any other mask on every call (PyTorch's ``preprocess_mask`` / ``pad_bias``), which
        # it would then save per layer and chunk (the bands' c + W - 1 columns are odd); a
        # view of padded rows passes as it is
        align = MASK_ROW_ALIGN.get(device.type, 1)
        full = sees.shape[:-1] + (-(-n_k // align) * align,)
        return torch.zeros(full, dtype=form, device=device)[..., :n_k].masked_fill_(
            ~sees, float("-inf"))

    key = ((s, e, a) if docs is not None else (n_q, n_k, offset)) + (window, form, device)
    return sequence.shared_mask(shard, key, build)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            dropout_p: float, impl: str, scale: float | None,
            softcap: float | None) -> torch.Tensor:
    """One attention call: (B, H, Tq, D) queries against (B, H, Tk, D) keys and values.
    ``mask`` (..., Tq, Tk) in ``_mask``'s form: additive, in q's dtype, for SDPA
    (``impl="sdpa"`` without a ``softcap``); bool, True where hidden, for the scores
    written out (``impl="math"`` or a ``softcap``); or None: causal, Tq = Tk
    (``is_causal``, or the triangle). (B, H, Tq, Dv)."""
    if _fused(impl, softcap):
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                  scale=scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                              scale=scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    Tq, Tk = scores.shape[-2:]
    hidden = mask if mask is not None else _mask(None, 0, Tq, 0, None, None, q.device)
    # softmax in at least fp32 (bf16 / fp16 scores promoted, as transformers' eager path;
    # fp64 kept), then back to the inputs' dtype
    att = F.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1,
                    dtype=torch.promote_types(scores.dtype, torch.float32))
    att = att.to(q.dtype)
    if dropout_p > 0.0:
        att = F.dropout(att, dropout_p)
    return att @ v


class CausalSelfAttention(nn.Module):
    """Multi-head attention with a causal mask. (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        # no key bias by default: q.(k + b) shifts every score of a query equally, so softmax
        # ignores it and its gradient is zero up to rounding, which Adam would amplify into
        # noise; ``k_bias`` keeps one only to hold GPT-2's weights exactly
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.k_bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.out_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.attention = cfg.attention
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C)`` -> ``(B, T, C)``: causal multi-head attention (a tensor-parallel rank
        computes its share of the heads)."""
        B, T, _ = x.shape
        # (B, T, C) -> (B, H, T, D); the head axis is what tensor parallelism splits
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = causal_attention(q, k, v, self.dropout if self.training else 0.0, self.attention)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C)
        return self.resid_dropout(self.out_proj(y))


class MLP(nn.Module):
    """``fc`` (C -> 4C), GELU (``cfg.activation``), ``proj`` (4C -> C). (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.approximate = ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C)`` -> ``(B, T, C)``: fc, GELU, proj, dropout."""
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate=self.approximate)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C)`` -> ``(B, T, C)``: pre-LayerNorm attention then MLP, each added to the
        residual."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token + position embedding. (B, T) int64 -> (B, T, C). Positions are
    ``models.sequence.positions``: 0..T-1, or the true positions of a context-parallel
    rank's tokens."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` -> ``(B, T, C)``: token plus learned position embeddings, dropout.
        """
        pos = sequence.positions(idx.shape[1], idx.device)  # (T,)
        return self.dropout(self.tok(idx) + self.pos(pos))


class LMHead(nn.Module):
    """Final LayerNorm and projection to the vocabulary. (B, T, C) -> (B, T, V) logits."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C)`` -> logits ``(B, T, vocab)``: final LayerNorm then the head."""
        return self.proj(self.ln_f(x))


class GPT(DecoderLM):
    """``embed -> blocks -> head``. ``forward(idx (B, T), targets (B, T) | None)``.

    Returns ``(logits (B, T, V), loss)`` where ``loss`` is the mean cross-entropy in nats
    per token, or ``None`` without targets. Raises ``ValueError`` if ``T > block_size``.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = LMHead(cfg)
        if cfg.tie_weights:
            self.head.proj.weight = self.embed.tok.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("out_proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)


# The GPT's tensor-parallel plan (Megatron-LM's: Shoeybi et al. 2019, figure 3; styles in
# ``models.description``): Q, K, V column-parallel by heads, the output projection
# row-parallel; ``fc`` column then ``proj`` row; the vocabulary split in the embedding and
# the head; LayerNorms token-wise under sequence parallelism.
TP_PLAN = {
    "embed.tok": "vocab_embedding",
    "embed.pos": "sequence_positions",
    "embed.dropout": "dropout",
    "blocks.*.ln_1": "sequence_parallel",
    "blocks.*.attn": "attention",
    "blocks.*.attn.[qkv]_proj": "column",
    "blocks.*.attn.out_proj": "row",
    "blocks.*.attn.resid_dropout": "dropout",
    "blocks.*.ln_2": "sequence_parallel",
    "blocks.*.mlp.fc": "column",
    "blocks.*.mlp.proj": "row",
    "blocks.*.mlp.dropout": "dropout",
    "head.ln_f": "sequence_parallel",
    "head.proj": "vocab_head",
}


def describe(cfg: GPTConfig):
    """The GPT as a ``models.description.ModelDescription`` (kind "gpt"; Hugging Face's
    ``GPT2LMHeadModel`` in and out, ``models.hf.GPT2``)."""
    from shardwise.models.description import ModelDescription
    from shardwise.models.hf import GPT2

    c = cfg.n_embd
    return ModelDescription(
        kind="gpt", config=cfg, build=lambda: GPT(cfg), tp_plan=TP_PLAN, hidden_size=c,
        vocab_size=cfg.vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
        attention_width=c, context_parallel=True, attention_mask=cfg.attention_mask,
        written_scores=int(cfg.attention == "math"),
        tied=("embed.tok.weight", "head.proj.weight") if cfg.tie_weights else None,
        tp_divides={"model.n_head (attention heads)": cfg.n_head,
                    "model.n_embd (hidden size)": c, "MLP size 4 * model.n_embd": 4 * c},
        hf=GPT2)


def from_section(m, vocab_size: int) -> GPTConfig:
    """The GPT of a run's ``[model]`` section (``base.model_config.GPTModelConfig``, or
    ``ModelConfig``'s every decoder field): each ``GPTConfig`` field from the section's of
    that name; ``model.vocab_size`` when set, else ``vocab_size`` (the tokenizer's). Raises
    ``ValueError`` (one line) for another kind's field set in a ``ModelConfig`` (a sliding
    window among them: GPT-2 has none; ``base.model_config.own_fields``)."""
    from shardwise.base.model_config import GPTModelConfig, own_fields
    from shardwise.models.description import section_values

    own_fields(m.model_dump(), GPTModelConfig)
    return GPTConfig(vocab_size=m.vocab_size or vocab_size,
                     **section_values(m, GPTConfig, skip=("vocab_size",)))
