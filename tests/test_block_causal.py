"""``model.attention_mask = "block_causal"``: attention within the documents of a packed
sequence (Llama 3, arXiv:2407.21783, sec. 3.2; torchtitan's ``attn_mask_type``), one process.

The strongest check is the Llama's: its attention depends on positions only through the
rotary angles, i.e. on relative positions, so under the document mask the logits of a packed
sequence ``[doc A, EOS, doc B, EOS, doc C]`` equal, token for token, those of each document
run alone (``[A, EOS]``, ``[B, EOS]``, ``[C]``; the separator closes its document): fused
and written-out attention, grouped-query heads, a sliding window shorter than the documents
(so a mask not ANDed with the band differs), Gemma 2's soft-capped scores, DeepSeek's latent
attention (measured at most 2.4e-7 of the largest logit, fp32). The GPT's learned
positions are absolute, so there the check is that no token's output moves when another
document's tokens change (bit for bit), and that one document is plain causal attention.
Ring attention of one rank with document ids is full attention under the same mask. Then
the door: an unknown mask and a tokenizer without an end-of-text id are one line, exit 2.
The multi-rank parity is in ``test_llama.py`` and ``test_context_parallel.py``. Seconds.
"""

import pytest
import torch
import torch.nn.functional as F

from ddp_workers import tiny_config
from helpers import assert_one_line_exit_2
from shardwise.base.config import Config, ConfigError
from shardwise.models import sequence
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.llama import Llama, LlamaConfig

EOS = 3
VOCAB = 50
LENGTHS = (7, 9, 5)  # documents A, B, C; longer than WINDOW + 1
WINDOW = 4
MLA = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}
LLAMAS = {  # name -> LlamaConfig options
    "gqa": {"n_kv_heads": 2},
    "gqa-window": {"n_kv_heads": 2, "sliding_window": WINDOW},
    "gemma2-softcap": {"n_kv_heads": 2, "attn_logit_softcapping": 20.0,
                       "query_pre_attn_scalar": 10.0},
    "mla": MLA,
}


def _documents(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(EOS + 1, VOCAB, (n,), generator=g) for n in LENGTHS]


def _packed(docs: list[torch.Tensor]) -> torch.Tensor:
    """(1, T): A EOS B EOS C."""
    eos = torch.tensor([EOS])
    return torch.cat([docs[0], eos, docs[1], eos, docs[2]])[None]


def _within_documents(idx: torch.Tensor):
    """What the engine sets around a forward under block_causal."""
    return sequence.use(sequence.SequenceShard(documents=sequence.document_ids(idx, EOS)))


def test_the_separator_closes_its_document():
    idx = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8], [EOS, 4, 4, 4, 4, 4, EOS]])
    assert sequence.document_ids(idx, EOS).tolist() == [[0, 0, 0, 1, 1, 2, 3],
                                                         [0, 1, 1, 1, 1, 1, 1]]
    assert sequence.current() is None  # nothing set outside a forward


