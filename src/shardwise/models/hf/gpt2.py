"""``GPT2LMHeadModel`` (``GPT2``): our GPT as GPT-2 (Radford et al. 2019, the released code).

Its ``Conv1D`` layers store weights as (in, out), the transpose of ``nn.Linear``'s;
``c_attn`` packs Q, K and V along the output features; our GPT holds them apart (tensor
parallelism splits each by heads), with a key bias (``k_bias``) and the tanh GELU
(``activation = "gelu_tanh"``) to be GPT-2 exactly.
"""

from __future__ import annotations

from dataclasses import replace

from shardwise.models.hf.arch import HFArch, HFTensor, _get, _refuse

# HF's names for GPT-2's activation: the tanh approximation under three names, and the exact one
_GPT2_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_GPT2_PREFIX = (("embed.tok.", "transformer.wte."), ("embed.pos.", "transformer.wpe."),
                ("blocks.", "transformer.h."), ("head.ln_f.", "transformer.ln_f."),
                ("head.proj.", "lm_head."))
_GPT2_INNER = {"attn.q_proj": ("attn.c_attn", (0, 3)), "attn.k_proj": ("attn.c_attn", (1, 3)),
               "attn.v_proj": ("attn.c_attn", (2, 3)), "attn.out_proj": ("attn.c_proj", None),
               "mlp.fc": ("mlp.c_fc", None), "mlp.proj": ("mlp.c_proj", None)}


def _gpt2_section(c: dict) -> dict:
    h = _get(c, "n_embd", 768)
    act = _get(c, "activation_function", "gelu_new")
    if act not in _GPT2_TANH + ("gelu",):
        raise _refuse("GPT", f"activation_function={act!r} (shardwise's GPT has gelu and the "
                      "tanh GELU)")
    if _get(c, "n_inner", 4 * h) != 4 * h:
        raise _refuse("GPT", f"n_inner={c['n_inner']} (shardwise's MLP is 4 x n_embd = {4 * h})")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if _get(c, key, want) != want:
            raise _refuse("GPT", f"{key}={c[key]!r}")
    return dict(kind="gpt", vocab_size=_get(c, "vocab_size", 50257), n_embd=h,
                n_layer=_get(c, "n_layer", 12), n_head=_get(c, "n_head", 12),
                block_size=_get(c, "n_positions", 1024), bias=True, k_bias=True,
                activation="gelu_tanh" if act in _GPT2_TANH else "gelu",
                norm_eps=float(_get(c, "layer_norm_epsilon", 1e-5)),
                tie_weights=bool(_get(c, "tie_word_embeddings", True)))


def _gpt2_config_json(cfg, source: dict | None) -> dict:
    out = dict(source or {"bos_token_id": None, "eos_token_id": None})
    out.pop("_name_or_path", None)
    out.pop("torch_dtype", None)
    act = out.get("activation_function")
    if cfg.activation == "gelu_tanh":
        act = act if act in _GPT2_TANH else "gelu_new"
    else:
        act = "gelu"
    drop = {k: out.get(k, cfg.dropout) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    out.update(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=cfg.vocab_size,
               n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
               n_positions=cfg.block_size, n_inner=None, activation_function=act,
               layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=cfg.tie_weights,
               scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
               add_cross_attention=False, dtype="float32", **drop)
    return out


def _gpt2_tensor(name: str) -> HFTensor:
    for ours, theirs in _GPT2_PREFIX:
        if name.startswith(ours):
            rest = name[len(ours):]
            break
    else:
        raise KeyError(f"{name}: not a GPT parameter name")
    if ours != "blocks.":
        return HFTensor(theirs + rest)
    layer, _, inner = rest.partition(".")
    module, _, kind = inner.rpartition(".")
    if module in _GPT2_INNER:
        hf_module, part = _GPT2_INNER[module]
        return HFTensor(f"{theirs}{layer}.{hf_module}.{kind}", transpose=kind == "weight",
                        part=part)
    return HFTensor(f"{theirs}{layer}.{inner}")


def _gpt2_complete(cfg):
    return replace(cfg, bias=True, k_bias=True)


GPT2 = HFArch(kind="gpt", model_type="gpt2", architecture="GPT2LMHeadModel",
              section=_gpt2_section, config_json=_gpt2_config_json, tensor=_gpt2_tensor,
              ignored=("transformer.h.*.attn.bias", "transformer.h.*.attn.masked_bias"),
              complete=_gpt2_complete)
