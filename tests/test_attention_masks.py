"""Attention masks built once and shared by every layer and query chunk (``models.gpt._mask``,
``models.sequence.shared_mask``), measured on what autograd keeps, one process, seconds.

SDPA and the written-out scores' ``masked_fill`` save their mask for backward, so a mask
built per layer is kept per layer: a Llama of L layers under ``block_causal`` kept L
(B, 1, T, T) masks (SDPA turns a bool mask into a fresh additive copy on every call, so
even a cached bool band was kept once per layer and chunk). Here a 4-layer Llama's forward
runs inside ``torch.autograd.graph.saved_tensors_hooks`` and the masks it saves are counted
by storage: every layer's (and chunk's) attention saves one (the hook sees L x chunks of
them), and they are as many distinct storages, and bytes, as there are distinct masks (1
under ``block_causal``, 2 band shapes under a chunked window, one per chunk with document
ids), not L times that. The masks are gone with the graph that held them.
"""

import gc

import pytest
import torch

from shardwise.models import gpt, sequence
from shardwise.models.llama import Llama, LlamaConfig

EOS, VOCAB = 3, 50
B, T, L, W, CHUNK = 2, 64, 4, 8, 8  # chunks of 8 queries: 8 chunks of a window of 8
CASES = {  # name -> (Llama options, document ids, masks per layer, distinct masks' elements)
    "block_causal": ({"attention_mask": "block_causal"}, True, 1, B * T * T),
    # the first chunk sees keys [0, 8): (8, 8); every later one keys [s - 7, s + 8): (8, 15)
    "window": ({"sliding_window": W}, False, T // CHUNK, CHUNK * CHUNK + CHUNK * (CHUNK + W - 1)),
    # with document ids each chunk's mask differs: one per chunk, shared by the layers
    "window-documents": ({"sliding_window": W, "attention_mask": "block_causal"}, True,
                         T // CHUNK, B * (CHUNK * CHUNK + 7 * CHUNK * (CHUNK + W - 1))),
}


@pytest.fixture(autouse=True)
def chunked(monkeypatch):
    monkeypatch.setattr(gpt, "WINDOW_CHUNK", CHUNK)


def _is_mask(t: torch.Tensor) -> bool:
    """A saved tensor that is an attention mask: bool (``masked_fill``'s, True where hidden),
    or float with -inf and no gradient (SDPA's additive mask)."""
    return t.dtype == torch.bool or (t.is_floating_point() and not t.requires_grad
                                     and bool(torch.isneginf(t).any()))


def _forward(impl: str, options: dict, with_docs: bool):
    """A 4-layer Llama's loss on (B, T) packed tokens, the masks its graph saved as
    ``(saves, {storage pointer: bytes})``, and the shard it ran in (None without ids)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=VOCAB, block_size=T, n_layer=L, n_head=4, n_embd=32,
                              n_kv_heads=2, attention=impl, **options))
    idx = torch.randint(EOS + 1, VOCAB, (B, T), generator=torch.Generator().manual_seed(0))
    idx[0, 20], idx[1, 9], idx[1, 40] = EOS, EOS, EOS
    # what the engine sets around every forward of a micro-batch under block_causal
    shard = sequence.SequenceShard(documents=sequence.document_ids(idx, EOS)) \
        if with_docs else None
    saves, storages = [], {}

    def pack(t):
        if _is_mask(t):
            saves.append(t)
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), sequence.use(shard):
        loss = model(idx, idx)[1]
    n = len(saves)
    saves.clear()  # the masks live on only in the graph
    return loss, n, storages, shard


@pytest.mark.parametrize("impl", ["sdpa", "math"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_layer_and_chunk_saves_the_one_mask(name, impl):
    options, with_docs, per_layer, elements = CASES[name]
    loss, saves, storages, shard = _forward(impl, options, with_docs)
    # SDPA keeps the additive mask in the activations' dtype; the written-out scores a bool
    itemsize = 4 if impl == "sdpa" else 1
    assert saves == L * per_layer  # every attention call saved a mask ...
    distinct = 1 if name == "block_causal" else (2 if name == "window" else per_layer)
    assert len(storages) == distinct, (name, impl, len(storages))  # ... and they are shared
    assert sum(storages.values()) == elements * itemsize  # not L (x chunks) times
    kept = sequence._MASKS if shard is None else shard.masks
    assert len(kept) == distinct
    loss.backward()  # frees the graph's saved tensors
    gc.collect()
    assert len(kept) == 0  # gone with the graph: nothing kept between steps


def test_a_new_micro_batch_builds_its_own():
    """The same (ranges, window) under another micro-batch's document ids is another mask;
    a forward without a graph (``no_grad``: inference, the first pass of a recomputed
    chunk) keeps none."""
    a = sequence.SequenceShard(documents=torch.zeros(1, 8, dtype=torch.long))
    b = sequence.SequenceShard(documents=torch.arange(8)[None])
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    with sequence.use(a):
        out_a = gpt.causal_attention(q, q, q)
    with sequence.use(b):
        out_b = gpt.causal_attention(q, q, q)
    (ma,), (mb,) = a.masks.values(), b.masks.values()
    assert ma.data_ptr() != mb.data_ptr() and not torch.equal(ma, mb)
    torch.testing.assert_close(out_b, q)  # a document per token: each sees itself
    torch.testing.assert_close(out_a, torch.nn.functional.scaled_dot_product_attention(
        q, q, q, is_causal=True))  # one document: plain causal
    c = sequence.SequenceShard(documents=torch.zeros(1, 8, dtype=torch.long))
    with torch.no_grad(), sequence.use(c):
        gpt.causal_attention(q, q, q)
    gc.collect()
    assert len(c.masks) == 0


@pytest.mark.parametrize("with_docs", [False, True])
def test_rows_padded_for_cuda_give_the_same_attention(with_docs, monkeypatch):
    """On CUDA an additive mask's rows are allocated in multiples of 16 elements and sliced
    back (``gpt.MASK_ROW_ALIGN``: the memory-efficient kernel then takes the shared mask
    as it is, not a padded copy per call). Forced on the CPU: the same outputs and
    gradients, bit for bit, from a mask whose rows are 16 apart."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 45, 8, generator=g) for _ in range(3))
    dout = torch.randn(2, 4, 45, 8, generator=g)
    docs = torch.cumsum((torch.rand(2, 45, generator=g) < 0.1).long(), 1) if with_docs else None

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with sequence.use(sequence.SequenceShard(documents=docs) if with_docs else None):
            out = gpt.causal_attention(*leaves, window=7)  # chunks of 8: 8 x 15 bands
        out.backward(dout)
        return [out.detach()] + [t.grad for t in leaves]

    plain = run()
    monkeypatch.setattr(gpt, "MASK_ROW_ALIGN", {"cpu": 16})
    strides = []
    attend = gpt._attend
    monkeypatch.setattr(gpt, "_attend", lambda q, k, v, mask, *a: strides.append(
        mask.stride(-2)) or attend(q, k, v, mask, *a))
    padded = run()
    assert set(strides) == {16}  # (8, 8) and (8, 15) masks, rows 16 apart
    for a, b in zip(plain, padded):
        assert torch.equal(a, b)


@pytest.mark.parametrize("impl", ["sdpa", "math"])
@pytest.mark.parametrize("name", ["causal", *CASES])
def test_the_planner_counts_the_masks_a_forward_keeps(name, impl):
    """``planner.memory.mask_bytes`` (per micro-batch and shared, ``planner.attention``)
    adds up to the bytes of the distinct masks the forward saved: SDPA's additive masks in
    fp32, the written-out scores' bool ones (and their causal triangle when no window or
    document masks it)."""
    from dataclasses import replace

    from shardwise.models.description import describe
    from shardwise.planner.attention import attention_calls
    from shardwise.planner.memory import mask_bytes
    from shardwise.planner.specs import ModelSpec

    options, with_docs = CASES[name][:2] if name in CASES else ({}, False)
    attention_calls.cache_clear()  # the chunk of 8 (``chunked``) is the engine's rule here
    try:
        cfg = LlamaConfig(vocab_size=VOCAB, block_size=T, n_layer=L, n_head=4, n_embd=32,
                          n_kv_heads=2, attention=impl, **options)
        spec = ModelSpec.from_description(describe(cfg))
        per_mb, once = mask_bytes(spec, B, "fp32")
        assert per_mb + once == sum(_forward(impl, options, with_docs)[2].values())
        assert (per_mb > 0) == with_docs and (once > 0) == (not with_docs and (
            impl == "math" or "sliding_window" in options))
        assert mask_bytes(replace(spec, block_size=T), B, "fp32", cp=2) == (0.0, 0.0)
    finally:
        attention_calls.cache_clear()
