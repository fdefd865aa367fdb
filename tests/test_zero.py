"""ZeRO-1, 2 and 3 against one process on the same global batch (ZeRO-3 compiled too), and
sharded resume."""

import pytest
import torch

from ddp_workers import (
    _result,
    _trainer,
    run_all,
    straight_and_resumed,
    tiny_config,
    train,
    train_infos,
)
from helpers import assert_one_line_exit_2
from shardwise.base.config import Config, ConfigError
from shardwise.launch import spawn
from test_ddp import assert_parity


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    return train(tiny_config(str(corpus), str(tmp_path_factory.mktemp("ref"))))


PARITY_CASES = [
    (1, 2, 1, 25.0),    # one bucket: each rank owns one contiguous half of all parameters
    (2, 2, 2, 0.004),   # many buckets, accumulation under no_sync
    (2, 4, 1, 0.004),
    (3, 2, 2, 25.0),    # parameters gathered per unit; accumulation reduce-scatters each time
    (3, 4, 1, 25.0),
]
BF16_ZEROS = [2, 3]
COMPILED_STEPS = 5
COMPILED_MODEL = {"kind": "llama", "n_kv_heads": 2, "multiple_of": 16}


def _parity_jobs(corpus, mktemp) -> dict:
    """Every multi-rank run of the parity tests: name -> (world size, fn, config). The
    compiled run comes first in its spawn: dynamo's counters are per process."""
    jobs = {"compiled": (2, "train_zero3_compiled", tiny_config(
        str(corpus), str(mktemp("z3-compiled")), model=COMPILED_MODEL,
        parallel={"dp": 2, "zero": 3}, training={"steps": COMPILED_STEPS, "compile": True}))}
    for zero, dp, micro_batches, bucket_mb in PARITY_CASES:
        jobs[("parity", zero, dp, micro_batches, bucket_mb)] = (dp, "train", tiny_config(
            str(corpus), str(mktemp("parity")), parallel={
                "dp": dp, "zero": zero, "micro_batches": micro_batches, "bucket_mb": bucket_mb}))
    for zero in BF16_ZEROS:
        jobs[("bf16", zero)] = (2, "train", tiny_config(
            str(corpus), str(mktemp("bf16")), parallel={"dp": 2, "zero": zero},
            training={"precision": "bf16"}))
    jobs["fp16"] = (2, "train_infos", tiny_config(
        str(corpus), str(mktemp("fp16")), parallel={"dp": 2, "zero": 1},
        training={"precision": "fp16", "initial_loss_scale": 2.0 ** 24, "steps": 12}))
    return jobs


@pytest.fixture(scope="module")
def parity_runs(corpus, tmp_path_factory):
    """``parity_runs(name)``: every rank's result of that job. One spawn per world size (2
    and 4) runs all of that size's jobs in turn (``run_all``), at the first test that needs
    one of them; each parametrised test then checks its own case."""
    jobs = _parity_jobs(corpus, tmp_path_factory.mktemp)
    fns = {"train": train, "train_infos": train_infos, "train_zero3_compiled": train_zero3_compiled}
    cache: dict = {}

    def get(name):
        ws = jobs[name][0]
        if ws not in cache:
            names = [n for n, (w, _, _) in jobs.items() if w == ws]
            try:
                ranks = spawn(run_all, ws, ([(fns[jobs[n][1]], (jobs[n][2],)) for n in names],))
            except Exception as e:  # every case of this size fails with it; no second spawn
                cache[ws] = e
                raise
            cache[ws] = {n: [r[i] for r in ranks] for i, n in enumerate(names)}
        if isinstance(cache[ws], Exception):
            raise cache[ws]
        return cache[ws][name]

    return get


@pytest.mark.parametrize("zero, dp, micro_batches, bucket_mb", PARITY_CASES)
def test_zero_matches_single_process(zero, dp, micro_batches, bucket_mb, reference, parity_runs):
    results = parity_runs(("parity", zero, dp, micro_batches, bucket_mb))
    assert len(results) == dp
    for r in results:
        assert_parity(r, reference)
        # this rank's AdamW holds moments only for its shard: about P/N elements
        assert r["optimizer_elements"] < 0.6 * r["parameter_elements"] * 2 / dp
    # the shards tile the parameters exactly: every element has exactly one owner
    assert sum(r["optimizer_elements"] for r in results) == results[0]["parameter_elements"]
    if zero >= 2:
        assert all(r["full_grads_after_backward"] == 0 for r in results)
    if zero == 3:  # between steps only the root unit (tied embedding) is materialised
        assert all(r["materialised_elements"] < 0.5 * r["parameter_elements"] for r in results)


