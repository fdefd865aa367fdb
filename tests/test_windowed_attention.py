"""Sliding-window attention in query chunks (``models.gpt.causal_attention`` with a window):
the chunked path equals one call with the (T, T) band, and both equal the band written out
in float64, outputs and the gradients of q, k and v.

The chunks are made small (``WINDOW_CHUNK`` = 8, so a few dozen tokens make several chunks)
and the sizes chosen to catch the usual slips: T not a multiple of c (a dropped last
partial chunk), first chunks cut by position 0, every chunk's first key at s - W + 1 (an
off-by-one there shifts keys against the band), document boundaries at other places in each
sequence (a document mask not sliced per chunk), W = 1, W >= T (no chunks: the plain causal
kernel, bit for bit), grouped-query heads, Gemma's scale and soft cap, the written-out
path, values narrower than keys (DeepSeek's latent attention). The parity against
``transformers`` of whole windowed models is ``test_hf.py``'s (one call: T < 2W there);
here a windowed Llama in chunks equals the same Llama in one call. Seconds.
"""

import pytest
import torch
import torch.nn.functional as F

from shardwise.models import gpt, sequence
from shardwise.models.gpt import causal_attention
from shardwise.models.llama import Llama, LlamaConfig

CHUNK = 8
CASES = {  # name -> (T, W, H, Hkv, D, Dv, scale, softcap, documents)
    "partial-last-chunk": (37, 5, 4, 4, 8, 8, None, None, False),
    "window-1": (37, 1, 4, 4, 8, 8, None, None, False),
    "window-above-chunk": (45, 11, 4, 4, 8, 8, None, None, False),
    "gqa": (40, 6, 4, 2, 8, 8, None, None, False),
    "scale": (37, 5, 4, 2, 8, 8, 0.3, None, False),
    "documents": (45, 7, 4, 2, 8, 8, None, None, True),
    "softcap": (37, 5, 4, 2, 8, 8, 0.3, 2.0, True),
    "mla-values": (37, 5, 4, 4, 12, 6, None, None, True),
}


@pytest.fixture
def chunked(monkeypatch):
    """Chunks of max(W, 8) queries from T >= 2W on."""
    monkeypatch.setattr(gpt, "WINDOW_CHUNK", CHUNK)


def _inputs(T, H, Hkv, D, Dv, dtype=torch.float32, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, Hkv, T, D, generator=g)
    v = torch.randn(B, Hkv, T, Dv, generator=g)
    dout = torch.randn(B, H, T, Dv, generator=g)
    return [t.to(dtype) for t in (q, k, v)], dout.to(dtype)


def _docs(B, T, seed=0):
    """(B, T) document ids, boundaries at different places in each row."""
    g = torch.Generator().manual_seed(seed + 1)
    starts = (torch.rand(B, T, generator=g) < 0.12).long()
    starts[:, 0] = 0
    return torch.cumsum(starts, dim=1)