@pytest.mark.parametrize("impl", ["sdpa", "math"])
@pytest.mark.parametrize("name", list(LLAMAS))
def test_llama_packed_logits_equal_each_document_alone(name, impl):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_embd=32,
                      attention=impl, attention_mask="block_causal", **LLAMAS[name])
    model = Llama(cfg).eval()
    docs = _documents()
    packed = _packed(docs)
    with _within_documents(packed):
        logits, _ = model(packed)
    eos = torch.tensor([EOS])
    alone = torch.cat([model(torch.cat([docs[0], eos])[None])[0],
                       model(torch.cat([docs[1], eos])[None])[0],
                       model(docs[2][None])[0]], dim=1)
    assert logits.shape == alone.shape
    err = float((logits - alone).detach().abs().max() / alone.detach().abs().max())
    assert err < 1e-5, (name, impl, err)
    plain, _ = model(packed)  # without document ids: causal across documents, other logits
    assert float((plain - alone).detach().abs().max() / alone.detach().abs().max()) > 1e-2, (
        name, impl)


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_gpt_tokens_see_nothing_of_other_documents(impl):
    """Learned absolute positions: a document's logits depend on where it sits, so the
    check is that changing every token of document B (and of C) leaves A's and C's (and
    B's) outputs bit-equal, under the mask; and that without it they move."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_embd=32,
                          attention=impl, attention_mask="block_causal")).eval()
    docs = _documents(0)
    other = _documents(1)
    spans = [(0, 8), (8, 18), (18, 23)]  # A + EOS, B + EOS, C
    for changed in (1, 2):
        mixed = [other[i] if i == changed else docs[i] for i in range(3)]
        a, b = _packed(docs), _packed(mixed)
        with _within_documents(a):
            la, _ = model(a)
        with _within_documents(b):
            lb, _ = model(b)
        for i, (s, e) in enumerate(spans):
            if i != changed:
                assert torch.equal(la[:, s:e], lb[:, s:e]), (impl, changed, i)
        assert not torch.equal(la[:, slice(*spans[changed])], lb[:, slice(*spans[changed])])
    pa, _ = model(_packed(docs))  # plain causal: later documents see earlier ones
    pb, _ = model(_packed([docs[0], other[1], docs[2]]))
    assert not torch.equal(pa[:, 18:], pb[:, 18:])


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_one_document_is_plain_causal_attention(impl):
    """No separator: the document mask is the causal triangle (as booleans, exactly), and
    the outputs equal ``is_causal``'s (up to the kernel's rounding of a given mask)."""
    torch.manual_seed(0)
    idx = torch.randint(EOS + 1, VOCAB, (2, 16))
    docs = sequence.document_ids(idx, EOS)
    assert torch.equal(sequence.document_mask(docs, docs)
                       & torch.ones(16, 16, dtype=torch.bool).tril(),
                       torch.ones(2, 1, 16, 16, dtype=torch.bool).tril())
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=32,
                          attention=impl, attention_mask="block_causal")).eval()
    with _within_documents(idx):
        masked, _ = model(idx)
    plain, _ = model(idx)
    assert (masked - plain).abs().max() < 1e-6


def test_ring_of_one_rank_with_documents_is_masked_attention():
    """``ring_attention`` on one rank with document ids (every block pair's mask ANDed with
    them) is SDPA with the (B, 1, T, T) document AND causal (AND band) mask, forward and
    backward, both block kernels."""
    from shardwise.parallel.context import Ring, ring_attention

    g = torch.Generator().manual_seed(0)
    B, H, T, D = 2, 4, 16, 8
    q, k, v, dout = (torch.randn(B, h, T, D, generator=g) for h in (H, 2, 2, H))
    idx = torch.randint(0, 4, (B, T), generator=g)  # EOS = 3: a quarter of the tokens
    docs = sequence.document_ids(idx, EOS)
    for window in (None, 3):
        allowed = torch.ones(T, T, dtype=torch.bool).tril()
        if window is not None:
            allowed &= ~torch.ones(T, T, dtype=torch.bool).tril(-window)
        mask = sequence.document_mask(docs, docs) & allowed
        for impl in ("sdpa", "math"):
            a = [t.clone().requires_grad_() for t in (q, k, v)]
            b = [t.clone().requires_grad_() for t in (q, k, v)]
            y = ring_attention(*a, Ring(), impl=impl, window=window, documents=docs)
            ref = F.scaled_dot_product_attention(b[0], b[1].repeat_interleave(2, 1),
                                                 b[2].repeat_interleave(2, 1), attn_mask=mask)
            y.backward(dout)
            ref.backward(dout)
            assert (y - ref).abs().max() < 1e-5, (window, impl)
            for s, r in zip(a, b):
                assert (s.grad - r.grad).abs().max() < 1e-5, (window, impl)


def test_causal_runs_no_mask():
    """``causal`` (the default): the engine builds no shard and no document ids, the
    attention takes ``is_causal``: nothing changes for runs that do not ask."""
    from shardwise.base.topology import Topology
    from shardwise.engine import Engine, EngineConfig

    cfg = LlamaConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_embd=16)
    engine = Engine(cfg, Topology.build(), EngineConfig(
        seq_len=16, eos_id=EOS, parallel={"micro_batches": 2}, optimizer={"grad_clip": 0.0},
        training={"global_batch_size": 2}))
    assert not engine.block_causal
    assert engine._sequence_shards(torch.zeros(2, 16, dtype=torch.long), 2) is None
    masked = Engine(LlamaConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2,
                                n_embd=16, attention_mask="block_causal"), Topology.build(),
                    EngineConfig(
                        seq_len=16, eos_id=EOS, parallel={"micro_batches": 2},
                        optimizer={"grad_clip": 0.0}, training={"global_batch_size": 2}))
    shards = masked._sequence_shards(torch.tensor([[1] * 15 + [EOS], [EOS] + [1] * 15]), 2)
    assert [s.documents.tolist() for s in shards] == [[[0] * 16], [[0] + [1] * 15]]


def test_bad_masks_are_refused_in_one_line(corpus, packed, tmp_path, capsys):
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"model": {"attention_mask": "document"}})
    assert str(e.value) == ("model.attention_mask='document': expected causal or "
                            "block_causal")
    with pytest.raises(ValueError, match=r"^model.attention_mask='bidirectional': expected"):
        LlamaConfig(vocab_size=VOCAB, attention_mask="bidirectional")
    from shardwise.apps.param_server.app import check_config  # the application's rule
    with pytest.raises(ConfigError, match=r"^model.attention_mask='block_causal' with "
                                          "parallel.mode=ps"):
        check_config(Config.from_dict({"model": {"attention_mask": "block_causal"},
                                       "parallel": {"mode": "ps"}}))
    # the character tokenizer of a text has no end-of-text id: refused at the door
    assert_one_line_exit_2(
        ["train", "--data", str(corpus), "--model.attention_mask", "block_causal",
         "--training.out_dir", str(tmp_path / "run")], capsys,
        "model.attention_mask='block_causal': the tokenizer has no end-of-text id")
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match=r"^model.attention_mask='block_causal': the "
                                         "tokenizer has no end-of-text id"):
        from shardwise.base.topology import Topology
        from shardwise.engine import Engine, EngineConfig

        Engine(LlamaConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_embd=16,
                           attention_mask="block_causal"), Topology.build(),
               EngineConfig(
                   seq_len=16, optimizer={"grad_clip": 0.0}, training={"global_batch_size": 2}))
    # a prepared tokenizer with <|endoftext|> passes the door (a run of one step)
    cfg = tiny_config(str(packed), str(tmp_path / "ok"), model={
        "kind": "llama", "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16,
        "attention_mask": "block_causal"}, training={"steps": 1, "global_batch_size": 2})
    from shardwise.apps.lm.app import check_data

    check_data(Config.from_dict(cfg))


@pytest.mark.slow  # Inductor compiles on the CPU for ~15 s: `pytest -m slow`
def test_compiled_block_causal_trains_like_eager(packed, tmp_path):
    """``training.compile`` with ``block_causal``: the document ids change every micro-batch,
    so the compiled blocks must read them as inputs (no recompile per micro-batch) and train
    as eager does (within 1e-5: Inductor's fused kernels round differently)."""
    from torch._dynamo.utils import counters

    from ddp_workers import train

    model = {"kind": "llama", "n_kv_heads": 2, "multiple_of": 16,
             "attention_mask": "block_causal"}
    eager = train(tiny_config(str(packed), str(tmp_path / "eager"), model=model,
                              parallel={"dp": 1}, training={"steps": 4}))
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):  # not per micro-batch's ids
        compiled = train(tiny_config(str(packed), str(tmp_path / "compiled"), model=model,
                                     parallel={"dp": 1}, training={"steps": 4, "compile": True}))
    assert counters["stats"]["unique_graphs"] > 0  # it compiled
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
