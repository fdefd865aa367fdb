"""Memory knobs beside recomputation: AdamW's moments in bf16 (``optimizer.state_dtype``)
and the optimizer in host memory (``training.offload = "optimizer"``; with
``"optimizer+params"`` ZeRO-3's parameter shards too).

One process trains the tiny GPT 4 steps with fp32 and with bf16 moments; one spawn of 2 ranks
trains ZeRO-1 (dp2) the same ways, ZeRO 0-3 (dp2) without and with offload, and two offload runs
cut after step 2 and resumed by a fresh trainer (in the same spawn), and ZeRO-3 (fp32, bf16)
with its parameter shards offloaded, one of them resumed the same way; one spawn of
8 ranks a 3D layout (dp2 x tp2 x pp2, SP, ZeRO-1, bf16) without and with offload, and the same
with ZeRO-3 without and with its parameter shards offloaded. bf16
moments are live (the losses differ from fp32's after the first step) and stay within the
documented bound of them; ZeRO-1 with bf16 moments is one process with bf16 moments within
fp32 rounding, and holds 4 bytes less per optimizer element. Offload trains as without it
(within fp32 rounding; here bit for bit) and reports its optimizer bytes as host-resident.
"""

import pytest
import torch

from ddp_workers import (
    resume_and_finish,
    run_all,
    tiny_config,
    train,
    train_and_checkpoint,
    train_each,
)
from helpers import REPO, rel_err
from shardwise.base.config import Config, ConfigError
from shardwise.engine.optimizer import LowPrecisionAdamW
from shardwise.launch import spawn

STEPS = 4
BF16 = {"precision": "bf16"}
# ZeRO 0-3 over two ranks, fp32 and bf16 compute: name -> (parallel, training)
OFFLOAD_2 = {"z0": ({"dp": 2}, {}), "z1-bf16": ({"dp": 2, "zero": 1}, BF16),
             "z2": ({"dp": 2, "zero": 2}, {}), "z3-bf16": ({"dp": 2, "zero": 3}, BF16)}
# training.offload = "optimizer+params" (ZeRO-3 only), fp32 and bf16 compute, against "none"
PARAMS = "optimizer+params"
PARAMS_2 = {"z3-fp32": ({"dp": 2, "zero": 3}, {}), "z3-bf16": OFFLOAD_2["z3-bf16"]}
# resumed after step CUT of STEPS, in the same spawn: name -> the uninterrupted run's name
# (ZeRO-2 fp32 with offload; ZeRO-1 bf16 with offload and activation offload; ZeRO-3 fp32
# with its parameter shards offloaded)
CUT = 2
RESUMES = {"resume-z2": "z2-optimizer", "resume-z1-act": "z1-bf16-act",
           "resume-z3-params": f"z3-fp32-{PARAMS}"}
THREE_D = {"dp": 2, "tp": 2, "pp": 2, "zero": 1, "sequence_parallel": True, "micro_batches": 2}
# the 8-rank spawn's runs: name -> (parallel, training.offload)
THREE_D_RUNS = {"3d-none": (THREE_D, "none"), "3d-optimizer": (THREE_D, "optimizer"),
                "3dz3-none": ({**THREE_D, "zero": 3}, "none"),
                f"3dz3-{PARAMS}": ({**THREE_D, "zero": 3}, PARAMS)}


