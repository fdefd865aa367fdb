"""Pipeline schedules against one process on the same global batches: losses and parameters
agree (per-tensor relative error <= 1e-5) over 5 AdamW steps, with and without
recomputation; PipeDream's weight stashing; activation memory; bad layouts."""

import pytest
import torch

from helpers import rel_err
from pipeline_workers import make_engine, pipedream_reference, reference, run_groups
from shardwise.base.topology import Topology
from shardwise.cli import timeline as timeline_cli
from shardwise.launch import spawn
from shardwise.parallel.pipeline import timeline

RTOL = 1e-5


@pytest.fixture(scope="module")
def ref():
    return reference()


def assert_parity(results: list[dict], ref: dict) -> None:
    """``results``: one entry per rank for one configuration."""
    assert ref["losses"][-1] < ref["losses"][0]  # weights really moved
    assert len(results[0]["losses"]) == len(ref["losses"])
    for r in results:
        losses, ref_losses = torch.tensor(r["losses"]), torch.tensor(ref["losses"])
        assert ((losses - ref_losses).abs() <= RTOL * ref_losses.abs()).all(), (losses, ref_losses)
    for dp_rank in {r["dp_rank"] for r in results}:
        params = {}
        for r in results:
            if r["dp_rank"] == dp_rank:
                assert not params.keys() & r["params"].keys()  # each weight on one stage
                params.update(r["params"])
        assert params.keys() == ref["params"].keys()
        for name, p in ref["params"].items():
            assert rel_err(params[name], p) <= RTOL, (name, rel_err(params[name], p))


FLUSH = [
    {"schedule": "naive", "micro_batches": 2},
    {"schedule": "gpipe", "micro_batches": 4},
    {"schedule": "1f1b", "micro_batches": 4},
    {"schedule": "interleaved", "micro_batches": 4, "chunks_per_rank": 2},
]
WITH_RECOMPUTE = FLUSH + [dict(c, recompute=True) for c in FLUSH[1:]]
PIPEDREAM_PP2 = [{"schedule": "pipedream", "micro_batches": 4}]
PP4 = [
    {"schedule": "gpipe", "micro_batches": 4},
    {"schedule": "1f1b", "micro_batches": 8, "partition": "params"},
    {"schedule": "interleaved", "micro_batches": 4, "chunks_per_rank": 2, "recompute": True},
    {"schedule": "1f1b", "micro_batches": 4, "recompute": True},
    # memory at m = 8: GPipe holds 8 micro-batches per rank, 1F1B at most p - rank
    {"schedule": "gpipe", "micro_batches": 8},
    {"schedule": "1f1b", "micro_batches": 8, "recompute": True},
    {"schedule": "pipedream", "micro_batches": 2},
]
SMALL = {"bucket_mb": 1 / 128, "first_bucket_mb": 1 / 128}
# zero-bubble schedules (split backward): pp = 2 with and without recomputation (timelines
# saved), pp = 4, and dp = 2 x pp = 2 with ZeRO-1 and ZeRO-2 in small buckets; DualPipeV
# (fused and split backwards in one schedule) in each
ZB_PP2 = [{"schedule": "zb1p", "micro_batches": 4},
          {"schedule": "zbv", "micro_batches": 4, "chunks_per_rank": 2},
          {"schedule": "zb1p", "micro_batches": 4, "recompute": True},
          {"schedule": "zbv", "micro_batches": 2, "chunks_per_rank": 2, "recompute": True},
          {"schedule": "dualpipev", "micro_batches": 4, "chunks_per_rank": 2}]
ZB_PP4 = [{"schedule": "zb1p", "micro_batches": 8},
          {"schedule": "zbv", "micro_batches": 4, "chunks_per_rank": 2},
          {"schedule": "dualpipev", "micro_batches": 8, "chunks_per_rank": 2}]
ZB_DP2_PP2 = [{"schedule": "zb1p", "micro_batches": 4, "zero": 1, **SMALL},
              {"schedule": "zbv", "micro_batches": 2, "chunks_per_rank": 2, "zero": 2, **SMALL},
              {"schedule": "zbv", "micro_batches": 4, "chunks_per_rank": 2, **SMALL},
              {"schedule": "dualpipev", "micro_batches": 4, "chunks_per_rank": 2, "zero": 1,
               **SMALL}]
DP2_PP2 = [{"schedule": "gpipe", "micro_batches": 2, **SMALL},
           {"schedule": "1f1b", "micro_batches": 4, "recompute": True},
           {"schedule": "interleaved", "micro_batches": 2, "chunks_per_rank": 2, **SMALL}]


