"""The single-device path: FLOPs and MFU accounting, device peaks, the kernel switches
(fused attention, fused AdamW, compile) against their references, a loop that reads the
device only at its logging interval, and host threads on CUDA."""

import json
import math

import pytest
import torch

from shardwise.base.config import Config, ConfigError
from shardwise.base.topology import Topology
from shardwise.engine import Engine, EngineConfig, settle
from shardwise.launch import GPU_HOST_THREADS, threads_per_rank
from shardwise.models import GPT, GPTConfig
from shardwise.models.gpt import causal_attention
from shardwise.perf import Peak, Throughput, cpu_peak, flops_per_token, matmul_parameters
from shardwise.perf import peak as peak_mod

SMALL = dict(vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=16)


@pytest.mark.parametrize("tie, bias", [(True, True), (False, True), (True, False)])
def test_matmul_parameters_are_the_models_minus_lookups(tie, bias):
    cfg = GPTConfig(**SMALL, tie_weights=tie, bias=bias)
    model = GPT(cfg)
    lookups = model.embed.pos.weight.numel() + (0 if tie else model.embed.tok.weight.numel())
    assert matmul_parameters(cfg) == model.num_parameters() - lookups


def test_flops_per_token_is_palm_appendix_b():
    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    n = matmul_parameters(cfg)
    assert flops_per_token(cfg) == 6 * n + 12 * 12 * 768 * 1024
    assert 123e6 < n < 125e6  # GPT-2 small without its position embedding
    assert flops_per_token(cfg, seq_len=512) == 6 * n + 12 * 12 * 768 * 512


def test_throughput_mfu_and_pauses(monkeypatch):
    import types

    from shardwise.perf import throughput

    clock = iter([3.0, 4.0, 5.0, 7.0])  # pause, resume, mark, mark (seconds)
    monkeypatch.setattr(throughput, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    t = Throughput(flops_per_token=100.0, world_size=4, peak=Peak(1000.0, "test"))
    t._t0 = 0.0  # started at 0 s
    t.add(400)
    t.add(400)
    t.pause()   # at 3 s: 3 s of training
    t.resume()  # at 4 s: the evaluation's second is not counted
    out = t.mark()  # at 5 s: 4 s of training for 800 tokens
    assert out["tokens_per_s"] == pytest.approx(200.0)
    assert out["step_s"] == pytest.approx(2.0)
    assert out["flops_per_s"] == pytest.approx(200.0 * 100.0 / 4)
    assert out["mfu"] == pytest.approx(5.0)
    t.add(100)
    assert t.mark()["tokens_per_s"] == pytest.approx(50.0)  # 5 s -> 7 s
    monkeypatch.undo()
    assert Throughput(1.0, 1, Peak(None, "?")).mark()["mfu"] is None


@pytest.mark.parametrize("name, kind, tflops, label", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4, "H100 SXM"),
    ("NVIDIA H100 PCIe", "bf16", 756.5, "H100 PCIe"),
    ("NVIDIA H100 80GB HBM3", "tf32", 494.7, "H100 SXM"),
    ("NVIDIA H200", "fp32", 66.9, "H200 SXM"),
    ("NVIDIA A100-SXM4-40GB", "bf16", 312.0, "A100"),
    ("NVIDIA A100 80GB PCIe", "tf32", 156.0, "A100"),
    ("NVIDIA L40S", "bf16", 362.05, "L40S"),
])
def test_gpu_peak_table(name, kind, tflops, label):
    p = peak_mod.gpu_peak(name, kind)
    assert p.flops == pytest.approx(tflops * 1e12) and p.source.startswith(label)


def test_unknown_gpu_has_no_peak_and_an_override_wins():
    p = peak_mod.gpu_peak("NVIDIA GeForce GTX 1080", "bf16")
    assert p.flops is None and "training.peak_tflops" in p.source
    assert peak_mod.peak_flops(torch.device("cpu"), torch.float32,
                               override_tflops=2.5).flops == 2.5e12
    assert peak_mod.peak_kind(torch.bfloat16, True) == "bf16"
    assert peak_mod.peak_kind(torch.float32, True) == "tf32"
    assert peak_mod.peak_kind(torch.float32, False) == "fp32"


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(peak_mod, "measure_matmul",
                        lambda dtype, seconds: calls.append(dtype) or 7.0e10)
    first = cpu_peak(torch.float32)
    second = cpu_peak(torch.float32)
    assert first.flops == second.flops == 7.0e10 and len(calls) == 1
    cache = json.loads((tmp_path / "shardwise" / "peak.json").read_text())
    assert list(cache.values()) == [7.0e10] and "float32" in next(iter(cache))
    cpu_peak(torch.bfloat16)  # another dtype is another measurement
    assert len(calls) == 2
    # a refresh that reads low (cores shared with other work) keeps the higher reading
    monkeypatch.setattr(peak_mod, "measure_matmul", lambda dtype, seconds: 3.0e10)
    assert cpu_peak(torch.float32, refresh=True).flops == 7.0e10
    monkeypatch.setattr(peak_mod, "measure_matmul", lambda dtype, seconds: 9.0e10)
    assert cpu_peak(torch.float32, refresh=True).flops == 9.0e10
    assert cpu_peak(torch.float32).flops == 9.0e10