def _cfg(corpus, out, state_dtype="fp32", **parallel) -> dict:
    return tiny_config(str(corpus), str(out), parallel={"dp": 1, **parallel},
                       optimizer={"state_dtype": state_dtype}, training={"steps": STEPS})


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """name -> per-rank results (one process: a list of one)."""
    tmp = tmp_path_factory.mktemp("knobs")
    out = {f"one-{d}": [train(_cfg(corpus, tmp / f"one-{d}", d))] for d in ("fp32", "bf16")}
    names = ["z1-fp32", "z1-bf16"]
    cfgs = [_cfg(corpus, tmp / n, n.split("-")[1], dp=2, zero=1) for n in names]
    for name, (parallel, training) in OFFLOAD_2.items():
        for off in ("none", "optimizer"):
            names.append(f"{name}-{off}")
            cfgs.append(tiny_config(str(corpus), str(tmp / names[-1]), parallel=parallel,
                                    training={"steps": STEPS, **training, "offload": off}))
    for name, (parallel, training) in PARAMS_2.items():
        for off in ("none", PARAMS):
            if f"{name}-{off}" not in names:
                names.append(f"{name}-{off}")
                cfgs.append(tiny_config(str(corpus), str(tmp / names[-1]), parallel=parallel,
                                        training={"steps": STEPS, **training, "offload": off}))
    names.append("z1-bf16-act")
    cfgs.append(tiny_config(str(corpus), str(tmp / names[-1]),
                            parallel={**OFFLOAD_2["z1-bf16"][0], "activation_offload": True},
                            training={"steps": STEPS, **BF16, "offload": "optimizer"}))
    calls = [(train_each, (cfgs,))]
    for name, straight in RESUMES.items():  # cut at step CUT, then a fresh trainer resumes
        cut = {**cfgs[names.index(straight)]}
        cut["training"] = {**cut["training"], "out_dir": str(tmp / name)}
        calls += [(train_and_checkpoint, (cut, CUT)), (resume_and_finish, (cut,))]
    ranks = spawn(run_all, 2, (calls,))
    out.update({n: [r[0][i] for r in ranks] for i, n in enumerate(names)})
    out.update({n: [r[2 + 2 * i] for r in ranks] for i, n in enumerate(RESUMES)})
    out["configs"] = dict(zip(names, cfgs))
    cfgs = [tiny_config(str(corpus), str(tmp / name), parallel=parallel,
                        model={"tie_weights": False},
                        training={"steps": STEPS, "precision": "bf16", "offload": off})
            for name, (parallel, off) in THREE_D_RUNS.items()]
    ranks = spawn(train_each, 8, (cfgs,))
    out.update({name: [r[i] for r in ranks] for i, name in enumerate(THREE_D_RUNS)})
    out["configs"].update(zip(THREE_D_RUNS, cfgs))
    return out