@pytest.fixture(scope="module")
def ws2(tmp_path_factory):
    """One spawn of 2: every flush schedule at pp = 2 (5 steps, timelines saved under
    ``run_dir``), then PipeDream at m = 4 (12 steps). -> (runs, run_dir)."""
    run_dir = tmp_path_factory.mktemp("timelines")
    ranks = spawn(run_groups, 2, ([(1, 2, WITH_RECOMPUTE, 5, str(run_dir)),
                                   (1, 2, PIPEDREAM_PP2, 12),
                                   (1, 2, ZB_PP2, 5, str(run_dir / "zb"))],))
    return [[r[g] for r in ranks] for g in range(3)], run_dir


@pytest.fixture(scope="module")
def ws4():
    """One spawn of 4: pp = 4 (``PP4``), then dp = 2 x pp = 2 (``DP2_PP2``), then the
    zero-bubble schedules (``ZB_PP4``, ``ZB_DP2_PP2``)."""
    ranks = spawn(run_groups, 4, ([(1, 4, PP4), (2, 2, DP2_PP2), (1, 4, ZB_PP4),
                                   (2, 2, ZB_DP2_PP2)],))
    return [[r[g] for r in ranks] for g in range(4)]


def test_pp2_matches_single_process_and_records_timelines(ref, ws2):
    (results, _, _), tmp_path = ws2
    for i, cfg in enumerate(WITH_RECOMPUTE):
        assert_parity([rank[i] for rank in results], ref)
    # every rank recorded the last step: one forward and one backward per (mb, chunk) held
    for i, cfg in enumerate(WITH_RECOMPUTE):
        events, meta = timeline.load(tmp_path / str(i))
        comp = [e for e in events if e["kind"] in ("Forward", "Backward")]
        assert len(comp) == 2 * cfg["micro_batches"] * 2 * cfg.get("chunks_per_rank", 1)
        assert all(e["end"] >= e["start"] for e in events)
        assert 0.0 < timeline.idle_fraction(events) < 1.0
    assert timeline_cli.main([str(tmp_path / "2"), "--out", str(tmp_path / "1f1b.png")]) == 0
    assert (tmp_path / "1f1b.png").stat().st_size > 10_000


def test_pp4_parity_memory_and_pipedream(ref, ws4):
    results = ws4[0]
    assert len(results) == 4 and all(len(rank) == len(PP4) for rank in results)
    for i in range(4):
        assert_parity([rank[i] for rank in results], ref)
    # PipeDream, no flush: rank r ends step k with min(p - r - 1, 2 (k + 1)) in flight, and
    # matches one process running the same stream (stashed weights, a step per backward)
    assert_parity([rank[6] for rank in results], pipedream_reference(4, 2, 5))
    assert [rank[6]["in_flight"] for rank in results] == [[min(3 - r, 2 * (k + 1)) for k in range(5)]
                                                          for r in range(4)]
    gpipe, ofob, ofob_rc = ([rank[i]["peak_activation_bytes"] for rank in results] for i in (4, 1, 5))
    assert ofob[0] < gpipe[0] and ofob_rc[0] < ofob[0], (gpipe, ofob, ofob_rc)
    assert max(ofob) < max(gpipe) and max(ofob_rc) < max(ofob)


def test_dp2_pp2_matches_single_process(ref, ws4):
    """dp gradients go in buckets (8 KiB here: several per stage), each all-reduced as soon as
    its chunk's last backward has run, before the optimizer step."""
    cfgs, results = DP2_PP2, ws4[1]
    assert len(results) == 4
    for i in range(len(cfgs)):
        assert_parity([rank[i] for rank in results], ref)
        for rank in results:
            n, early = rank[i]["buckets"]
            assert early == n and (n > 2 if "bucket_mb" in cfgs[i] else n <= 2), rank[i]["buckets"]


