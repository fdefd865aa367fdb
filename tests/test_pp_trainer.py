"""`shardwise train` with pipeline parallelism: the trainer's pp path against one process."""

import pytest
import torch

from ddp_workers import (
    straight_and_resumed,
    tiny_config,
    train,
    train_each,
    train_saving_at,
)
from shardwise.base.config import Config, ConfigError
from shardwise.launch import spawn
from test_ddp import assert_parity

UNTIED = {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 32, "tie_weights": False}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    return train(tiny_config(str(corpus), str(tmp_path_factory.mktemp("ref")), model=UNTIED))


def _merge(results: list[dict]) -> dict:
    """Each pipeline rank returns the stages it trains; together they are the model."""
    params = {}
    for r in results:
        params.update(r["stage_params"])
    return {"losses": results[0]["losses"], "params": params}


@pytest.mark.parametrize("dp, pp, parallel", [
    (1, 2, {"schedule": "1f1b", "micro_batches": 2}),
    (2, 2, {"schedule": "interleaved", "chunks_per_rank": 2, "micro_batches": 2, "recompute": True}),
])
def test_trainer_pp_matches_single_process(dp, pp, parallel, reference, corpus, tmp_path):
    cfg = tiny_config(str(corpus), str(tmp_path), model=UNTIED,
                      parallel={"dp": dp, "pp": pp, **parallel})
    results = spawn(train, dp * pp, (cfg,))
    assert all(r["losses"] == results[0]["losses"] for r in results)  # every rank reports it
    assert_parity(_merge(results[:pp]), reference)  # dp replica 0's pipeline


def test_zero3_pipeline_matches_single_process(corpus, tmp_path):
    """ZeRO-3 at dp = 2 over a pipeline of 2, one spawn for two layouts:

    - 1F1B, one chunk per rank (the 2-block GPT, its embedding tied to the head across the
      stages), 4 micro-batches: every stage's units are gathered again for each
      micro-batch's forward and backward, and each micro-batch's gradients are
      reduce-scattered into the shards; the tied weight is a unit of its own on both
      stages, so the two copies' gradient shards are summed element for element;
    - interleaved 1F1B, 2 chunks per rank (a 4-block tied GPT cut into 4 chunks: the
      embedding in chunk 0 on rank 0, the head in chunk 3 on rank 1), 4 micro-batches: each
      chunk is a ``ZeroStage3`` of its own, gathered and reduce-scattered around its own
      micro-batches while the rank's other chunk stays sharded.

    Each equals one process (fp32, 5 steps) within ``assert_parity``'s tolerance; in a step
    each rank gathers its units 2 m times and reduce-scatters them m times, no more (a
    chunk's backward touches none of the other chunk's units); between steps no unit stays
    gathered, and each rank holds the bytes ``predict_rank`` says."""
    from shardwise.engine.memory import predict_rank
    from shardwise.models import GPTConfig

    four = {"n_layer": 4}
    flush = {"dp": 2, "pp": 2, "zero": 3, "schedule": "1f1b", "micro_batches": 4}
    interleaved = {**flush, "schedule": "interleaved", "chunks_per_rank": 2}
    refs = [train(tiny_config(str(corpus), str(tmp_path / "ref"))),
            train(tiny_config(str(corpus), str(tmp_path / "ref4"), model=four))]
    cfgs = [tiny_config(str(corpus), str(tmp_path / "z3"), parallel=flush),
            tiny_config(str(corpus), str(tmp_path / "z3v2"), model=four, parallel=interleaved)]
    runs = spawn(train_each, 4, (cfgs,))
    for i, (cfg, ref) in enumerate(zip(cfgs, refs)):
        results = [r[i] for r in runs]
        assert all(r["losses"] == results[0]["losses"] for r in results)
        for replica in (results[:2], results[2:]):  # ranks (dp, pp): pp is the fastest axis
            assert_parity(_merge(replica), ref)
        # between steps no unit stays gathered: each rank holds only its shards
        assert all(r["materialised_elements"] == 0 for r in results)
        for r in results:
            # every unit of every chunk: gathered for each micro-batch's forward and backward,
            # reduce-scattered after each backward, and no more (padded bytes: dp x shard)
            moved = {c: sum(n for k, n in r["collectives"] if k == c)
                     for c in ("all_gather", "reduce_scatter")}
            units = 2 * r["memory"]["grads"]  # fp32 shards of all the rank's units, x dp = 2
            assert moved == {"all_gather": 2 * 4 * units, "reduce_scatter": 4 * units}, moved
            want = predict_rank(GPTConfig(**r["gpt"]), dp=2, pp=2, dp_rank=r["coords"]["dp"],
                                pp_rank=r["coords"]["pp"],
                                chunks_per_rank=cfg["parallel"]["chunks_per_rank"],
                                zero=3)
            assert {k: r["memory"][k] for k in ("params", "grads", "optimizer")} == \
                {k: want[k] for k in ("params", "grads", "optimizer")}, (i, r["coords"])