def test_bf16_moments_stay_within_their_bound_of_fp32_and_zero1_matches_one_process(runs):
    """bf16 moments: losses not equal to fp32 moments' after the first step (the knob is
    live) but within 1e-5 relative (measured 4.7e-7); every parameter within 1e-2 relative
    (each stored moment rounded by <= 2**-9 a step, so each update by ~1.5 x 2**-9: a bias
    that starts at zero is all updates; measured 1.9e-3 at most). ZeRO-1 with bf16 moments
    against one process with them: losses within 1e-5, parameters within 3e-5 (fp32 rounding of the
    reductions)."""
    fp32, bf16 = runs["one-fp32"][0], runs["one-bf16"][0]
    assert bf16["losses"][0] == fp32["losses"][0] and bf16["losses"] != fp32["losses"]
    for a, b in zip(bf16["losses"], fp32["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (bf16["losses"], fp32["losses"])
    errs = {n: rel_err(bf16["params"][n], p) for n, p in fp32["params"].items()}
    assert 0 < max(errs.values()) <= 1e-2, errs
    for rank in runs["z1-bf16"]:
        for a, b in zip(rank["losses"], bf16["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (rank["losses"], bf16["losses"])
        for n, p in bf16["params"].items():
            assert rel_err(rank["params"][n], p) <= 3e-5, (n, rel_err(rank["params"][n], p))


def test_bf16_moments_are_bf16_and_halve_their_bytes(runs):
    """Each rank's optimizer bytes under bf16 moments are 4 bytes per element fewer than under
    fp32 ones (``Engine.memory_bytes``, counted from the tensors the optimizer holds)."""
    for fp32, bf16 in zip(runs["z1-fp32"], runs["z1-bf16"]):
        assert bf16["optimizer_elements"] == fp32["optimizer_elements"] > 0
        assert (fp32["memory"]["optimizer"] - bf16["memory"]["optimizer"]
                == 4 * fp32["optimizer_elements"])


def test_the_memory_model_prices_bf16_moments(runs):
    """``engine.memory.predict_rank(state_bytes=4)`` (what ``shardwise memory`` prints for
    ``optimizer.state_dtype = "bf16"``) is what each ZeRO-1 rank holds, to the byte, and
    ``planner.memory.zero_bytes`` counts 4 bytes less per element of the shard."""
    from shardwise.engine.memory import predict_rank
    from shardwise.planner.memory import zero_bytes
    from shardwise.planner.specs import describe_config

    d = describe_config(Config.from_dict(runs["configs"]["z1-bf16"]))
    for rank in runs["z1-bf16"]:
        pred = predict_rank(d, dp=2, dp_rank=rank["coords"]["dp"], zero=1, precision="fp32",
                            state_bytes=4)
        assert pred["optimizer"] == rank["memory"]["optimizer"], (pred, rank["memory"])
    a, b = zero_bytes(1000, 2, 1, "bf16"), zero_bytes(1000, 2, 1, "bf16", state_bytes=4)
    assert a["optimizer"] - b["optimizer"] == 4 * 500


def test_low_precision_adamw_in_fp32_is_torch_adamw_and_fused_is_refused():
    """With fp32 moments the class's formulas are torch's AdamW's, bit for bit; a bf16 state
    stays bf16 after a load that cast it to fp32; fused kernels with bf16 moments: one line."""
    torch.manual_seed(0)
    w = torch.randn(8, 4)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    ours = LowPrecisionAdamW([a], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1,
                             state_dtype=torch.float32)
    ref = torch.optim.AdamW([b], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)
    for _ in range(3):
        g = torch.randn(8, 4)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.equal(a, b)
    low = LowPrecisionAdamW([a], lr=1e-2)
    a.grad = torch.randn(8, 4)
    low.step()
    low.load_state_dict(low.state_dict())
    low.step()
    assert low.state[a]["exp_avg"].dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="optimizer.fused=true with optimizer.state_dtype=bf16"):
        Config.from_dict({"optimizer": {"state_dtype": "bf16", "fused": True}})


def test_offload_trains_as_without_it_and_holds_the_optimizer_on_the_host(runs):
    """``training.offload = "optimizer"`` with ZeRO 0-3 (dp2; fp32 and bf16 compute) and a 3D
    layout (dp2 x tp2 x pp2, SP, ZeRO-1, bf16): losses and every parameter within fp32
    rounding of the same run without offload (1e-6 relative; here equal), the optimizer's
    bytes (masters, moments) counted as host-resident, the rest unchanged."""
    for name in [*OFFLOAD_2, "3d"]:
        for plain, off in zip(runs[f"{name}-none"], runs[f"{name}-optimizer"]):
            for a, b in zip(off["losses"], plain["losses"]):
                assert abs(a - b) <= 1e-6 * abs(b), (name, off["losses"], plain["losses"])
            for n, p in plain["params"].items():
                assert rel_err(off["params"][n].float(), p.float()) <= 1e-6, (name, n)
            assert plain["memory"]["host"] == 0, name
            assert off["memory"]["host"] == off["memory"]["optimizer"] > 0, name
            for k in ("params", "grads"):
                assert off["memory"][k] == plain["memory"][k], (name, k)


def test_resume_under_offload_equals_the_uninterrupted_run(runs):
    """A run with ``training.offload = "optimizer"`` (ZeRO-2, fp32), one with it and
    ``parallel.activation_offload`` (ZeRO-1, bf16), and one with ``"optimizer+params"``
    (ZeRO-3, fp32), saved after step 2 of 4 and resumed by a
    fresh trainer: the losses and every parameter equal the uninterrupted run's, bit for bit
    (the host-resident masters and moments travel in the checkpoint and come back there)."""
    for name, straight in RESUMES.items():
        assert len(runs[name]) == len(runs[straight]) == 2
        for resumed, plain in zip(runs[name], runs[straight]):
            assert resumed["resumed_at"] == CUT, name
            assert resumed["losses"] == plain["losses"], (name, resumed["losses"])
            for n, p in plain["params"].items():
                assert torch.equal(resumed["params"][n], p), (name, n)
            assert resumed["memory"] == plain["memory"], name


def test_offload_of_parameters_trains_as_without_it_and_holds_shards_on_the_host(runs):
    """``training.offload = "optimizer+params"`` with ZeRO-3 (dp2, fp32 and bf16 compute) and
    in a 3D layout (dp2 x tp2 x pp2, SP, ZeRO-3, bf16): losses and every parameter, on every
    rank, within fp32 rounding of the run without offload (1e-6 relative; here equal); the
    host holds the optimizer's bytes and the parameter shards (none of their own in fp32:
    the master is what is gathered), the device the gradient shards only."""
    for name in [*PARAMS_2, "3dz3"]:
        assert len(runs[f"{name}-{PARAMS}"]) == len(runs[f"{name}-none"]) > 1, name
        for plain, off in zip(runs[f"{name}-none"], runs[f"{name}-{PARAMS}"]):
            for a, b in zip(off["losses"], plain["losses"]):
                assert abs(a - b) <= 1e-6 * abs(b), (name, off["losses"], plain["losses"])
            for n, p in plain["params"].items():
                assert rel_err(off["params"][n].float(), p.float()) <= 1e-6, (name, n)
            mem = off["memory"]
            assert mem["host"] == mem["optimizer"] + mem["params"] > 0, (name, mem)
            assert mem["total"] - mem["host"] == mem["grads"] == plain["memory"]["grads"], name
            assert (mem["params"] > 0) == (name != "z3-fp32"), (name, mem)


def test_offload_of_parameters_without_zero3_is_refused_in_one_line():
    """Only ZeRO-3 keeps parameter shards between uses: ``"optimizer+params"`` with ZeRO 0-2
    is refused in one line naming both fields."""
    for zero in (0, 1, 2):
        with pytest.raises(ConfigError, match=f"training.offload=optimizer\\+params with "
                           f"parallel.zero={zero}: only ZeRO-3"):
            Config.from_dict({"training": {"offload": PARAMS}, "parallel": {"zero": zero}})
    Config.from_dict({"training": {"offload": PARAMS}, "parallel": {"zero": 3}})


def test_the_memory_model_prices_offload(runs):
    """``engine.memory.predict_rank(offload=True)`` (``shardwise memory --offload
    optimizer``) is what each rank holds under offload, ZeRO 0-3, to the byte: masters of
    their own even in fp32 (ZeRO-0's parameters, ZeRO-3's gathered shard are no longer
    them), the optimizer's bytes all host-resident."""
    from shardwise.engine.memory import predict_rank
    from shardwise.planner.specs import describe_config

    for name, (parallel, training) in OFFLOAD_2.items():
        cfg = Config.from_dict(runs["configs"][f"{name}-optimizer"])
        d = describe_config(cfg)
        for rank in runs[f"{name}-optimizer"]:
            pred = predict_rank(d, dp=2, dp_rank=rank["coords"]["dp"], zero=parallel.get("zero", 0),
                                precision=cfg.training.precision, offload=True)
            got = rank["memory"]
            assert {k: pred[k] for k in got} == got, (name, pred, got)


def test_the_memory_model_prices_offload_of_parameters(runs, capsys):
    """``predict_rank(offload_params=True)`` (``shardwise memory --offload optimizer+params``)
    is what each rank holds under ``"optimizer+params"`` (ZeRO-3 dp2 fp32 and bf16; the 3D
    layout's every rank), device and host, to the byte; ``planner.memory.zero_bytes`` prices
    the same split, and refuses it without ZeRO-3; ``shardwise memory`` prints the device
    column of ZeRO-3 alone, and refuses another stage (exit 2)."""
    from shardwise.cli.main import main
    from shardwise.engine.memory import predict_rank
    from shardwise.planner.memory import zero_bytes
    from shardwise.planner.specs import describe_config

    for name in [*PARAMS_2, "3dz3"]:
        cfg = Config.from_dict(runs["configs"][f"{name}-{PARAMS}"])
        p, d = cfg.parallel, describe_config(cfg)
        for rank in runs[f"{name}-{PARAMS}"]:
            c = rank["coords"]
            pred = predict_rank(d, dp=p.dp, pp=p.pp, tp=p.tp, dp_rank=c["dp"],
                                pp_rank=c["pp"], tp_rank=c["tp"], zero=3,
                                precision=cfg.training.precision,
                                sequence_parallel=p.sequence_parallel,
                                offload=True, offload_params=True)
            got = rank["memory"]
            assert {k: pred[k] for k in got} == got, (name, c, pred, got)
    for precision, params in (("fp32", 0), ("bf16", 2 * 500)):
        z = zero_bytes(1000, 2, 3, precision, offload=PARAMS)
        assert z["params"] == params and z["host"] == z["optimizer"] + params
        assert z["total"] - z["host"] == z["grads"]
    with pytest.raises(ValueError, match="ZeRO-3 only"):
        zero_bytes(1000, 2, 2, "bf16", offload=PARAMS)
    tiny = str(REPO / "configs/tiny.toml")
    assert main(["memory", "--config", tiny, "--dp", "2", "--offload", PARAMS]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2].split()[-1] == "device" and out[-1].split()[0] == "3", out
    assert main(["memory", "--config", tiny, "--offload", PARAMS, "--stages", "2,3"]) == 2
    assert "--offload optimizer+params with --stages 2,3: ZeRO-3 only" in capsys.readouterr().err


def test_activation_offload_wraps_every_block_and_changes_nothing(monkeypatch):
    """``parallel.activation_offload``: every block's forward runs under ``save_on_cpu``
    (counted: its saved tensors go through the hook), and
    the losses and parameters are bit for bit those without it (on the CPU no copy is made)."""
    from shardwise.base.topology import Topology
    from shardwise.engine import Engine, EngineConfig
    from shardwise.models.llama import LlamaConfig

    packed = []
    real = torch.autograd.graph.save_on_cpu

    class Counting(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pack = self.pack_hook
            self.pack_hook = lambda t: (packed.append(t.shape), pack(t))[1]

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Counting)
    cfg = LlamaConfig(vocab_size=96, block_size=16, n_layer=3, n_head=4, n_kv_heads=2,
                      n_embd=32, ffn_hidden=64)
    runs = []
    for offload in (False, True):
        torch.manual_seed(0)
        e = Engine(cfg, Topology.build(1, 1, 1), EngineConfig(
            seq_len=16, parallel={"micro_batches": 2, "activation_offload": offload},
            training={"seed": 3, "global_batch_size": 4}))
        assert e.offloaded == (["blocks.0", "blocks.1", "blocks.2"] if offload else [])
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(2):
            x = torch.randint(0, 96, (4, 17), generator=g)
            losses.append(e.train_step(x[:, :-1], x[:, 1:])["loss"])
        runs.append((losses, {n: p.detach().clone() for n, p in e.named_parameters()}))
        assert bool(packed) == offload
    assert runs[1][0] == runs[0][0]
    assert all(torch.equal(runs[1][1][n], p) for n, p in runs[0][1].items())


def test_the_memory_model_prices_activation_offload(monkeypatch, capsys):
    """``planner.memory.offloaded_activation_bytes`` (the host's part of
    ``parallel.activation_offload``: each block not checkpointed, its
    ``block_activation_bytes``) against the bytes of the distinct tensors ``save_on_cpu``
    received in one step (tiny GPT, 4 blocks, one micro-batch of 16 sequences), within 15%,
    with recompute none and "full" every 2nd block (measured 4.5% and 9.8% under); the
    device's part (``activation_bytes(offload=True)``) below the plain figure;
    ``shardwise memory --activation-offload`` prints both, and refuses selective (exit 2)."""
    from shardwise.base.topology import Topology
    from shardwise.cli.main import main
    from shardwise.engine import Engine, EngineConfig
    from shardwise.models.gpt import GPTConfig
    from shardwise.planner.memory import activation_bytes, offloaded_activation_bytes
    from shardwise.planner.specs import ModelSpec

    packed = {}
    real = torch.autograd.graph.save_on_cpu

    class Counting(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pack = self.pack_hook
            self.pack_hook = lambda t: (packed.__setitem__(
                t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()), pack(t))[1]

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Counting)
    mb, s = 16, 32
    cfg = GPTConfig(vocab_size=65, block_size=s, n_layer=4, n_head=4, n_embd=32)
    spec = ModelSpec("t", 4, 32, 4, 65, s, cfg.tie_weights, cfg.bias)
    kw = dict(mb=mb, tp=1, pp=1, micro_batches=1)
    for recompute, every in (("none", 1), ("full", 2)):
        packed.clear()
        torch.manual_seed(0)
        e = Engine(cfg, Topology.build(1, 1, 1), EngineConfig(
            seq_len=s, parallel={"micro_batches": 1, "activation_offload": True,
                                 "recompute": recompute, "recompute_every": every},
            training={"seed": 3, "global_batch_size": mb}))
        x = torch.randint(0, 65, (mb, s + 1), generator=torch.Generator().manual_seed(1))
        e.train_step(x[:, :-1], x[:, 1:])
        host = offloaded_activation_bytes(spec, **kw, recompute=recompute,
                                          recompute_every=every)
        got = sum(packed.values())
        assert abs(host - got) <= 0.15 * got, (recompute, host, got)
        device = activation_bytes(spec, **kw, recompute=recompute, recompute_every=every,
                                  offload=True)
        assert 0 < device < activation_bytes(spec, **kw, recompute=recompute,
                                             recompute_every=every), recompute
    assert main(["memory", "--config", str(REPO / "configs/tiny.toml"), "--dp", "1",
                 "--stages", "0", "--activation-offload"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "none + activation offload (device; host " in line, line
    assert main(["memory", "--config", str(REPO / "configs/tiny.toml"), "--dp", "1",
                 "--activation-offload", "--recompute", "selective"]) == 2
    assert "--activation-offload with --recompute selective" in capsys.readouterr().err


@pytest.mark.gpu
def test_transfers_order_their_copies_against_the_compute_stream():
    """CUDA: ``parallel.offload.Transfers`` copies on its side stream, ordered by events
    against the compute stream: a pinned host tensor brought to the device behind queued
    matmuls is read whole by the next kernel; a result copied back whose device tensor is
    freed (and its memory refilled) at once is intact after ``wait()`` (``record_stream``)."""
    from shardwise.parallel.offload import Transfers

    dev = torch.device("cuda")
    copies = Transfers(dev)
    host = torch.arange(1 << 22, dtype=torch.float32).pin_memory()
    a = torch.randn(2048, 2048, device=dev)
    for _ in range(8):  # queued work the side stream's copy overlaps
        a = a @ a / 2048
    x = copies.to_device(host)
    y = x * 2  # the compute stream, after the copy
    back = copies.to_host(y)
    del y
    torch.full((1 << 22,), -1.0, device=dev)  # would take y's memory without record_stream
    copies.wait()
    assert copies.stream != torch.cuda.current_stream(dev)
    assert back.is_pinned() and torch.equal(back, host * 2)