def test_zero_bubble_schedules_match_single_process(ref, ws2, ws4):
    """zb1p, zbv and dualpipev (backward split into B and W; dualpipev fuses some) at pp = 2
    (with recomputation too), pp = 4 and dp = 2 x pp = 2 under ZeRO-1/2 and dp buckets:
    losses and parameters as one process; every bucket launched before the schedule's end
    (from the chunk's last W or fused backward)."""
    (_, _, pp2), run_dir = ws2
    for i in range(len(ZB_PP2)):
        assert_parity([rank[i] for rank in pp2], ref)
    for i in range(len(ZB_PP4)):
        assert_parity([rank[i] for rank in ws4[2]], ref)
    for i, cfg in enumerate(ZB_DP2_PP2):
        assert_parity([rank[i] for rank in ws4[3]], ref)
        if not cfg.get("zero"):
            for rank in ws4[3]:
                n, early = rank[i]["buckets"]
                assert early == n and n > 2, rank[i]["buckets"]
    # the recorded timeline: one F and one B (split: B then W) per (micro-batch, chunk)
    # held, each W after its B, no fused one but in dualpipev; nothing in flight after a step
    for i, cfg in enumerate(ZB_PP2):
        events, _ = timeline.load(run_dir / "zb" / str(i))
        n = cfg["micro_batches"] * 2 * cfg.get("chunks_per_rank", 1)
        count = {k: sum(e["kind"] == k for e in events)
                 for k in ("Forward", "Backward", "BackwardInput", "BackwardWeight")}
        assert count["Forward"] == count["Backward"] + count["BackwardInput"] == n, cfg
        assert count["BackwardWeight"] == count["BackwardInput"], cfg
        assert (count["Backward"] > 0) == (cfg["schedule"] == "dualpipev"), count
        b = {(e["rank"], e["mb"], e["chunk"]): e["end"] for e in events
             if e["kind"] == "BackwardInput"}
        assert all(e["start"] >= b[(e["rank"], e["mb"], e["chunk"])] for e in events
                   if e["kind"] == "BackwardWeight")
        assert all(r["in_flight"] == [0] * 5 for r in [rank[i] for rank in pp2])


def test_pipedream_stashes_weights_and_learns(ws2):
    """Each micro-batch's backward differentiates the very weights its forward used, although
    the live weights moved in between (earlier stages step p - rank - 1 times meanwhile); the
    stream never drains between steps and matches one process running it; the loss falls."""
    results = ws2[0][1]
    assert_parity([rank[0] for rank in results], pipedream_reference(2, 4, 12))
    assert [rank[0]["in_flight"] for rank in results] == [[1] * 12, [0] * 12]
    moved = 0
    for rank in results:
        res = rank[0]
        assert res["versions"]
        seen_fwd: dict = {}
        for v in res["versions"]:
            key = (v["mb"], v["chunk"])
            if v["pass"] == "forward":
                seen_fwd[key] = v
                continue
            f = seen_fwd.pop(key)
            assert v["checksum"] == f["checksum"]   # the stashed version
            moved += v["live_checksum"] != f["checksum"] and v["version"] > f["version"]
        assert res["losses"][-1] < 0.8 * res["losses"][0], res["losses"]
    assert moved > 0


@pytest.mark.parametrize("pp, cfg, batch, match", [
    (4, {"schedule": "interleaved", "micro_batches": 4, "chunks_per_rank": 3}, 8,
     "cannot cut 8 layers .* into 12 pipeline chunks"),
    (2, {"schedule": "gpipe", "micro_batches": 3}, 8,
     "global_batch_size=8 must be divisible by parallel.dp x parallel.micro_batches = 1 x 3"),
    (2, {"schedule": "interleaved", "micro_batches": 3, "chunks_per_rank": 2}, 6,
     "micro_batches=3 must be a multiple of parallel.pp=2"),
    (2, {"schedule": "pipedream", "micro_batches": 2, "clip": 1.0}, 8, "no flush to clip at"),
    (2, {"schedule": "zb1p", "micro_batches": 2, "zero": 3}, 8,
     "parallel.schedule=zb1p with parallel.zero=3"),
    (2, {"schedule": "zbv", "micro_batches": 2}, 8, "chunks_per_rank = 2, not 1"),
])
def test_bad_layouts_are_one_line_errors(pp, cfg, batch, match):
    with pytest.raises(ValueError, match=match) as exc:
        make_engine(Topology.build(1, pp, 1), cfg, batch)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("cfg", [{"schedule": "gpipe", "micro_batches": 4},
                                 {"schedule": "interleaved", "micro_batches": 2,
                                  "chunks_per_rank": 2, "recompute": True}])
def test_one_rank_pipeline_matches_single_process(cfg, ref):
    """pp = 1 runs in this process (no process group): micro-batching and, with v = 2, two
    chunks handing activations and gradients to each other locally."""
    engine = make_engine(Topology.build(1, 1, 1), cfg)
    from pipeline_workers import batches
    losses = [engine.train_step(idx, tgt)["loss"] for idx, tgt in batches(5)]
    assert_parity([{"losses": losses, "dp_rank": 0,
                    "params": {n: p.detach() for n, p in engine.named_parameters()}}], ref)
