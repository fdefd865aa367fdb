"""HSDP (dp = dp_replicate x dp_shard) against one process.

ZeRO 1-3 shard over one replica's dp_shard ranks and the gradient shards are then averaged
across the dp_replicate replicas (``comm.replicas``): the losses and every parameter equal
one process training the same global batches (fp32, 1e-5 relative), at R x S = 2 x 2
alone (4 ranks) and with tp2 or pp2 (8 ranks). A checkpoint saved at 2 x 2 with ZeRO-3
resumes at 1 x 4 and 4 x 1 with the losses of the uninterrupted run. Each rank's bytes
equal ``engine.memory.predict_rank(dp_replicate=)``, and ZeRO's state shrinks by S, not dp.
"""

import pytest
import torch

from ddp_workers import tiny_config, train
from hsdp_workers import hsdp_worker
from shardwise import checkpoint
from shardwise.launch import spawn
from test_layouts import RTOL, SEED, SMALL_BUCKETS, UNTIED, _check_parity

STOP = 3
MOE = {"kind": "llama", "n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16,
       "n_experts": 4, "top_k": 2, "moe_ffn_hidden": 32, "multiple_of": 16,
       "tie_weights": False}  # as tests/test_moe.py's "softmax"


def _layouts(ws: int) -> dict[str, dict]:
    if ws == 4:  # with ep2 the experts' shards span the replicas (their own group)
        out = {f"2x2-z{z}": {"parallel": {"dp": 4, "dp_replicate": 2, "zero": z,
                                          **SMALL_BUCKETS}} for z in (1, 2, 3)}
        return out | {f"2x2xep2-z{z}-moe": {"parallel": {"dp": 4, "dp_replicate": 2, "ep": 2,
                                                         "zero": z}, "model": MOE}
                      for z in (1, 3)}
    return {"2x2xtp2-z3": {"parallel": {"dp": 4, "dp_replicate": 2, "tp": 2, "zero": 3}},
            "2x2xcp2-z2": {"parallel": {"dp": 4, "dp_replicate": 2, "cp": 2, "zero": 2}},
            "2x2xpp2-interleaved-z1": {"parallel": {
                "dp": 4, "dp_replicate": 2, "pp": 2, "zero": 1, "micro_batches": 2,
                "schedule": "interleaved", "chunks_per_rank": 2, **SMALL_BUCKETS},
                "model": UNTIED}}


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    return {"tied": train(tiny_config(str(corpus), str(out), training=SEED)),
            "untied": train(tiny_config(str(corpus), str(out), model=UNTIED, training=SEED)),
            "moe": train(tiny_config(str(corpus), str(out), model=MOE, training=SEED))}


@pytest.fixture(scope="module", params=[4, 8], ids=["ws4", "ws8"])
def suite(request, corpus, tmp_path_factory):
    ws = request.param
    layouts = _layouts(ws)
    root = tmp_path_factory.mktemp(f"hsdp{ws}")
    configs = [tiny_config(str(corpus), str(root), **{**s, "training": SEED})
               for s in layouts.values()]
    jobs = []
    if ws == 4:  # saved at 2 x 2 ZeRO-3, resumed at 1 x 4 and 4 x 1
        def cfg(r, name):
            return tiny_config(str(corpus), str(root / name), training=SEED,
                               parallel={"dp": 4, "dp_replicate": r, "zero": 3})
        path = root / "save" / "checkpoints" / checkpoint.checkpoint_name(STOP)
        jobs = [{"kind": "save", "stop": STOP, "cfg": cfg(2, "save")}]
        jobs += [{"kind": "resume", "path": str(path), "cfg": cfg(r, f"resume{r}")}
                 for r in (1, 4)]
    results = spawn(hsdp_worker, ws, (configs, jobs))
    out = {name: [dict(r[0][i], config=configs[i]) for r in results]
           for i, name in enumerate(layouts)}
    for i, job in enumerate(jobs):
        out[f"_{job['kind']}{job['cfg']['parallel']['dp_replicate']}"] = [r[1][i] for r in results]
    return out