def _saved_for_backward(trainer) -> dict:
    """One training step with a pack hook on what autograd saves for backward: how many
    saved tensors are views of a ZeRO-3 unit's flat buffer (the parameters, refilled in place
    before the unit's backward) and how many are shaped like a parameter (or its transpose)
    without being one (a copy, which a freed and refilled buffer would leave stale)."""
    units = [u for part in trainer.engine.sync.parts for u in part._all]  # a ZeroStage3 per chunk
    buffers = {u.full.untyped_storage()._cdata for u in units}
    shapes = {tuple(p.shape) for u in units for p in u.params}
    seen = {"views": 0, "copies": 0}

    def pack(t):
        if t.untyped_storage()._cdata in buffers:
            seen["views"] += 1
        elif tuple(t.shape) in shapes or tuple(t.shape[::-1]) in shapes:
            seen["copies"] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.train_step()
    return seen


def train_zero3_compiled(cfg_dict: dict) -> dict:
    """``ddp_workers.train`` with dynamo's counters after step 2 and after the last step,
    and what the compiled blocks saved for backward at step 3."""
    from torch._dynamo.utils import counters

    trainer = _trainer(cfg_dict)
    out = {}
    for step in range(1, trainer.cfg.training.steps + 1):
        if step == 3:
            out["saved"] = _saved_for_backward(trainer)
        else:
            trainer.train_step()
        if step in (2, trainer.cfg.training.steps):
            out[step] = {"graphs": int(counters["stats"]["unique_graphs"]),
                         "frames": int(counters["frames"]["total"])}
    return _result(trainer) | out


def test_compiled_zero3_trains_like_one_eager_process(corpus, tmp_path, parity_runs):
    """``training.compile`` with ZeRO-3 at dp = 2 (a Llama with grouped-query attention,
    fp32): ZeRO-3's forward hooks are ``torch.compiler.disable``d, so each unit's gather and
    free run eagerly around its compiled block. Five steps, so the weights change between
    steps: a compiled graph holding a stale copy of a parameter would part from the eager
    run after the first optimizer step. Checked: the run equals one eager process within
    1e-4 (Inductor's fused fp32 kernels round differently); dynamo compiled graphs and
    neither graphs nor frames were added after step 2 (no recompilation per step, though
    the buffers are freed and refilled); the compiled blocks save the parameters
    themselves for backward (views of the refilled buffers), no copies."""
    steps = COMPILED_STEPS
    ref = train(tiny_config(str(corpus), str(tmp_path / "ref"), model=COMPILED_MODEL,
                            training={"steps": steps}))
    results = parity_runs("compiled")
    assert len(results) == 2
    for r in results:
        assert r[2]["graphs"] > 0  # it compiled: not an eager run under another name
        assert r[steps] == r[2], r  # no recompiles once every layer has run forward/backward
        assert r["saved"]["views"] > 0 and r["saved"]["copies"] == 0, r["saved"]
        assert_parity(r, ref, rtol=1e-4)


RESUME_CASES = [(2, "fp32"), (3, "fp32"), (3, "bf16")]


@pytest.fixture(scope="module")
def resumes(corpus, tmp_path_factory):
    """Two spawns of 2 for every case: the uninterrupted runs and the runs cut at step 4 (in
    turn), then the resumes, in fresh processes. (zero, precision) -> (straight, resumed)."""
    runs = {}
    for zero, precision in RESUME_CASES:
        root = tmp_path_factory.mktemp(f"resume-z{zero}-{precision}")
        sections = {"parallel": {"dp": 2, "zero": zero, "bucket_mb": 0.004},
                    "training": {"steps": 8, "precision": precision}}
        runs[zero, precision] = ((train, (tiny_config(str(corpus), str(root / "full"),
                                                      **sections),)),
                                 tiny_config(str(corpus), str(root / "cut"), **sections))
    return straight_and_resumed(runs)


@pytest.mark.parametrize("zero, precision", RESUME_CASES)
def test_zero_resume_matches_uninterrupted_run(zero, precision, resumes):
    """bf16 too: the fp32 masters travel in the checkpoint, not the rounded weights."""
    straight, resumed = resumes[zero, precision]
    assert len(straight) == len(resumed) == 2
    for rank in range(2):
        assert resumed[rank]["resumed_at"] == 4
        assert resumed[rank]["losses"] == straight[rank]["losses"]
        for name, p in straight[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][name], p), name


@pytest.mark.parametrize("stage", [-1, 4])
def test_bad_stage_is_one_line(stage):
    with pytest.raises(ConfigError, match=f"parallel.zero={stage}"):
        Config.from_dict({"parallel": {"zero": stage}})


@pytest.mark.parametrize("zero", BF16_ZEROS)
def test_bf16_tracks_fp32(zero, reference, parity_runs):
    losses = torch.tensor(parity_runs(("bf16", zero))[0]["losses"])
    ref = torch.tensor(reference["losses"])
    # bf16 keeps 8 bits of mantissa: ~0.4% per operation; the loss tracks within 2%
    assert ((losses - ref).abs() <= 0.02 * ref).all(), (losses, ref)
    assert not torch.equal(losses, ref)  # it really computed in bf16


