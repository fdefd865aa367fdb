"""The model description the engine reads (``models.description``), its tensor-parallel
plan, and what the engine builds from it, without spawning ranks: each tp rank's slices
of a Llama (grouped-query attention included) and of the GPT are the single-process
model's, bad plans and bad tp sizes are one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.apps.lm.app import check_config, check_model
from shardwise.base.config import Config
from shardwise.engine.model import build_local_model
from shardwise.models import GPTConfig, LlamaConfig, describe
from shardwise.models.description import ModelDescription, model_kind
from shardwise.models.gpt import GPT
from shardwise.models.llama import Llama
from shardwise.parallel.tensor_parallel import RankGroup
from shardwise.parallel.tensor_parallel.random import ParallelRNG, TPDropout
from shardwise.perf import flops_per_token

LLAMA = LlamaConfig(vocab_size=37, block_size=16, n_layer=2, n_head=4, n_kv_heads=2,
                    n_embd=32, ffn_hidden=48, tie_weights=False)


def _local(cfg, tp: int, rank: int, **kw):
    return build_local_model(cfg, pp=1, pp_rank=0, chunk_ids=[0], n_chunks=1,
                             tp=RankGroup(size=tp, rank=rank), seed=5, dropout_seed=0,
                             device=torch.device("cpu"), **kw)


QWENISH = LlamaConfig(vocab_size=37, block_size=16, n_layer=2, n_head=4, n_kv_heads=2,
                      n_embd=32, ffn_hidden=48, head_dim=12, qkv_bias=True, qk_norm=True)


@pytest.mark.parametrize("cfg", [LLAMA, QWENISH,
                                 GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=4,
                                           n_embd=32, tie_weights=True)],
                         ids=["llama-gqa", "llama-qwen-options", "gpt-tied"])
def test_tp_slices_join_into_the_single_process_model(cfg):
    """Concatenating the two tp ranks' slices along each parameter's ``tp_dim`` (vocabulary
    padding dropped) gives exactly ``torch.manual_seed(5); Model(cfg)``; replicated
    parameters are equal on both ranks. For the Llama, k/v hold n_kv_heads / tp heads (of
    ``head_dim`` each, 12 for the one with Qwen's options: its Q/K/V biases split with
    them, its q_norm / k_norm replicated and marked as holding a partial gradient)."""
    torch.manual_seed(5)
    full = dict((GPT if isinstance(cfg, GPTConfig) else Llama)(cfg).named_parameters())
    ranks = [dict(_local(cfg, 2, r).named_parameters()) for r in range(2)]
    assert ranks[0].keys() == full.keys()
    for name, ref in full.items():
        a, b = ranks[0][name], ranks[1][name]
        dim = getattr(a, "tp_dim", None)
        got = a if dim is None else torch.cat([a, b], dim)
        if dim == 0:
            got = got[:ref.shape[0]]  # vocabulary padding
        assert torch.equal(got.detach(), ref.detach()), name
        if dim is None:
            assert torch.equal(a, b), name
    if isinstance(cfg, LlamaConfig):
        k = ranks[0]["blocks.0.self_attn.k_proj.weight"]
        assert k.shape == (cfg.n_kv_heads // 2 * cfg.head_dim, cfg.n_embd)
        partial = {n for n, p in ranks[0].items() if getattr(p, "tp_partial_grad", False)}
        assert partial == ({f"blocks.{i}.self_attn.{x}_norm.weight" for i in range(2)
                            for x in "qk"} if cfg.qk_norm else set())
        if cfg.qkv_bias:
            assert ranks[0]["blocks.0.self_attn.q_proj.bias"].shape == (2 * 12,)
            assert ranks[0]["blocks.0.self_attn.q_proj.bias"].tp_dim == 0


def test_gqa_tp_must_divide_kv_heads_one_line():
    bad = LlamaConfig(vocab_size=37, n_head=4, n_kv_heads=1, n_embd=32, ffn_hidden=48)
    with pytest.raises(ValueError, match=r"^model.n_kv_heads \(key/value heads\)=1 is not "
                                         r"divisible by tp=2$"):
        _local(bad, 2, 0)
    cfg = Config.from_dict({"model": {"kind": "llama", "n_head": 4, "n_kv_heads": 1},
                            "parallel": {"dp": 1, "tp": 2}})
    with pytest.raises(ValueError, match=r"^model.n_kv_heads \(key/value heads\)=1 is not "
                                         r"divisible by parallel.tp=2$"):
        check_model(cfg, 65)
    with pytest.raises(ValueError, match=r"model.kind='nope': not a registered model \(gpt, "
                                         r"llama"):
        check_config(Config.from_dict({"model": {"kind": "nope"}}))
    with pytest.raises(ValueError, match=r"model.kind='gtp': .*; did you mean 'gpt', or set "):
        check_config(Config.from_dict({"model": {"kind": "gtp"}}))


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4)])
        self.head = nn.Linear(4, 8)


def _desc(plan) -> ModelDescription:
    return ModelDescription(kind="tiny", config=None, build=_Tiny, tp_plan=plan, hidden_size=4,
                            vocab_size=8, block_size=4, n_layer=1, attention_width=4)


def test_bad_plans_are_one_line():
    with pytest.raises(ValueError, match="style 'colum'; expected one of column"):
        _desc({"head": "colum"})
    with pytest.raises(ValueError, match=r"'blocks\.\*\.mlp' names no module"):
        _desc({"blocks.*.mlp": "column"}).check_plan(_Tiny())
    with pytest.raises(ValueError, match=r"embed is a Embedding; style 'column' needs an "
                                         r"nn.Linear"):
        _desc({"embed": "column"}).check_plan(_Tiny())
    with pytest.raises(TypeError, match="not a registered model config"):
        describe(object())
    assert model_kind("llama").config_type is LlamaConfig


def test_style_lookup_and_vocab_params():
    d = describe(LLAMA)
    assert d.style_of("blocks.3.self_attn.k_proj") == "column"
    assert d.style_of("blocks.3.mlp") == "shared_input"
    assert d.style_of("blocks.3.mlp.act") == "replicate"
    torch.manual_seed(0)
    assert d.vocab_params(Llama(LLAMA)) == ("embed.tok.weight", "head.proj.weight")


def test_gpt_flops_from_the_description_equal_perf_flops():
    for tied in (True, False):
        cfg = GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=4, n_embd=32,
                        tie_weights=tied)
        assert _local(cfg, 1, 0).flops_per_token == flops_per_token(cfg)


def test_replicated_dropout_inside_a_parallel_region_draws_the_default_stream():
    """A module computing on heads forks the RNG; a dropout on a replicated activation in
    it must still draw the default stream's mask (the same on every tp rank), and the
    parallel stream must continue where it left off."""
    x = torch.ones(1000)
    rng = ParallelRNG(3, tp_rank=1)
    torch.manual_seed(9)
    want = F.dropout(x, 0.5, True)
    torch.manual_seed(9)
    with rng.fork():
        inner = TPDropout(0.5, rng, parallel=False).train()(x)
    assert torch.equal(inner, want)
    after = torch.rand(3)
    torch.manual_seed(9)
    F.dropout(x, 0.5, True)
    assert torch.equal(after, torch.rand(3))  # the default stream advanced by one mask
    nested = ParallelRNG(3, tp_rank=1)
    with nested.fork():
        a = torch.rand(4)
        with nested.fork():  # nested regions share the one stream
            b = torch.rand(4)
    with rng.fork():  # the same seed and tp rank: the same two draws
        assert torch.equal(torch.rand(4), a) and torch.equal(torch.rand(4), b)
