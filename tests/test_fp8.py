"""training.precision = "fp8" without a GPU: the config's rules, the one-line refusals at
the door (CPU, CUDA below compute capability 8.9, torchao missing), the engine's own
refusal, which Linear layers the filter picks (what the model's description keeps in high
precision), and, when torchao imports here, which Linear layers the conversion swaps (the
float8 matmuls themselves need a GPU: benchmarks/gpu_mfu.py, docs/fp8.md)."""

import importlib.util

import pytest
import torch

from conftest import REPO
from helpers import assert_one_line_exit_2
from shardwise.base.config import Config, ConfigError
from shardwise.parallel.float8 import fp8_refusal

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def test_config_accepts_fp8_and_its_recipes():
    cfg = Config.load(overrides={"training.precision": "fp8", "training.fp8_recipe": "rowwise"})
    assert (cfg.training.precision, cfg.training.fp8_recipe) == ("fp8", "rowwise")
    assert Config.load().training.fp8_recipe == "tensorwise"


@pytest.mark.parametrize("over, expected", [
    ({"training.fp8_recipe": "blockwise"},
     "training.fp8_recipe='blockwise': expected tensorwise or rowwise"),
    ({"training.precision": "fp8", "parallel.tp": 2},
     "training.precision=fp8 with parallel.tp=2: torchao's float8 tensor parallelism"),
    ({"training.precision": "fp4"}, "training.precision='fp4': expected fp32, bf16, fp16 or fp8"),
    ({"training.precision": "fp8", "model.block_size": 20, "training.global_batch_size": 4},
     "training.precision=fp8 with 40 tokens per micro-batch and rank"),
])
def test_config_refuses_in_one_line(over, expected):
    with pytest.raises(ConfigError) as e:
        Config.load(overrides=over)
    assert expected in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("device, caps, torchao, expected", [
    ("cpu", [], True, "this run is on the CPU: use training.precision = bf16"),
    ("cpu", [], False, "this run is on the CPU"),  # the device first: torchao would not help
    ("cuda", [(8, 0)], True, "this GPU has 8.0: use training.precision = bf16"),
    ("cuda", [(9, 0), (8, 6)], True, "this GPU has 8.6"),
    ("cuda", [(9, 0)], False, "needs torchao, which is not installed: pip install 'shardwise[fp8]'"),
    ("cuda", [(8, 9)], True, None),
    ("cuda", [(9, 0), (10, 0)], True, None),
])
def test_refusal_lines(device, caps, torchao, expected):
    why = fp8_refusal(device, caps, torchao)
    if expected is None:
        assert why is None
    else:
        assert why.startswith("training.precision=fp8 needs") and expected in why
        assert "\n" not in why


def test_cli_refuses_fp8_on_the_cpu_before_any_rank(tmp_path, capsys):
    out = tmp_path / "run"
    err = assert_one_line_exit_2(["train", "--config", str(REPO / "configs/tiny.toml"),
                                  "--training.device", "cpu", "--training.precision", "fp8",
                                  "--training.out_dir", str(out)], capsys)
    assert err.startswith("shardwise: error: training.precision=fp8 needs")
    assert not out.exists()  # nothing written: refused before the run directory


def test_cli_refuses_fp8_below_capability_8_9(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (8, 0))  # A100
    assert_one_line_exit_2(["train", "--config", str(REPO / "configs/tiny.toml"),
                            "--training.device", "cuda", "--training.precision", "fp8",
                            "--training.out_dir", str(tmp_path / "r")], capsys,
                           "compute capability >= 8.9", "this GPU has 8.0")


def test_engine_refuses_fp8_on_the_cpu():
    from shardwise.base.topology import Topology
    from shardwise.engine import Engine, EngineConfig
    from shardwise.models import GPTConfig

    gpt = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    with pytest.raises(ValueError, match=r"^training.precision=fp8 needs a CUDA GPU") as e:
        Engine(gpt, Topology.build(1, 1, 1), EngineConfig(
            seq_len=16, optimizer={"grad_clip": 0.0},
            training={"precision": "fp8", "global_batch_size": 2}))
    assert "\n" not in str(e.value)


