"""Multi-head latent attention (``models.mla``, DeepSeek-V2/V3) on one process: the logits of
our Llama with MLA, DeepSeek's routing and mixed dense / mixture blocks equal transformers'
``DeepseekV3ForCausalLM`` (interleaved rotary, a query latent) on the same weights, mapped in
memory (``DeepseekV2ForCausalLM``, a plain ``q_proj`` and softmax group-limited greedy
routing, through its checkpoint: tests/test_hf.py); the interleaved layout matters; refusals
are one line naming the field. Training parity under tp (+SP), ep and pp:
tests/test_moe.py's ``mixed`` model. A few seconds."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwise.models.llama import Llama, LlamaConfig  # noqa: E402

V = 97
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12)


def _ours_of(hf_sd: dict) -> dict:
    """A ``DeepseekV3ForCausalLM`` / ``V2`` state dict (in memory: fused experts) under our
    names: the Llama's prefixes, ``mlp.gate`` the router, ``mlp.shared_experts`` our shared
    expert, the fused (E, 2F, C) ``gate_up_proj`` and (E, C, F) ``down_proj`` our stacked
    (E, C, F) / (E, F, C); the routing bias buffer left out (zero here)."""
    out = {}
    for k, v in hf_sd.items():
        for a, b in (("model.embed_tokens.", "embed.tok."), ("model.layers.", "blocks."),
                     ("model.norm.", "head.norm."), ("lm_head.", "head.proj."),
                     (".mlp.gate.weight", ".mlp.router.weight"),
                     (".mlp.shared_experts.", ".mlp.shared_expert.")):
            k = k.replace(a, b)
        if "e_score_correction_bias" in k:
            continue
        if k.endswith("experts.gate_up_proj"):
            f = v.shape[1] // 2
            out[k.replace("gate_up_proj", "gate_proj")] = v[:, :f].transpose(1, 2)
            out[k.replace("gate_up_proj", "up_proj")] = v[:, f:].transpose(1, 2)
        elif k.endswith("experts.down_proj"):
            out[k] = v.transpose(1, 2)
        else:
            out[k] = v
    return out


def _pair(version: str):
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                  n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                  first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=32,
                  tie_word_embeddings=False, **MLA)
    ours = dict(vocab_size=V, block_size=32, n_layer=3, n_head=4, n_embd=32, ffn_hidden=48,
                moe_ffn_hidden=16, n_experts=8, top_k=2, moe_n_group=4, moe_topk_group=2,
                moe_shared_expert=True, moe_shared_ffn_hidden=16, dense_layers=(0,), **MLA)
    if version == "v3":
        hc = transformers.DeepseekV3Config(**common, q_lora_rank=24, routed_scaling_factor=2.5,
                                           norm_topk_prob=True, rope_interleave=True)
        hf = transformers.DeepseekV3ForCausalLM(hc)
        ours.update(q_lora_rank=24, moe_gating="sigmoid", moe_norm_topk=True,
                    moe_routed_scaling=2.5, rope_interleave=True)
    else:
        hc = transformers.DeepseekV2Config(**common, q_lora_rank=None, routed_scaling_factor=1.5,
                                           topk_method="group_limited_greedy")
        hf = transformers.DeepseekV2ForCausalLM(hc)
        ours.update(moe_gating="softmax", moe_norm_topk=False, moe_group_score="top1",
                    moe_routed_scaling=1.5, rope_interleave=True)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in n else 0.0, 0.2)
    cfg = LlamaConfig(**ours, norm_eps=hc.rms_norm_eps, rope_theta=hc.rope_parameters["rope_theta"])
    model = Llama(cfg).eval()
    model.load_state_dict(_ours_of(hf.state_dict()))
    return hf.eval(), model


@pytest.mark.parametrize("version", ["v3"])  # V2's: tests/test_hf.py, imported
def test_logits_equal_transformers_deepseek(version):
    """Our logits on transformers' weights equal theirs within 1e-5 (fp32; measured ~2e-7 of
    the largest); with the rotary layout switched (interleaved pairs read as halves) they
    do not. (``_pair("v2")`` builds V2's pair the same way.)"""
    from dataclasses import replace

    hf, ours = _pair(version)
    idx = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(idx).logits
        torch.testing.assert_close(ours(idx)[0], want, rtol=1e-5, atol=1e-5)
        other = Llama(replace(ours.cfg, rope_interleave=False)).eval()
        other.load_state_dict(ours.state_dict())
        assert (other(idx)[0] - want).abs().max() > 1e-3


def test_mla_shapes_plan_and_refusals():
    """The parameters of MLA (transformers' names and shapes), its tp plan (up projections
    column, o_proj row, down projections and their norms partial_grad), the FLOPs' width
    (the mean of the Q K^T and P V widths), no Hugging Face arch for a dense Llama with MLA,
    and the refusals: GQA's options, rope scaling, Gemma's attention options, sizes without
    the latent, odd widths; cp > 1 at the door."""
    from shardwise.base.config import Config, ConfigError
    from shardwise.models.llama import describe

    cfg = LlamaConfig(vocab_size=V, n_layer=1, n_head=4, n_embd=32, q_lora_rank=24, **MLA)
    assert cfg.head_dim == 12 and cfg.rope_dim == 4
    shapes = {n: tuple(p.shape) for n, p in Llama(cfg).named_parameters() if "attn" in n}
    assert shapes == {"blocks.0.self_attn.q_a_proj.weight": (24, 32),
                      "blocks.0.self_attn.q_a_layernorm.weight": (24,),
                      "blocks.0.self_attn.q_b_proj.weight": (48, 24),
                      "blocks.0.self_attn.kv_a_proj_with_mqa.weight": (20, 32),
                      "blocks.0.self_attn.kv_a_layernorm.weight": (16,),
                      "blocks.0.self_attn.kv_b_proj.weight": (80, 16),
                      "blocks.0.self_attn.o_proj.weight": (32, 48)}
    d = describe(cfg)
    assert [d.style_of(f"blocks.0.self_attn.{m}") for m in (
        "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
        "kv_b_proj", "o_proj")] == ["partial_grad"] * 2 + ["column"] + ["partial_grad"] * 2 \
        + ["column", "row"]
    d.check_plan(Llama(cfg))
    assert d.attention_width == 4 * (12 + 12) // 2 and not d.ring_attention  # a2a only
    for bad, msg in (({"n_kv_heads": 2}, "model.n_kv_heads with model.kv_lora_rank"),
                     ({"qk_norm": True}, "model.qk_norm with model.kv_lora_rank"),
                     ({"rope_scaling": {"factor": 8.0}}, "model.rope_scaling with"),
                     ({"qk_nope_head_dim": 7}, "model.qk_nope_head_dim=7"),
                     ({"v_head_dim": 0}, "model.v_head_dim=0"),
                     ({"query_pre_attn_scalar": 20.0}, "model.query_pre_attn_scalar with"),
                     ({"norm_zero_centered": True}, "model.norm_zero_centered with")):
        with pytest.raises(ValueError, match=msg):
            LlamaConfig(vocab_size=V, n_layer=1, n_head=4, n_embd=32, **{**MLA, **bad})
    with pytest.raises(ValueError, match=r"^model.rope_scaling: YaRN .* multi-head latent"):
        LlamaConfig(vocab_size=V, n_layer=1, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})
    # a dense Llama with MLA is no arch's: no Llama, Mistral, Qwen or Phi-3 has MLA, and
    # DeepSeek's have experts (export refuses it in one line, having no arch)
    from shardwise.models.hf import arch_for

    assert arch_for(cfg) is None
    with pytest.raises(ValueError, match=r"^model.v_head_dim without model.kv_lora_rank"):
        LlamaConfig(vocab_size=V, n_layer=1, v_head_dim=8)
    with pytest.raises(ConfigError, match=r"^model.kv_lora_rank=16 with parallel.cp=2: ring"):
        Config.from_dict({"model": {"kind": "llama", **MLA}, "parallel": {"dp": 1, "cp": 2},
                          "training": {"global_batch_size": 8}})