def test_hsdp_layouts_match_one_process(suite, references):
    for name, ranks in suite.items():
        if not name.startswith("_"):
            ref = ("moe" if name.endswith("moe") else "untied" if "interleaved" in name
                   else "tied")
            _check_parity(name, ranks, references[ref])


def test_checkpoint_from_2x2_resumes_at_1x4_and_4x1(suite, references):
    """Checkpoints are layout-independent: ZeRO-3 shards of 2 x 2 load into one replica of
    4 shards, and into 4 replicas of 1; the continued losses equal the run that never
    stopped (one process, the same global batches)."""
    if "_save2" not in suite:
        pytest.skip("world size 4 only")
    ref = torch.tensor(references["tied"]["losses"], dtype=torch.float64)
    saved = suite["_save2"][0]["losses"]
    assert torch.allclose(torch.tensor(saved, dtype=torch.float64), ref[:STOP], rtol=RTOL)
    for r in (1, 4):
        for rank in suite[f"_resume{r}"]:
            assert rank["resumed_at"] == STOP and rank["losses"][:STOP] == saved
            got = torch.tensor(rank["losses"][STOP:], dtype=torch.float64)
            assert len(got) == len(ref) - STOP
            assert ((got - ref[STOP:]).abs() <= RTOL * ref[STOP:].abs()).all(), (r, got, ref)


def test_memory_prediction_equals_measured_bytes(suite):
    from shardwise.base.config import Config
    from shardwise.engine.memory import predict_rank
    from shardwise.planner.specs import describe_config

    for name, ranks in suite.items():
        for r in ranks if not name.startswith("_") else ():
            p, t, c = r["config"]["parallel"], r["config"]["training"], r["coords"]
            model = describe_config(Config.from_dict(r["config"]))
            pred = predict_rank(model, dp=p["dp"], pp=p["pp"], tp=p["tp"], cp=p["cp"],
                                ep=p["ep"], dp_rank=c["dp"], pp_rank=c["pp"], tp_rank=c["tp"],
                                cp_rank=c["cp"], chunks_per_rank=p["chunks_per_rank"],
                                zero=p["zero"], precision=t["precision"],
                                bucket_mb=p["bucket_mb"], dp_replicate=p["dp_replicate"])
            for k in ("params", "grads", "optimizer"):
                assert pred[k] == r["memory"][k], (name, r["coords"], k, pred, r["memory"])