def _picked(d, **kw) -> list[str]:
    """Full names of the modules ``float8_filter`` picks in ``d``'s model built on meta,
    walked as ``convert_to_float8_training`` walks each pipeline layer."""
    from shardwise.parallel.float8 import float8_filter

    with torch.device("meta"):
        model = d.build()
    picked = []
    for prefix, layer in d.layers(model):
        keep = float8_filter(d.style_of, prefix, **kw)
        picked += [f"{prefix}.{fqn}" if fqn else prefix
                   for fqn, m in layer.named_modules() if keep(m, fqn)]
    return picked


def test_the_filter_keeps_what_the_description_declares():
    """The routers stay out of fp8 because the Llama's description declares them
    (``keep_high_precision``), not by their name: a description that declares nothing gets
    them converted, one that declares another module keeps that one; the head stays out by
    its style. No torchao needed: the filter is pure logic, on the meta device."""
    import dataclasses

    from shardwise.models import LlamaConfig
    from shardwise.models.description import describe

    d = describe(LlamaConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_kv_heads=2,
                             n_embd=64, n_experts=16, top_k=2))
    assert d.keep_high_precision == ("blocks.*.mlp.router",)
    attention = [f"blocks.{i}.self_attn.{p}" for i in (0, 1)
                 for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    routers = ["blocks.0.mlp.router", "blocks.1.mlp.router"]
    assert _picked(d, high_precision=d.is_high_precision) == attention
    assert sorted(_picked(d)) == sorted(attention + routers)  # the default keeps none
    bare = dataclasses.replace(d, keep_high_precision=())
    assert sorted(_picked(bare, high_precision=bare.is_high_precision)) == sorted(
        attention + routers)
    other = dataclasses.replace(d, keep_high_precision=("blocks.1.self_attn.o_proj",))
    assert sorted(_picked(other, high_precision=other.is_high_precision)) == sorted(
        [n for n in attention if n != "blocks.1.self_attn.o_proj"] + routers)
    assert describe(LlamaConfig(vocab_size=128, block_size=16, n_layer=1, n_head=4,
                                n_embd=64)).keep_high_precision == ()
    with torch.device("meta"):
        model = d.build()
    with pytest.raises(ValueError, match=r"^keep_high_precision of 'llama': "
                       r"'blocks.\*.mlp.gate' names no module$"):
        dataclasses.replace(d, keep_high_precision=("blocks.*.mlp.gate",)).check_plan(model)


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (pip install 'shardwise[fp8]')")
def test_conversion_picks_the_linear_layers():
    """Every block's Linear (dims multiples of 16) becomes a Float8Linear holding the same
    Parameters; the head (vocab_head), the router and a Linear with a dim not divisible by
    16 stay nn.Linear."""
    from torchao.float8.float8_linear import Float8Linear

    from shardwise.models import LlamaConfig
    from shardwise.models.description import describe
    from shardwise.parallel.float8 import convert_layers

    cfg = LlamaConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_kv_heads=2,
                      n_embd=64, n_experts=16, top_k=2)
    d = describe(cfg)
    model = d.build()
    model.blocks[1].self_attn.o_proj = torch.nn.Linear(64, 64 + 8, bias=False)  # 72: not x16
    before = {n: p for n, p in model.named_parameters()}
    done = convert_layers(d.layers(model), d.style_of, "rowwise",
                          high_precision=d.is_high_precision)
    assert done == [f"blocks.{i}.self_attn.{p}" for i in (0, 1)
                    for p in ("q_proj", "k_proj", "v_proj", "o_proj") if (i, p) != (1, "o_proj")]
    modules = dict(model.named_modules())
    assert all(type(modules[n]) is Float8Linear for n in done)
    for n in ("head.proj", "blocks.0.mlp.router", "blocks.1.self_attn.o_proj"):
        assert type(modules[n]) is torch.nn.Linear, n
    after = dict(model.named_parameters())
    assert list(after) == list(before) and all(after[n] is before[n] for n in before)
    assert modules[done[0]].config.cast_config_input.scaling_granularity.value == "axiswise"


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (pip install 'shardwise[fp8]')")
def test_conversion_of_the_dense_gpt_mlp():
    from shardwise.models import GPTConfig
    from shardwise.models.description import describe
    from shardwise.parallel.float8 import convert_layers

    d = describe(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    model = d.build()
    done = convert_layers(d.layers(model), d.style_of, "tensorwise")
    assert done == ["blocks.0.attn.q_proj", "blocks.0.attn.k_proj", "blocks.0.attn.v_proj",
                    "blocks.0.attn.out_proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj"]
    with pytest.raises(ValueError, match="training.fp8_recipe='x'"):
        convert_layers(d.layers(model), d.style_of, "x")


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (pip install 'shardwise[fp8]')")
def test_fp8_trains_like_bf16_under_zero(monkeypatch):
    """dp = 2, float8 matmuls emulated on the CPU: ZeRO-3 (bf16 gathers into the same
    Parameters the Float8Linear layers read) and ZeRO-0 follow ZeRO-1's losses, which follow bf16's
    within float8's rounding (measured: ZeRO-3 equal to ZeRO-1 bit for bit, fp8 within 0.3%
    of bf16 over 4 steps)."""
    from fp8_workers import train

    from shardwise.launch import spawn

    runs = {(z, p): spawn(train, 2, (z, p))[0] for z, p in
            ((1, "bf16"), (0, "fp8"), (1, "fp8"), (3, "fp8"))}
    assert all(runs[(z, "fp8")]["fp8_layers"] == 14 for z in (0, 1, 3))
    assert runs[(1, "bf16")]["fp8_layers"] == 0
    bf16, z1, z3 = (runs[k]["losses"] for k in ((1, "bf16"), (1, "fp8"), (3, "fp8")))
    assert z3 == pytest.approx(z1, rel=1e-6)
    assert runs[(0, "fp8")]["losses"] == pytest.approx(z1, rel=1e-5)  # our DDP's buckets
    assert z1 == pytest.approx(bf16, rel=1e-2) and z1 != bf16  # float8 rounds: not bit-equal


def _fp8_gpu() -> bool:
    return (HAS_TORCHAO and torch.cuda.is_available()
            and torch.cuda.get_device_capability(0) >= (8, 9))


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU of capability >= 8.9 and torchao")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_on_cuda_trains_near_bf16_and_rows_carry_memory(recipe, corpus, tmp_path):
    """GPU only: one process, a small Llama, 8 steps in bf16 and in fp8 with the same data:
    the Linear layers run float8 matmuls on the GPU, the losses stay within 5% of bf16's,
    and every train row of metrics.jsonl carries this rank's peak allocated / reserved MiB."""
    import json

    from shardwise.apps.lm.trainer import Trainer
    from shardwise.base.topology import Topology

    def run(precision: str) -> tuple[list, Trainer]:
        out = tmp_path / precision
        cfg = Config.load(overrides={
            "data.path": str(corpus), "model.kind": "llama", "model.n_layer": 2,
            "model.n_head": 4, "model.n_kv_heads": 2, "model.n_embd": 128,
            "model.block_size": 64, "model.vocab_size": 128, "parallel.dp": 1,
            "training.precision": precision, "training.fp8_recipe": recipe,
            "training.steps": 8, "training.log_every": 4, "training.eval_every": 0,
            "training.global_batch_size": 16, "training.out_dir": str(out),
            "training.progress": False, "training.sample_chars": 0,
            "checkpoint.at_end": False})
        trainer = Trainer(cfg, Topology.build(1, 1, 1), torch.device("cuda", 0))
        trainer.fit(progress=False)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if r["kind"] == "train"], trainer

    bf16, _ = run("bf16")
    fp8, trainer = run("fp8")
    assert len(trainer.engine.fp8_layers) == 14  # 2 blocks x (q, k, v, o, gate, up, down)
    losses = [r["loss"] for r in fp8]
    assert losses == pytest.approx([r["loss"] for r in bf16], rel=5e-2)
    assert losses != [r["loss"] for r in bf16]
    for r in fp8:
        (alloc,), (reserved,) = r["peak_allocated_mib"], r["peak_reserved_mib"]
        assert 0 < alloc <= reserved
