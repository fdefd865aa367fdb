"""Llama presets of the planner: published sizes, parameter counts, sharding, the CLI."""

import pytest
import torch

from shardwise.cli.main import main
from shardwise.models.llama import Llama, LlamaConfig
from shardwise.planner.hardware import PRESETS
from shardwise.planner.memory import rank_params
from shardwise.planner.search import prune_reason
from shardwise.planner.simulate import Layout, block_flops
from shardwise.planner.specs import NAMED

# published totals: TinyLlama's model card, Llama 2's and Llama 3's released checkpoints
PUBLISHED = {"tinyllama-1.1b": 1.100e9, "llama2-7b": 6.738e9, "llama2-13b": 13.016e9,
             "llama2-70b": 68.977e9, "llama3-8b": 8.030e9, "llama3-70b": 70.554e9,
             "llama3-405b": 405.853e9}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_params_match_published_and_the_model(name):
    spec = NAMED[name]
    assert abs(spec.params / PUBLISHED[name] - 1) < 0.005, spec.params
    cfg = LlamaConfig(spec.vocab_size, spec.block_size, spec.n_layer, spec.n_head,
                      spec.n_kv_heads, spec.n_embd, spec.ffn_hidden, tie_weights=spec.tie_weights)
    with torch.device("meta"):  # the real module, no memory
        model = Llama(cfg)
    assert model.num_parameters() == spec.params
    assert rank_params(spec, list(range(spec.n_layer + 2)), 1, 1) == spec.params


@pytest.mark.parametrize("name", ["llama2-7b", "llama3-70b"])
def test_tensor_parallel_shards_add_up(name):
    spec, tp = NAMED[name], 8
    L, h = spec.n_layer, spec.n_embd
    per_rank = rank_params(spec, list(range(L + 2)), tp, 1)
    replicated = 2 * L * h + h  # RMSNorm weights, whole on every tp rank
    assert tp * per_rank - (tp - 1) * replicated == spec.params


def test_block_flops_count_the_gated_mlp_and_gqa():
    spec, mb = NAMED["llama3-8b"], 1
    s, h, f, kv = spec.block_size, spec.n_embd, spec.ffn_hidden, 8 * 128
    assert block_flops(spec, mb) == 2 * s * (2 * h * h + 2 * h * kv + 3 * h * f) + 4 * s * s * h


def test_tp_must_divide_the_key_value_heads():
    lay = Layout(dp=1, tp=16, pp=1, micro_batch_size=1, micro_batches=1)
    reason = prune_reason(NAMED["llama3-70b"], lay, PRESETS["dgx-h100"], True)
    assert reason == "tp=16 does not divide the 8 key/value heads"


def test_plan_answers_for_llama3_8b(capsys):
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8",
                 "--global-batch", "64", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama3-8b: 8.03B parameters, 32 layers x 4096, sequence 8192")


def test_plan_refuses_to_emit_a_llama_train_config(capsys, tmp_path):
    assert main(["plan", "--model", "tinyllama-1.1b", "--cluster", "dgx-h100", "--gpus", "8",
                 "--global-batch", "64", "--emit-toml", str(tmp_path / "x.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--emit-toml" in err and "llama" in err


def test_memory_takes_a_named_size(capsys):
    assert main(["memory", "--model", "llama3-8b", "--dp", "64", "--stages", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama3-8b: P = 8,030,261,248 parameters, N = 64 ranks")


@pytest.mark.parametrize("argv, msg", [
    (["--model", "llama-7b"], "--model 'llama-7b': not a named size"),
    (["--model", "llama3-8b", "--params", "1e9"], "--model and --params: give one"),
])
def test_memory_model_errors_are_one_line(capsys, argv, msg):
    assert main(["memory", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and msg in err