def test_zero_state_shrinks_by_dp_shard_not_dp(capsys):
    """ZeRO 1-3 under HSDP shard over one replica: a rank of dp 4 = 2 replicas x 2 holds
    what a rank of dp 2 holds (engine.memory on meta, planner.memory's closed form and exact
    path, ``shardwise memory``), more than a rank of dp 4 without replicas; ZeRO-0 is the
    same at every split."""
    from shardwise.cli.memory import main
    from shardwise.engine.memory import predict_rank
    from shardwise.models import GPTConfig
    from shardwise.planner.memory import gathered_bytes, static_bytes, zero_bytes
    from shardwise.planner.specs import NAMED, ModelSpec

    cfg = GPTConfig(65, 32, 2, 4, 32)
    for z in (0, 1, 2, 3):
        hsdp, two, four = (predict_rank(cfg, dp=dp, dp_rank=dp - 1, zero=z, bucket_mb=0.004,
                                        dp_replicate=r, precision="bf16")
                           for dp, r in ((4, 2), (2, 1), (4, 1)))
        assert hsdp == two, (z, hsdp, two)
        assert (hsdp["optimizer"] > four["optimizer"]) == (z > 0), (z, hsdp, four)
    tiny = ModelSpec("x", 2, 32, 4, 65, 32)
    big = NAMED["gpt2-1.5b"]
    for spec in (tiny, big):  # exact (meta device) and closed-form paths
        for z in (1, 2, 3):
            assert static_bytes(spec, 8, 1, 1, 1, z, "bf16", dp_replicate=4) == \
                static_bytes(spec, 2, 1, 1, 1, z, "bf16")
            assert static_bytes(spec, 8, 1, 1, 1, z, "bf16", dp_replicate=4) != \
                static_bytes(spec, 8, 1, 1, 1, z, "bf16")
        assert gathered_bytes(spec, 8, 1, 1, 3, "bf16", dp_replicate=4) == \
            gathered_bytes(spec, 2, 1, 1, 3, "bf16")
    capsys.readouterr()
    assert main(["--params", "7.5e9", "--dp", "64", "--dp-replicate", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "N = 8 (dp 64 = 8 HSDP replicas x 8) ranks" in out[0]
    want = [round(zero_bytes(7.5e9, 8, s, "bf16")["total"] / 1e9, 2) for s in range(4)]
    assert [float(line.split()[-1]) for line in out[2:]] == want


def test_memory_cli_names_a_replicate_that_does_not_divide(capsys):
    from shardwise.cli.memory import main

    assert main(["--params", "1e9", "--dp", "6", "--dp-replicate", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "shardwise memory: error: --dp-replicate 4 does not divide --dp 6"


def test_config_refuses_replicate_times_shard_other_than_dp():
    from shardwise.base.config import Config

    base = {"model": {"n_layer": 1}}
    with pytest.raises(ValueError, match=r"parallel.dp_replicate=2 x parallel.dp_shard=3 = 6, "
                                         r"but parallel.dp=4"):
        Config.from_dict({**base, "parallel": {"dp": 4, "dp_replicate": 2, "dp_shard": 3}})
    with pytest.raises(ValueError, match=r"parallel.dp_replicate=3 does not divide parallel.dp=4"):
        Config.from_dict({**base, "parallel": {"dp": 4, "dp_replicate": 3}})
    ok = Config.from_dict({**base, "parallel": {"dp": 4, "dp_replicate": 2, "dp_shard": 2}})
    assert (ok.parallel.dp_replicate, ok.parallel.dp_shard) == (2, 2)


def test_planner_prices_the_replica_mean_on_inter_node_links(tmp_path):
    """32 H100s in 4 nodes of 8, ZeRO-1 over dp 32: HSDP with one replica per node runs the
    reduce-scatter and all-gather over the node's 8 GPUs (NVLink) and averages only a
    shard, 1/8 of the gradients, across the 4 nodes (InfiniBand): ``dp_seconds`` is that
    sum, below ZeRO-1 over all 32; the search offers it when asked and ``--emit-toml``
    writes dp_replicate and dp_shard in a config train accepts."""
    import tomllib

    from shardwise.base.config import Config
    from shardwise.cli.plan import emit_toml
    from shardwise.planner.hardware import get_cluster
    from shardwise.planner.memory import BYTES, rank_params
    from shardwise.planner.search import layout_reason, plan
    from shardwise.planner.simulate import Layout, dp_seconds
    from shardwise.planner.specs import NAMED

    spec = NAMED["gpt2-1.5b"]
    cl = get_cluster("dgx-h100", spec, 32)
    layers = list(range(spec.n_layer + 2))
    x = rank_params(spec, layers, 1, 1) * BYTES["bf16"]
    flat, hsdp = (Layout(32, 1, 1, 2, 1, zero=1, dp_replicate=r) for r in (1, 4))
    want = (cl.inter.all_reduce(4, x / 8) + cl.intra.reduce_scatter(8, x)
            + cl.intra.all_gather(8, x))
    assert dp_seconds(spec, hsdp, cl, "bf16", layers).after == pytest.approx(want)
    assert dp_seconds(spec, hsdp, cl, "bf16", layers).after < \
        dp_seconds(spec, flat, cl, "bf16", layers).after
    assert "hsdp4" in hsdp.label() and layout_reason(spec, hsdp) is None
    assert "must divide dp=32, with ZeRO 1-3" in layout_reason(
        spec, Layout(32, 1, 1, 2, 1, zero=0, dp_replicate=4))
    feasible, _ = plan(spec, cl, 32, 64, zero=(1,), top=3, pp_max=1, cp=[1], sp=[False],
                       recompute=[False], dp_replicate=(1, 4))
    assert feasible[0].layout.dp_replicate == 4
    path = emit_toml(str(tmp_path / "hsdp.toml"), "gpt2-1.5b", spec, hsdp, 64, "bf16")
    cfg = Config.from_dict(tomllib.loads(path.read_text()))
    assert (cfg.parallel.dp, cfg.parallel.dp_replicate, cfg.parallel.dp_shard) == (32, 4, 8)
