"""models.llama against Hugging Face's LlamaForCausalLM: logits, loss and gradients.

HF's model is built locally from a transformers ``LlamaConfig`` with random weights (no hub),
its state dict loaded into ours through ``from_hf_state_dict``; fp32 on the CPU.
"""

from dataclasses import replace

import pytest
import torch

from shardwise.models.hf import rope_parameters
from shardwise.models.llama import (
    Llama,
    LlamaConfig,
    RopeScaling,
    from_hf_state_dict,
    hf_name,
    hf_state_dict,
)

RTOL, ATOL = 1e-5, 1e-6

CASES = {
    "mha-untied": dict(n_kv_heads=4, tie_weights=False, rope_scaling=None),
    "gqa-untied": dict(n_kv_heads=2, tie_weights=False, rope_scaling=None),
    "gqa-tied": dict(n_kv_heads=2, tie_weights=True, rope_scaling=None),
    "mha-tied": dict(n_kv_heads=4, tie_weights=True, rope_scaling=None),
    # original_max_position_embeddings small so that all three bands (kept, interpolated,
    # stretched) occur among head_dim/2 = 8 frequencies; below block_size, as in Llama 3.1
    "gqa-llama3-rope": dict(n_kv_heads=2, tie_weights=False, block_size=128,
                            rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64)),
    "mha-tied-llama3-rope": dict(n_kv_heads=4, tie_weights=True, block_size=128,
                                 rope_scaling=RopeScaling(4.0, 1.0, 2.0, 32)),
}


def small(**kw) -> LlamaConfig:
    base = dict(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=64, ffn_hidden=96,
                norm_eps=1e-5, rope_theta=10000.0)
    return LlamaConfig(**{**base, **kw})


def hf_model(cfg: LlamaConfig, attn: str):
    transformers = pytest.importorskip("transformers")
    rope = rope_parameters(cfg)
    hcfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.block_size,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_weights, rope_parameters=rope,
        attn_implementation=attn)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(hcfg).float()
    with torch.no_grad():  # norms away from one so that their weights are tested too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_and_grads_match_hf(case, attn):
    cfg = small(**CASES[case], attention="math" if attn == "eager" else "sdpa")
    ref = hf_model(cfg, attn)
    ours = Llama(cfg)
    ours.load_state_dict(from_hf_state_dict(ref.state_dict(), cfg.tie_weights))
    assert ours.num_parameters() == sum(p.numel() for p in ref.parameters())

    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (3, 32), generator=g)
    # HF shifts labels inside; ours are the next tokens, the last position ignored (-100)
    targets = torch.cat([idx[:, 1:], torch.full((3, 1), -100)], dim=1)
    out = ref(input_ids=idx, labels=idx)
    logits, loss = ours(idx, targets)
    torch.testing.assert_close(logits, out.logits, rtol=RTOL, atol=ATOL)
    if cfg.rope_scaling is not None:  # the scaling matters: without it the logits differ
        plain = Llama(replace(cfg, rope_scaling=None))
        plain.load_state_dict(ours.state_dict())
        assert (plain(idx)[0] - out.logits).abs().max() > 1e-4
    torch.testing.assert_close(loss, out.loss, rtol=RTOL, atol=ATOL)

    out.loss.backward()
    loss.backward()
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[hf_name(name)].grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_state_dict_round_trip_and_names():
    cfg = small(n_kv_heads=2)
    torch.manual_seed(0)
    a = Llama(cfg)
    sd = hf_state_dict(a)
    assert "model.embed_tokens.weight" in sd and "lm_head.weight" in sd
    assert "model.layers.1.self_attn.k_proj.weight" in sd and "model.norm.weight" in sd
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert sd["model.layers.0.mlp.gate_proj.weight"].shape == (96, 64)
    torch.manual_seed(1)
    b = Llama(cfg)
    b.load_state_dict(from_hf_state_dict(sd))
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    torch.testing.assert_close(a(idx)[0], b(idx)[0], rtol=0, atol=0)
    with pytest.raises(KeyError, match="model.foo"):
        from_hf_state_dict({"model.foo": torch.zeros(1)})