def test_fp16_skips_overflowing_steps_and_recovers(parity_runs):
    r0, r1 = parity_runs("fp16")
    skipped = [i["skipped"] for i in r0["infos"]]
    assert skipped == [i["skipped"] for i in r1["infos"]]  # the group agrees on every skip
    assert skipped[0] and not skipped[-1], skipped
    first_real = skipped.index(False)
    scales = [i["loss_scale"] for i in r0["infos"]]
    assert scales[first_real] == 2.0 ** 24 / 2 ** first_real  # halved once per overflow
    assert r0["losses"][-1] < r0["losses"][first_real]  # and then it trains


def test_fp16_needs_scaling():
    with pytest.raises(ConfigError, match="training.loss_scaling=false"):
        Config.from_dict({"parallel": {"zero": 1},
                          "training": {"precision": "fp16", "loss_scaling": False}})


MEMORY_CASES = [(1, 2, "bf16"), (2, 2, "bf16"), (3, 2, "bf16"), (2, 4, "bf16"), (3, 4, "fp32")]


@pytest.fixture(scope="module")
def memory_reports(corpus, tmp_path_factory):
    """One spawn per dp (2, 4) measures every case of that size in turn (bytes of the
    tensors each engine holds: no process-wide measure). (zero, dp, precision) -> reports."""
    from ddp_workers import memory_after_steps

    out = {}
    for dp in sorted({c[1] for c in MEMORY_CASES}):
        cases = [c for c in MEMORY_CASES if c[1] == dp]
        calls = [(memory_after_steps, (tiny_config(
            str(corpus), str(tmp_path_factory.mktemp("memory")), parallel={"dp": dp, "zero": z},
            training={"precision": p, "steps": 2}),)) for z, _, p in cases]
        ranks = spawn(run_all, dp, (calls,))
        out |= {case: [r[i] for r in ranks] for i, case in enumerate(cases)}
    return out


@pytest.mark.parametrize("zero, dp, precision", MEMORY_CASES)
def test_memory_matches_the_formulas_exactly(zero, dp, precision, memory_reports):
    """4P + 12P/N, 2P + 14P/N, 16P/N bytes (bf16), measured from the tensors each rank
    holds after a step; the only difference allowed is stated: no Adam moments (8 bytes
    each) for the padding elements a rank owns."""
    reports = memory_reports[zero, dp, precision]
    assert len(reports) == dp
    for r in reports:
        pred, meas = r["predicted"], r["measured"]
        assert meas["params"] == pred["params"], r
        assert meas["grads"] == pred["grads"], r
        assert meas["optimizer"] == pred["optimizer"] - 8 * r["padding_owned"], r
        assert r["padded_numel"] - r["numel"] < dp * 64  # padding: < N per bucket or unit
    P = reports[0]["padded_numel"]
    if precision == "bf16" and zero == 3:
        assert pred["total"] == 16 * P // dp
    if precision == "bf16" and zero == 2:
        assert pred["total"] == 2 * P + 14 * P // dp


def test_memory_command_formulas_and_bad_input(capsys):
    from shardwise.cli.main import main

    # the paper's example (Rajbhandari et al., Figure 1): 7.5B parameters on 64 ranks
    assert main(["memory", "--params", "7.5e9", "--dp", "64", "--precision", "bf16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "in GB (1 GB = 1e+09 bytes: decimal, as the ZeRO paper's" in out[0]  # named unit
    totals = [float(line.split()[4]) for line in out[2:6]]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    assert_one_line_exit_2(["memory", "--stages", "0,4"], capsys, "--stages")


def test_memory_command_predicts_interleaved_zero3(capsys):
    """``shardwise memory --chunks-per-rank 2``: every rank of dp 2 x pp 2 with two chunks
    each, ZeRO-3 (a ``ZeroStage3`` per chunk), as ``predict_rank`` predicts it; the flag
    needs a model."""
    from shardwise.cli.main import main

    assert main(["memory", "--config", "configs/tiny.toml", "--dp", "2", "--pp", "2",
                 "--chunks-per-rank", "2", "--stages", "3", "--precision", "fp32"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "dp=2 x pp=2 (v=2) x tp=1" in out[0]
    assert out[1].split()[:3] == ["zero", "pp", "params"]  # no tp column: tp = 1
    rows = [line.split() for line in out[2:]]
    assert [r[:2] for r in rows] == [["3", "0"], ["3", "1"]]
    assert float(rows[0][2]) == 0.0 and float(rows[0][3]) > 0  # fp32: the master is the shard
    assert_one_line_exit_2(["memory", "--params", "1e6", "--chunks-per-rank", "2"], capsys,
                           "--chunks-per-rank need a model")