def test_peak_flops_on_the_cpu_probes_fp32_only(tmp_path, monkeypatch):
    """A bf16/fp16 CPU run never probes (a slow reduced-precision matmul took 10-18 s and
    read so low that MFU showed 60%): it states MFU only against a peak cached for its dtype."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(peak_mod, "measure_matmul",
                        lambda dtype, seconds: calls.append(dtype) or 5.0e10)
    cpu = torch.device("cpu")
    for dtype in (torch.bfloat16, torch.float16):
        p = peak_mod.peak_flops(cpu, dtype)
        assert p.flops is None and "float32 only" in p.source
        assert Throughput(1.0, 1, p).mark()["mfu"] is None  # the bar shows mfu=n/a
    assert calls == []
    assert peak_mod.peak_flops(cpu, torch.float32).flops == 5.0e10
    assert peak_mod.peak_flops(cpu, torch.float32, tf32=False).flops == 5.0e10
    assert calls == [torch.float32]  # measured once, then cached
    cpu_peak(torch.bfloat16, refresh=True)  # an explicit measurement (benchmarks/gpu_mfu.py)
    assert peak_mod.peak_flops(cpu, torch.bfloat16).flops == 5.0e10
    assert peak_mod.peak_flops(cpu, torch.float16).flops is None
    assert calls == [torch.float32, torch.bfloat16]


def test_cpu_peak_cache_lives_outside_the_repository(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert peak_mod._cache_path() == tmp_path / "xdg" / "shardwise" / "peak.json"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unusable in ("", "relative/cache"):  # the XDG spec ignores a relative path
        monkeypatch.setenv("XDG_CACHE_HOME", unusable)
        assert peak_mod._cache_path() == tmp_path / "home" / ".cache" / "shardwise" / "peak.json"


@pytest.mark.parametrize("flops_per_s, size", [(0.5e9, 256), (1e11, 1024)])
def test_matmul_probe_is_short_however_slow_the_matmul(monkeypatch, flops_per_s, size):
    """On a fake clock where a product of n x n takes 2 n^3 / rate seconds: a 0.5 GFLOP/s
    matmul (bf16 without hardware support) is probed in ~1 s, not 17 s of 1024^3 products;
    a fast one still reaches n = 1024 (small products underestimate the peak)."""
    import types

    now, sizes = [0.0], []

    def product(a, b):
        sizes.append(a.shape[0])
        now[0] += 2.0 * a.shape[0] ** 3 / flops_per_s

    monkeypatch.setattr(peak_mod, "_product", product)
    monkeypatch.setattr(peak_mod, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    rate = peak_mod.measure_matmul(torch.float32, seconds=0.3)
    assert rate == pytest.approx(flops_per_s)
    assert max(sizes) == size and now[0] < 1.0


def test_matmul_probe_measures_something():
    assert peak_mod.measure_matmul(torch.float32, n=128, seconds=0.03) > 1e8


def test_math_attention_equals_sdpa_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 12, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    a = causal_attention(q, k, v, impl="sdpa")
    ga = torch.autograd.grad(a.square().sum(), (q, k, v))
    b = causal_attention(q, k, v, impl="math")
    gb = torch.autograd.grad(b.square().sum(), (q, k, v))
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="model.attention='flash'"):
        causal_attention(q, k, v, impl="flash")


def _engine(**kw):
    attention = kw.pop("attention", "sdpa")
    cfg = GPTConfig(**SMALL, attention=attention)
    # lr 1e-3: Adam's steps are ~lr whatever the gradient, so kernels that differ in the
    # last bits of a gradient differ by at most ~1e-3 of a step in the weights
    fused = {"fused": kw.pop("fused")} if "fused" in kw else {}
    s = EngineConfig(seq_len=SMALL["block_size"], parallel={"micro_batches": 2},
                     optimizer={"lr": 1e-3, "grad_clip": 1.0, **fused},
                     training={"seed": 3, "global_batch_size": 4, **kw})
    return Engine(cfg, Topology.build(1, 1, 1), s)


def _train(engine, steps=3):
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, SMALL["vocab_size"], (4, SMALL["block_size"] + 1), generator=g)
        losses.append(engine.train_step(x[:, :-1], x[:, 1:])["loss"])
    return losses, {n: p.detach().clone() for n, p in engine.named_parameters()}


@pytest.mark.parametrize("switch", [{"attention": "math"}, {"fused": True}])
def test_kernel_switches_train_like_the_reference(switch):
    ref_losses, ref = _train(_engine())
    losses, params = _train(_engine(**switch))
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for n in ref:
        torch.testing.assert_close(params[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.slow  # Inductor's C++ compile takes 40-100 s on 2 cores: `pytest -m slow`
def test_compiled_layers_train_like_eager():
    ref_losses, ref = _train(_engine(), steps=2)
    losses, params = _train(_engine(compile=True), steps=2)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for n in ref:
        torch.testing.assert_close(params[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)


def test_unsynchronised_steps_return_device_tensors_that_settle_to_the_same_floats():
    a, b = _engine(), _engine()
    x = torch.randint(0, SMALL["vocab_size"], (4, SMALL["block_size"] + 1),
                      generator=torch.Generator().manual_seed(1))
    lazy = a.train_step(x[:, :-1], x[:, 1:], sync=False)
    eager = b.train_step(x[:, :-1], x[:, 1:])
    assert isinstance(lazy["loss"], torch.Tensor) and isinstance(lazy["grad_norm"], torch.Tensor)
    assert isinstance(eager["loss"], float) and isinstance(eager["grad_norm"], float)
    assert settle(lazy) == eager


def test_trainer_reads_losses_at_its_interval_and_names_the_non_finite_step(tmp_path):
    from shardwise.apps.lm.trainer import Trainer
    from shardwise.base.errors import NonFiniteLossError

    text = tmp_path / "t.txt"
    text.write_text("abcdefghij " * 300)
    cfg = Config.load(overrides={"data.path": str(text), "model.n_layer": 1, "model.n_embd": 16,
                                 "model.n_head": 2, "model.block_size": 16, "parallel.dp": 1,
                                 "training.global_batch_size": 4, "training.steps": 6,
                                 "training.log_every": 3, "training.eval_every": 0,
                                 "training.progress": False, "training.sample_chars": 0,
                                 "training.out_dir": str(tmp_path / "run"),
                                 "checkpoint.at_end": False})
    trainer = Trainer(cfg, Topology.build(1, 1, 1))
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [3, 6] and len(trainer.history) == 6
    for r in train:  # the interval's rates, per rank, against the CPU's measured peak
        assert r["tokens_per_s"] > 0 and r["flops_per_s"] == pytest.approx(
            r["tokens_per_s"] * flops_per_token(trainer.model_cfg))
        assert r["mfu"] is not None and 0 < r["mfu"] < 10
        assert isinstance(r["loss"], float) and math.isfinite(r["grad_norm"])
    # a step whose loss is NaN: the loop learns it at the next reading, naming that step
    trainer.train_step(sync=False)
    trainer._pending.append(torch.tensor(float("nan"), dtype=torch.float64))
    trainer.step += 1
    with pytest.raises(NonFiniteLossError, match="training loss is nan at step 8"):
        trainer.settle()


def test_one_rank_reports_the_gradients_it_will_keep_before_its_first_step(tmp_path):
    """At dp = 1 (no buckets) the gradients appear at the first backward and are kept: the
    memory line printed before it counts them (it said 0.00 MiB), as predict_rank does."""
    from shardwise.apps.lm.trainer import Trainer
    from shardwise.engine.memory import predict_rank

    text = tmp_path / "t.txt"
    text.write_text("abcdefghij " * 300)
    cfg = Config.load(overrides={"data.path": str(text), "model.n_layer": 1, "model.n_embd": 16,
                                 "model.n_head": 2, "model.block_size": 16, "parallel.dp": 1,
                                 "training.global_batch_size": 4, "training.progress": False,
                                 "training.out_dir": str(tmp_path / "run")})
    trainer = Trainer(cfg, Topology.build(1, 1, 1))
    before = trainer.engine.memory_bytes()
    trainer.train_step(sync=False)
    after = trainer.engine.memory_bytes()
    assert before == after and before["grads"] == before["params"] > 0
    assert before["grads"] == predict_rank(trainer.description, dp=1, pp=1, tp=1, pp_rank=0,
                                           tp_rank=0, zero=0, precision="fp32")["grads"]


def test_gpu_ranks_keep_few_host_threads(monkeypatch):
    from shardwise import launch

    monkeypatch.setattr(launch, "available_cores", lambda: 16)  # the H100 machine's
    assert threads_per_rank(1, "cuda") == GPU_HOST_THREADS < threads_per_rank(1, "cpu") == 16
    assert threads_per_rank(8, "cuda") == 2 == threads_per_rank(8, "cpu")


def test_config_compile_layouts_and_unknown_attention():
    assert Config.load(overrides={"training.compile": True, "parallel.zero": 3,
                                  "parallel.dp": 2}).training.compile  # ZeRO-3 composes
    assert Config.load(overrides={"training.compile": True, "parallel.tp": 2,
                                  "parallel.dp": 1}).training.compile  # tp composes
    with pytest.raises(ConfigError, match="training.compile with parallel.tp=2 and "
                                          "model.dropout=0.1"):
        Config.load(overrides={"training.compile": True, "parallel.tp": 2, "parallel.dp": 1,
                               "model.dropout": 0.1})
    with pytest.raises(ConfigError, match="model.attention='flash': expected sdpa or math"):
        Config.load(overrides={"model.attention": "flash"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_step_never_waits_for_the_device():
    """bf16 on one GPU: a step with sync=False makes no host synchronisation (CUDA's sync
    debug mode raises on any)."""
    dev = torch.device("cuda")
    cfg = GPTConfig(**SMALL)
    s = EngineConfig(seq_len=SMALL["block_size"], parallel={"micro_batches": 2},
                     optimizer={"lr": 1e-2, "grad_clip": 1.0},
                     training={"precision": "bf16", "seed": 3, "global_batch_size": 4})
    engine = Engine(cfg, Topology.build(1, 1, 1), s, dev)
    x = torch.randint(0, SMALL["vocab_size"], (4, SMALL["block_size"] + 1), device=dev)
    engine.train_step(x[:, :-1], x[:, 1:], sync=False)  # first step: state allocation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        info = engine.train_step(x[:, :-1], x[:, 1:], sync=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert math.isfinite(settle(info)["loss"])


def test_resumed_fused_adamw_state_steps_like_the_loop(tmp_path):
    """A checkpoint loaded into an engine with fused AdamW (CUDA's default) continues like
    one with the loop: the restored ``step`` sits where the fused kernel reads it."""
    from shardwise.engine import state

    ref = _engine()
    _train(ref, steps=2)
    tensors = state.logical_tensors(ref)
    losses = {}
    for fused in (False, True):
        e = _engine(fused=fused)
        state.load_logical_tensors(e, tensors)
        losses[fused], _ = _train(e, steps=2)
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


@pytest.mark.parametrize("kind", ["gpt", "llama", "llama-window"])
def test_a_block_traces_into_one_graph_without_a_sequence_shard(kind, monkeypatch):
    """torch.compile cannot trace ``ContextVar.get``; with no ``models.sequence`` shard open
    (one process, plain causal: the single-GPU speed path) a block's attention and rotary
    read none, so dynamo captures the whole block, forward, as one graph (each graph break
    costs a GPU kernels' fusion across it and a return to Python). Inside ``use(shard)``
    the shard is read (a break is allowed there) and the block still computes the same.
    A sliding window in query chunks takes a mask per chunk, built in the graph while
    dynamo traces (``models.sequence.shared_mask``: its weak dictionary would break the
    graph at every mask)."""
    from shardwise.models import gpt, sequence
    from shardwise.models.llama import Llama, LlamaConfig
    from shardwise.models.sequence import SequenceShard, use

    monkeypatch.setattr(sequence, "_SHARDED", False)  # a process that has set no shard yet
    monkeypatch.setattr(gpt, "WINDOW_CHUNK", 4)  # the window's 16 queries in 4 chunks
    torch.manual_seed(0)
    window = {"sliding_window": 4} if kind == "llama-window" else {}
    model = (GPT(GPTConfig(**SMALL)) if kind == "gpt" else
             Llama(LlamaConfig(vocab_size=64, block_size=32, n_layer=1, n_head=4, n_kv_heads=2,
                               n_embd=64, ffn_hidden=96, **window)))
    block = model.blocks[0]
    x = torch.randn(2, 16, SMALL["n_embd"] if kind == "gpt" else 64)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, \
        [b.reason for b in explained.break_reasons]
    with use(SequenceShard()):  # an empty shard: whole sequences, plain causal
        torch.testing.assert_close(torch.compile(block, backend="eager")(x), block(x))
    torch._dynamo.reset()