def test_init_is_deterministic_and_hf_like():
    cfg = small(n_kv_heads=2)
    torch.manual_seed(5)
    a = Llama(cfg)
    torch.manual_seed(5)
    b = Llama(cfg)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    assert torch.equal(a.blocks[0].input_layernorm.weight, torch.ones(64))
    w = a.blocks[1].mlp.down_proj.weight
    assert abs(w.std().item() - 0.02) < 0.003 and abs(w.mean().item()) < 0.002


def test_zero_centred_norms_start_at_zero_and_scale_by_one():
    """With ``norm_zero_centered`` every norm's weight (QK-norm's too) starts at 0, a scale
    of 1 + 0, so the first forward is the one of the same model whose norms are a Llama's at
    1; in bf16 the norm multiplies in fp32 and rounds once (transformers' ``GemmaRMSNorm``);
    the weights are 1-D, so the optimizer gives them no decay (towards a scale of 1)."""
    from dataclasses import replace

    from shardwise.models.llama import RMSNorm

    cfg = small(n_kv_heads=2, qk_norm=True, norm_zero_centered=True, sandwich_norm=True)
    torch.manual_seed(5)
    gemma = Llama(cfg)
    norms = [m for m in gemma.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * (4 + 2) + 1 and all(not m.weight.any() for m in norms)
    torch.manual_seed(5)
    llama = Llama(replace(cfg, norm_zero_centered=False))
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    torch.testing.assert_close(gemma(idx)[0], llama(idx)[0], rtol=0, atol=0)
    norm = RMSNorm(64, zero_centered=True)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    xf = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(norm(x), (xf * (1 + norm.weight)).to(torch.bfloat16))
    assert all(p.dim() == 1 for m in norms for p in m.parameters())


def test_embedding_scale_is_rounded_to_the_activation_dtype():
    """``scale_embedding``: the rows times sqrt(n_embd) rounded to their dtype first, as
    transformers' ``GemmaTextScaledWordEmbedding`` (bf16: sqrt(3072) = 55.43 becomes 55.5),
    not the exact factor."""
    from shardwise.models.llama import Embedding

    emb = Embedding(small(n_embd=3072, n_head=24, scale_embedding=True)).to(torch.bfloat16)
    idx = torch.arange(16).view(2, 8)
    want = emb.tok(idx) * torch.tensor(3072 ** 0.5, dtype=torch.bfloat16)
    assert torch.equal(emb(idx), want) and not torch.equal(want, emb.tok(idx) * 3072 ** 0.5)


def test_default_ffn_width_is_llamas_rule():
    # Llama-2-7B: h 4096 -> int(8 * 4096 / 3) = 10922, up to a multiple of 256: 11008
    assert LlamaConfig(32000, n_embd=4096, n_head=32).ffn_hidden == 11008
    assert LlamaConfig(100, n_embd=64, n_head=4, multiple_of=32).ffn_hidden == 192


def test_generate_and_sequence_limit():
    torch.manual_seed(0)
    m = Llama(small(n_kv_heads=2))
    out = m.generate(torch.zeros(1, 3, dtype=torch.long), 5,
                     generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 8)
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("kw, field", [
    (dict(n_head=6, n_kv_heads=4, n_embd=96), "n_kv_heads"),
    (dict(n_head=4, n_embd=66), "n_embd"),
    (dict(n_layer=0), "n_layer"),
    (dict(attention="flash"), "attention"),
    (dict(rope_scaling={"factor": 8.0, "beta": 1}), "rope_scaling.beta"),
    (dict(rope_scaling=RopeScaling(8.0, 4.0, 1.0, 64)), "rope_scaling"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(sliding_window=True), "sliding_window"),
    (dict(sliding_window=4, layer_types=("sliding_attention",)), "layer_types"),
    (dict(layer_types=("sliding_attention", "full_attention")), "layer_types"),
    (dict(mlp_activation="relu"), "mlp_activation"),
    (dict(mlp_activation="gelu_tanh", n_experts=4), "mlp_activation"),
    (dict(attn_logit_softcapping=0.0), "attn_logit_softcapping"),
    (dict(query_pre_attn_scalar=-1.0), "query_pre_attn_scalar"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0.0}), "rope_scaling.factor"),
])
def test_config_errors_are_one_line(kw, field):
    with pytest.raises(ValueError) as exc:
        small(**kw)
    msg = str(exc.value)
    assert "\n" not in msg and f"model.{field}" in msg


def test_rope_scaling_from_dict():
    cfg = small(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
