"""The dgx-h200 preset: dgx-h100 but for its memory (141 GiB) and bandwidth (4.8 TB/s), with
the H100's measured constants (one die); a model over 78 GiB a GPU plans on it and not on
dgx-h100; memory-bound kernels run faster, GEMMs the same; an H200's kernel profile is
accepted on it and refused on dgx-h100."""

import json
from dataclasses import replace

import pytest

from helpers import assert_one_line_exit_2
from shardwise.cli.main import main
from shardwise.planner import kernels
from shardwise.planner.compute import Ops, block_ops, op_seconds
from shardwise.planner.hardware import (FIXED_PRESETS, GiB, H100_FP8, H100_GEMM_SCALE, PRESETS,
                                        get_cluster, per_op)
from shardwise.planner.search import plan
from shardwise.planner.specs import NAMED, SpecError


def _as_h100(c):
    """``c`` with the fields dgx-h200 may differ in set to dgx-h100's."""
    h100 = FIXED_PRESETS["dgx-h100"] if c.ops is None else PRESETS["dgx-h100"]
    c = replace(c, name=h100.name, gpu=h100.gpu, memory=h100.memory, mem_bw=h100.mem_bw,
                source=h100.source)
    return c if c.ops is None else replace(c, ops=replace(c.ops, name=h100.ops.name,
                                                          mem_bw=h100.ops.mem_bw))


def test_dgx_h200_is_dgx_h100_with_its_memory_and_bandwidth():
    fixed, h200 = FIXED_PRESETS["dgx-h200"], PRESETS["dgx-h200"]
    assert fixed.memory == h200.memory == 141 * GiB and fixed.mem_bw == h200.ops.mem_bw == 4.8e12
    assert h200.flops == pytest.approx(989.4e12) and h200.fp8_flops == H100_FP8
    assert "H200" in fixed.source and fixed.gpus_per_node == 8
    assert _as_h100(fixed) == FIXED_PRESETS["dgx-h100"]
    assert _as_h100(h200) == PRESETS["dgx-h100"]  # the H100's measured constants, every one
    assert h200.ops.gemm_eff == per_op(fixed, gemm_scale=H100_GEMM_SCALE).ops.gemm_eff
    assert get_cluster("dgx-h200") is h200 and get_cluster("dgx-h200", compute="fixed") is fixed


def test_a_model_over_78_gib_plans_on_h200_not_on_h100(tmp_path, capsys):
    spec = NAMED["llama2-7b"]  # 16 bytes a parameter with AdamW: about 100 GiB on one GPU
    feasible, _ = plan(spec, PRESETS["dgx-h200"], 1, 1, top=1)
    assert feasible and 78 * GiB < feasible[0].memory["total"] <= 139 * GiB
    none, pruned = plan(spec, PRESETS["dgx-h100"], 1, 1, top=1)
    assert not none and "more than the 78 GiB" in pruned[0].reason
    argv = ["plan", "--model", "llama2-7b", "--gpus", "1", "--global-batch", "1", "--top", "1"]
    out = tmp_path / "h200.toml"
    assert main(argv + ["--cluster", "dgx-h200", "--json", "--emit-toml", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cluster"]["name"] == "dgx-h200" and doc["cluster"]["gpu"] == "H200-SXM-141GB"
    assert out.exists()
    assert_one_line_exit_2(argv + ["--cluster", "dgx-h100"], capsys, "fits no layout", "78 GiB")


def test_plan_help_names_every_preset(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "dgx-h200" in PRESETS and all(name in text for name in PRESETS)


def test_memory_bound_faster_on_h200_gemms_the_same():
    h100, h200 = PRESETS["dgx-h100"], PRESETS["dgx-h200"]
    ops = block_ops(NAMED["llama3-8b"], 1, 1, False, "shardwise", 2)
    gemms, moves = Ops(ops.gemms, []), Ops([], ops.moves)
    assert op_seconds(h200, gemms) == op_seconds(h100, gemms)
    assert op_seconds(h200, gemms, fp8=True) == op_seconds(h100, gemms, fp8=True)
    assert op_seconds(h200, moves) == pytest.approx(op_seconds(h100, moves) * 3.35 / 4.8)
    # a whole step of a small model, memory-bound kernels and the optimizer a large share:
    # faster on the H200, but by less than the bandwidth (its GEMMs run as fast)
    t = {c: plan(NAMED["gpt2-124m"], PRESETS[c], 1, 8, top=1)[0][0].time["step"]
         for c in ("dgx-h100", "dgx-h200")}
    assert t["dgx-h100"] * 3.35 / 4.8 < t["dgx-h200"] < 0.97 * t["dgx-h100"]


def _profile(device: str) -> dict:
    return {"format": kernels.FORMAT, "device": device, "device_type": "cuda",
            "torch": "2.11.0+cu128", "date": "2026-12-02T00:00:00+00:00", "dtype": "bf16",
            "gemm": [{"flops": 1e7, "flops_per_s": 5e14}],
            "memory": [{"bytes": 1e6, "bytes_per_s": 3e12}]}


def test_kernel_profile_of_an_h200_is_for_dgx_h200(tmp_path, capsys):
    h200 = kernels.apply(PRESETS["dgx-h200"], _profile("NVIDIA H200"))
    assert h200.ops.gemm(1e9) == pytest.approx(1e9 / 5e14)
    with pytest.raises(SpecError, match="measured on 'NVIDIA H200'.*dgx-h100's GPU is the H100"):
        kernels.apply(PRESETS["dgx-h100"], _profile("NVIDIA H200"))
    with pytest.raises(SpecError, match="dgx-h200's GPU is the H200"):
        kernels.apply(PRESETS["dgx-h200"], _profile("NVIDIA H100 80GB HBM3"))
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(_profile("NVIDIA H200")))
    argv = ["plan", "--model", "gpt2-124m", "--gpus", "1", "--top", "1",
            "--kernels-profile", str(path)]
    assert main(argv + ["--cluster", "dgx-h200", "--json"]) == 0
    assert "kernel profile h200.json" in json.loads(capsys.readouterr().out)["cluster"]["compute"]
    assert_one_line_exit_2(argv + ["--cluster", "dgx-h100"], capsys, "--kernels-profile", "H200")
