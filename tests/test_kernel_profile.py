"""Kernel profiles: ``shardwise bench calibrate`` writes one on the CPU (every section, the
device, torch and date, positive times) that loads back; bad input exits 2 in one line and
writes nothing; ``plan --kernels-profile`` prices GEMMs from a profile's rows (twice the
efficiency: half the seconds; capped at the datasheet peak) and refuses another GPU's."""

import datetime
import json

import pytest

from helpers import assert_one_line_exit_2
from shardwise.cli.main import main
from shardwise.planner import kernels
from shardwise.planner.compute import Ops, block_ops, op_seconds
from shardwise.planner.hardware import PRESETS
from shardwise.planner.kernel_bench import block_gemm_shapes
from shardwise.planner.specs import NAMED, SpecError, load_model

TINY = "configs/tiny.toml"


def test_calibrate_quick_cpu_writes_a_profile_that_loads(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert main(["bench", "calibrate", "--quick", "--model", TINY, "--out", str(out)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["k.json"]  # no temporary file left
    prof = kernels.load(out)
    assert prof["device_type"] == "cpu" and prof["device"] and prof["dtype"] == "fp32"
    assert prof["torch"] == __import__("torch").__version__
    date = datetime.datetime.fromisoformat(prof["date"])
    assert date.utcoffset() == datetime.timedelta(0)
    spec = load_model(TINY)
    shapes = {(t, i, o) for tp in (1, 2) for _, t, i, o in block_gemm_shapes(spec, 32, tp)}
    assert {(r["tokens"], r["in"], r["out"]) for r in prof["gemm"]} == shapes
    for r in prof["gemm"]:
        assert r["seconds"] > 0 and r["flops_per_s"] == pytest.approx(r["flops"] / r["seconds"])
        assert r["efficiency"] is None  # no datasheet peak for a CPU
    kinds = {r["kernel"] for r in prof["attention"]}
    assert "math" in kinds and kinds.isdisjoint(prof["attention_unavailable"])
    assert all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in prof["attention"])
    assert len(prof["memory"]) >= 2 and all(r["bytes_per_s"] > 0 for r in prof["memory"])
    opt = prof["optimizer"]
    assert opt["kernel"] == "foreach=False" and opt["seconds_per_param"] > 0
    assert opt["params"] == sum(i * o for _, _, i, o in block_gemm_shapes(spec, 1)) + 4 * 32
    assert prof["collectives"]["measured_by"] == "shardwise bench comm --calibrate"
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SpecError, match="measured on .*dgx-h100's GPU is the H100"):
        kernels.apply(PRESETS["dgx-h100"], prof, str(out))  # a CPU's profile: no GPU's


@pytest.mark.parametrize("model", [TINY, "gpt2-124m", "llama3-8b"])
@pytest.mark.parametrize("tp", [1, 2])
def test_block_gemm_shapes_are_the_gemms_block_ops_prices(model, tp):
    spec = load_model(model)
    ops = block_ops(spec, 2, tp, False, "shardwise", 2)
    T = 2 * spec.block_size
    assert [2 * t * i * o for _, t, i, o in block_gemm_shapes(spec, T, tp)] == [
        g for j, g in enumerate(ops.gemms) if j not in (1, 2)]  # [1:3]: the attention core


def test_block_gemm_shapes_of_a_mixture_are_an_experts():
    spec = NAMED["mixtral-8x7b"]
    T, tp = 2 * spec.block_size, 2
    gemms = block_ops(spec, 2, tp, False, "shardwise", 2).gemms
    mlp = {2 * t * i * o for name, t, i, o in block_gemm_shapes(spec, T, tp) if "mlp" in name}
    assert mlp == set(gemms[5:]) and len(gemms[5:]) == 3 * spec.n_experts  # [4]: the router


def test_calibrate_bad_input_one_line_exit_2_no_file(tmp_path, capsys):
    import torch

    (tmp_path / "afile").write_text("x")
    cases = [(["--device", "tpu"], "--device"), (["--dtype", "int3"], "--dtype"),
             (["--model", "no-such-model"], "--model"),
             (["--model", "configs/fashion_cnn.toml"], "--model configs/fashion_cnn.toml"),
             (["--out", str(tmp_path)], "--out"),
             (["--out", str(tmp_path / "afile" / "k.json")], "--out")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "--device cuda"))
    for argv, needle in cases:
        assert_one_line_exit_2(["bench", "calibrate", "--quick", "--model", TINY,
                                "--out", str(tmp_path / "k.json")] + argv, capsys, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_profile_written_whole_or_not_at_all(tmp_path, monkeypatch, capsys):
    """A full disk at the rename: one line naming --out, exit 2, no file and no temporary
    one left (``base.files.replacing``); the measurement itself stubbed."""
    from shardwise.base import files
    from shardwise.planner import kernel_bench

    out = tmp_path / "k.json"

    def fail(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(kernel_bench, "measure", lambda *a: {"gemm": []})
    monkeypatch.setattr(files.os, "replace", fail)
    assert_one_line_exit_2(["bench", "calibrate", "--quick", "--model", TINY,
                            "--out", str(out)], capsys, f"--out {out}", "No space left")
    assert list(tmp_path.iterdir()) == []


def _profile(device: str, eff: dict[float, float], peak: float, dtype: str = "bf16") -> dict:
    """A hand-written profile: GEMMs of the given GFLOPs at efficiency x ``peak``."""
    return {"format": kernels.FORMAT, "device": device, "device_type": "cuda",
            "torch": "2.11.0+cu128", "date": "2026-12-02T00:00:00+00:00", "dtype": dtype,
            "gemm": [{"flops": g * 1e9, "flops_per_s": e * peak} for g, e in eff.items()],
            "memory": [{"bytes": 1e6, "bytes_per_s": 1e12}]}


def _gemm_seconds(cluster, spec, mb=1, tp=1) -> float:
    return op_seconds(cluster, Ops(block_ops(spec, mb, tp, False, "shardwise", 2).gemms, []))


def test_profile_efficiency_prices_gemms():
    h100 = PRESETS["dgx-h100"]
    spec = NAMED["gpt2-124m"]
    peak = h100.ops.matrix_flops
    one = kernels.apply(h100, _profile("NVIDIA H100 80GB HBM3", {0.01: 0.3}, peak))
    two = kernels.apply(h100, _profile("NVIDIA H100 80GB HBM3", {0.01: 0.6}, peak))
    gemms = block_ops(spec, 1, 1, False, "shardwise", 2).gemms
    assert _gemm_seconds(one, spec) == pytest.approx(sum(gemms) / (0.3 * peak), rel=1e-12)
    assert _gemm_seconds(one, spec) == pytest.approx(2 * _gemm_seconds(two, spec), rel=1e-12)
    assert _gemm_seconds(one, spec) != pytest.approx(_gemm_seconds(h100, spec), rel=1e-3)
    # a profile faster than the datasheet is capped at it
    fast = kernels.apply(h100, _profile("NVIDIA H100 80GB HBM3", {0.01: 1.7}, peak))
    assert _gemm_seconds(fast, spec) == pytest.approx(sum(gemms) / peak, rel=1e-12)
    # rows by size: a GEMM at the efficiency of the largest measured one it reaches
    steps = kernels.apply(h100, _profile("NVIDIA H100 80GB HBM3", {0.5: 0.2, 2.0: 0.8}, peak))
    assert steps.ops.gemm(1e9) == pytest.approx(1e9 / (0.2 * peak))
    assert steps.ops.gemm(1e8) == pytest.approx(1e8 / (0.2 * peak))  # below every row
    assert steps.ops.gemm(3e9) == pytest.approx(3e9 / (0.8 * peak))
    # memory-bound operations from the memory rows, over the preset's bandwidth
    assert one.ops.memory(4e6) == pytest.approx(h100.ops.mem_scale * 4e6 / 1e12)


def _plan_compute(capsys, *extra) -> tuple[float, str]:
    argv = ["plan", "--model", "gpt2-124m", "--cluster", "dgx-h100", "--gpus", "1",
            "--global-batch", "8", "--top", "1", "--json", *extra]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    return doc["layouts"][0]["split_s"]["compute"], doc["cluster"]["compute"]


def test_plan_kernels_profile(tmp_path, capsys):
    peak = PRESETS["dgx-h100"].ops.matrix_flops
    paths = {}
    for e in (0.3, 0.6):
        paths[e] = tmp_path / f"e{e}.json"
        paths[e].write_text(json.dumps(_profile("NVIDIA H100 80GB HBM3", {0.01: e}, peak)))
    base, name = _plan_compute(capsys)
    slow, slow_name = _plan_compute(capsys, "--kernels-profile", str(paths[0.3]))
    fast, _ = _plan_compute(capsys, "--kernels-profile", str(paths[0.6]))
    assert "kernel profile e0.3.json" in slow_name and "kernel profile" not in name
    assert slow > fast and slow != base
    # another GPU's profile, a CPU's, or a dtype the preset does not compute in: refused
    a100 = tmp_path / "a100.json"
    a100.write_text(json.dumps(_profile("NVIDIA A100-SXM4-80GB", {0.01: 0.5}, peak)))
    fp32 = tmp_path / "fp32.json"
    fp32.write_text(json.dumps(_profile("NVIDIA H100 80GB HBM3", {0.01: 0.5}, peak, "fp32")))
    argv = ["plan", "--model", "gpt2-124m", "--cluster", "dgx-h100", "--gpus", "1"]
    assert_one_line_exit_2(argv + ["--kernels-profile", str(a100)], capsys,
                           "--kernels-profile", "A100", "H100")
    assert_one_line_exit_2(argv + ["--kernels-profile", str(fp32)], capsys,
                           "--kernels-profile", "fp32")
    assert_one_line_exit_2(argv + ["--kernels-profile", str(tmp_path / "none.json")], capsys,
                           "--kernels-profile", "cannot read")
    assert_one_line_exit_2(argv + ["--kernels-profile", str(paths[0.3]), "--compute",
                                   "fixed"], capsys, "--kernels-profile", "per-op")
    assert_one_line_exit_2(["plan", "--model", "gpt2-124m", "--cluster", "local",
                            "--kernels-profile", str(paths[0.3])], capsys,
                           "--kernels-profile", "local")
