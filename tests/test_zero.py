"""ZeRO-1 and ZeRO-2 against one process on the same global batch, and sharded resume."""

import pytest
import torch
from ddp_workers import resume_and_finish, tiny_config, train, train_and_checkpoint
from test_ddp import assert_parity

from shardwise.config import Config, ConfigError
from shardwise.launch import spawn


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    return train(tiny_config(str(corpus), str(tmp_path_factory.mktemp("ref"))))


@pytest.mark.parametrize("zero, dp, micro_batches, bucket_mb", [
    (1, 2, 1, 25.0),    # one bucket: each rank owns one contiguous half of all parameters
    (2, 2, 2, 0.004),   # many buckets, accumulation under no_sync
    (2, 4, 1, 0.004),
    (3, 2, 2, 25.0),    # parameters gathered per unit; accumulation reduce-scatters each time
    (3, 4, 1, 25.0),
])
def test_zero_matches_single_process(zero, dp, micro_batches, bucket_mb, reference, corpus,
                                     tmp_path):
    cfg = tiny_config(str(corpus), str(tmp_path), parallel={
        "dp": dp, "zero": zero, "micro_batches": micro_batches, "bucket_mb": bucket_mb})
    results = spawn(train, dp, (cfg,))
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


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_resume_matches_uninterrupted_run(zero, corpus, tmp_path):
    sections = {"parallel": {"dp": 2, "zero": zero, "bucket_mb": 0.004}, "training": {"steps": 8}}
    full = tiny_config(str(corpus), str(tmp_path / "full"), **sections)
    cut = tiny_config(str(corpus), str(tmp_path / "cut"), **sections)
    straight = spawn(train, 2, (full,))
    spawn(train_and_checkpoint, 2, (cut, 4))
    resumed = spawn(resume_and_finish, 2, (cut,))
    for rank in range(2):
        assert resumed[rank]["resumed_at"] == 4
        assert resumed[rank]["losses"] == straight[rank]["losses"]
        for name, p in straight[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][name], p), name


@pytest.mark.parametrize("stage", [-1, 4])
def test_bad_stage_is_one_line(stage):
    with pytest.raises(ConfigError, match=f"parallel.zero={stage}"):
        Config.from_dict({"parallel": {"zero": stage}})