RESUME_SCHEDULES = ["1f1b", "pipedream"]


@pytest.fixture(scope="module")
def resumes(corpus, tmp_path_factory):
    """Two spawns of 2 for every schedule: the uninterrupted runs and the runs cut at step 4
    (in turn), then the resumes, in fresh processes. schedule -> (straight, resumed)."""
    runs = {}
    for schedule in RESUME_SCHEDULES:
        root = tmp_path_factory.mktemp(f"resume-{schedule}")
        sections = {"model": UNTIED, "training": {"steps": 8},
                    "parallel": {"dp": 1, "pp": 2, "micro_batches": 2, "schedule": schedule},
                    "optimizer": {"lr": 3e-3, "warmup_steps": 2, "grad_clip": 0.0}}
        runs[schedule] = ((train_saving_at, (tiny_config(str(corpus), str(root / "a"),
                                                         **sections), 4)),
                          tiny_config(str(corpus), str(root / "b"), **sections))
    return straight_and_resumed(runs)


@pytest.mark.parametrize("schedule", RESUME_SCHEDULES)
def test_pp_resume_matches_uninterrupted_run(schedule, resumes):
    """Bitwise. PipeDream drains its stream at a checkpoint, in both runs alike."""
    straight, resumed = resumes[schedule]
    assert len(straight) == len(resumed) == 2
    for a, b in zip(straight, resumed):
        assert b["resumed_at"] == 4 and b["losses"] == a["losses"]
        for name, p in a["stage_params"].items():
            assert torch.equal(b["stage_params"][name], p), name


def test_pp_bad_layouts_are_one_line():
    z3 = {"dp": 2, "zero": 3, "schedule": "interleaved", "chunks_per_rank": 2}
    Config.from_dict({"parallel": {**z3, "pp": 2, "micro_batches": 2}})  # each chunk its own ZeRO-3
    with pytest.raises(ConfigError, match="parallel.zero=3 with parallel.chunks_per_rank=2, "
                                          "parallel.pp=1 and model.tie_weights=true"):
        Config.from_dict({"parallel": {**z3, "pp": 1}})  # one parameter in two chunks of a rank
    Config.from_dict({"parallel": {**z3, "pp": 1}, "model": {"tie_weights": False}})
    from shardwise.engine.memory import predict_rank  # the engine's rule, for any model
    from shardwise.models import GPTConfig

    with pytest.raises(ValueError, match="weight is shared by chunks 0 and 1 of one rank"):
        predict_rank(GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=4, n_embd=32),
                     dp=2, chunks_per_rank=2, zero=3)
    with pytest.raises(ConfigError, match="parallel.schedule=pipedream with parallel.zero=1"):
        Config.from_dict({"parallel": {"dp": 1, "pp": 2, "zero": 1, "schedule": "pipedream"},
                          "optimizer": {"grad_clip": 0.0}})
    pipedream = {"parallel": {"dp": 1, "pp": 2, "micro_batches": 2, "schedule": "pipedream"},
                 "optimizer": {"grad_clip": 0.0}}
    with pytest.raises(ConfigError, match="pipedream with model.tie_weights=true and parallel.pp=2"):
        Config.from_dict(pipedream)  # the GPT's default: tied, across the two stages
    Config.from_dict({**pipedream, "model": {"tie_weights": False}})
    with pytest.raises(ConfigError, match="more than the 4 layers"):
        Config.from_dict({"parallel": {"dp": 1, "pp": 5}, "model": {"n_layer": 2, "tie_weights": False}})
    odd_m = {"parallel": {"dp": 1, "pp": 2, "schedule": "interleaved", "micro_batches": 3,
                          "chunks_per_rank": 2},
             "model": {"tie_weights": False}, "training": {"global_batch_size": 30}}
    with pytest.raises(ConfigError, match="multiple of parallel.pp=2 for the interleaved"):
        Config.from_dict(odd_m)
    odd_m["parallel"]["chunks_per_rank"] = 1  # 1F1B's order: any m (schedules.validate_args)
    Config.from_dict(odd_m)
    odd_m["parallel"].update(schedule="1f1b", chunks_per_rank=2)  # at the door, not the engine
    with pytest.raises(ConfigError, match="chunks_per_rank=2 with parallel.schedule=1f1b"):
        Config.from_dict(odd_m)