def _run(qkv, dout, docs, **kw):
    """(out, dq, dk, dv) of ``causal_attention`` within ``docs`` (None: one document)."""
    leaves = [t.clone().requires_grad_() for t in qkv]
    shard = None if docs is None else sequence.SequenceShard(documents=docs)
    with sequence.use(shard):
        out = causal_attention(*leaves, **kw)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def _reference(qkv, dout, docs, window, scale=None, softcap=None):
    """The band written out in float64: query i sees keys i - W < j <= i (of its document)."""
    q, k, v = (t.double().requires_grad_() for t in qkv)
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    T = q.shape[-2]
    s = (q @ kk.transpose(-2, -1)) * (scale or q.shape[-1] ** -0.5)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    i = torch.arange(T)
    d = i[:, None] - i[None, :]
    allowed = (d >= 0) & (d < window)
    if docs is not None:
        allowed = allowed & (docs[:, None, :, None] == docs[:, None, None, :])
    out = s.masked_fill(~allowed, float("-inf")).softmax(-1) @ vv
    out.backward(dout.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def _close(a, b, rtol, what):
    """max |a - b| within ``rtol`` of max |b|, or of 1 where b is ~0 (W = 1: dq = 0)."""
    for name, x, y in zip(("out", "dq", "dk", "dv"), a, b):
        err = float((x.double() - y.double()).abs().max() / max(1.0, y.double().abs().max()))
        assert err < rtol, (what, name, err)


@pytest.mark.parametrize("impl", ["sdpa", "math"])
@pytest.mark.parametrize("name", list(CASES))
def test_chunks_equal_one_call_and_the_written_band(name, impl, chunked, monkeypatch):
    T, W, H, Hkv, D, Dv, scale, softcap, with_docs = CASES[name]
    assert gpt.window_chunk(T, W) < T  # several chunks
    qkv, dout = _inputs(T, H, Hkv, D, Dv)
    docs = _docs(2, T) if with_docs else None
    kw = {"impl": impl, "window": W, "scale": scale, "softcap": softcap}
    calls = []
    attend = gpt._attend
    monkeypatch.setattr(gpt, "_attend", lambda q, k, *a: calls.append(k.shape[-2]) or attend(
        q, k, *a))
    chunks = _run(qkv, dout, docs, **kw)
    assert len(calls) == -(-T // max(W, CHUNK)) and max(calls) <= max(W, CHUNK) + W - 1
    monkeypatch.setattr(gpt, "WINDOW_CHUNKED_FROM", 10 ** 9)  # the one (T, T) call
    calls.clear()
    one = _run(qkv, dout, docs, **kw)
    assert calls == [T]
    _close(chunks, one, 2e-6, (name, impl, "chunks against one call"))
    _close(one, _reference(qkv, dout, docs, W, scale, softcap), 2e-6, (name, impl, "fp64"))


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_chunks_in_bf16(impl, chunked):
    qkv, dout = _inputs(45, 4, 2, 8, 8, dtype=torch.bfloat16)
    docs = _docs(2, 45)
    chunks = _run(qkv, dout, docs, impl=impl, window=7)
    ref = _reference(qkv, dout, docs, 7)
    _close(chunks, ref, 2e-2, (impl, "bf16"))


def test_no_chunks_without_a_window_or_below_two_windows(chunked):
    """W >= T, or no window: ``is_causal``, bit for bit; W < T < 2W: one call with the
    (T, T) band, bit for bit."""
    qkv, _ = _inputs(16, 4, 4, 8, 8)
    plain = F.scaled_dot_product_attention(*qkv, is_causal=True)
    for window in (None, 16, 40):
        assert torch.equal(causal_attention(*qkv, window=window), plain), window
    assert gpt.window_chunk(16, 9) == 16 and gpt.window_chunk(18, 9) == CHUNK + 1
    band = F.scaled_dot_product_attention(*qkv, attn_mask=gpt.sliding_window_mask(16, 9,
                                                                                   "cpu"))
    assert torch.equal(causal_attention(*qkv, window=9), band)
    assert torch.equal(sequence.window_band(16, 16, 0, 9, "cpu"), gpt.sliding_window_mask(16, 9,
                                                                                     "cpu"))


def test_dropout_draws_per_chunk_at_its_rate(chunked):
    """Dropout in chunks: the same distribution (each weight dropped with p, the rest
    scaled by 1 / (1 - p)), so the mean output over many draws is the one without."""
    qkv, _ = _inputs(40, 2, 2, 8, 8, B=1)
    torch.manual_seed(0)
    draws = causal_attention(*(t.expand(500, -1, -1, -1) for t in qkv), dropout_p=0.5,
                             impl="math", window=5)  # 500 independent draws
    exact = causal_attention(*qkv, impl="math", window=5)
    assert float((draws.mean(0) - exact[0]).abs().mean() / exact.abs().mean()) < 0.1


def test_windowed_llama_in_chunks_equals_one_call(chunked, monkeypatch):
    """A whole model: GQA, rotary, a window of 6 over 40 packed tokens, documents on: logits
    and every parameter's gradient as with one call per layer."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, block_size=40, n_layer=2, n_head=4, n_kv_heads=2,
                      n_embd=32, sliding_window=6, attention_mask="block_causal")
    model = Llama(cfg)
    idx = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(0))
    docs = sequence.document_ids(idx, eos_id=3)

    def run():
        model.zero_grad()
        with sequence.use(sequence.SequenceShard(documents=docs)):
            _, loss = model(idx, idx)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    chunks = run()
    monkeypatch.setattr(gpt, "WINDOW_CHUNKED_FROM", 10 ** 9)
    one = run()
    for a, b in zip(chunks, one):
        assert float((a - b).abs().max()) <= 1e-6 * float(b.abs().max()) + 1e-9
