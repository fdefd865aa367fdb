"""Our DDP against one process on the same global batch: losses and parameters must match."""

import pytest
import torch

from ddp_workers import overlap_probe, run_all, tiny_config, train
from helpers import rel_err
from shardwise.launch import spawn

RTOL = 1e-5  # relative error per tensor: ||a - b|| <= RTOL * ||b||


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """Single process (dp=1, one micro-batch) on the same 5 global batches."""
    out = tmp_path_factory.mktemp("ref")
    return train(tiny_config(str(corpus), str(out)))


def assert_parity(result: dict, ref: dict, rtol: float = RTOL) -> None:
    losses, ref_losses = torch.tensor(result["losses"]), torch.tensor(ref["losses"])
    assert len(losses) == len(ref_losses)
    assert ((losses - ref_losses).abs() <= rtol * ref_losses.abs()).all(), (losses, ref_losses)
    assert result["params"].keys() == ref["params"].keys()
    for name, p in ref["params"].items():
        assert rel_err(result["params"][name], p) <= rtol, (name, rel_err(result["params"][name], p))


CASES = [
    (2, 1, 25.0, "auto"),    # one bucket holds every gradient
    (4, 1, 25.0, "ring"),
    (2, 2, 0.004, "native"),  # gradient accumulation under no_sync, many small buckets
    (4, 2, 0.004, "halving_doubling"),
]
OVERLAP_BUCKET_MB = 0.02


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """One spawn per world size (2, 4) trains every case of that size in turn (each with its
    own process groups); the spawn of 2 also runs the overlap probe. case -> rank results."""
    out = {}
    for ws in (2, 4):
        cases = [c for c in CASES if c[0] == ws]
        calls = [(train, (tiny_config(str(corpus), str(tmp_path_factory.mktemp("ddp")),
                                      parallel={"dp": dp, "micro_batches": mb, "bucket_mb": bmb,
                                                "allreduce": ar}),))
                 for dp, mb, bmb, ar in cases]
        if ws == 2:
            cases.append("overlap")
            calls.append((overlap_probe, (OVERLAP_BUCKET_MB,)))
        ranks = spawn(run_all, ws, (calls,))
        out |= {case: [r[i] for r in ranks] for i, case in enumerate(cases)}
    return out


@pytest.mark.parametrize("dp, micro_batches, bucket_mb, allreduce", CASES)
def test_ddp_matches_single_process(dp, micro_batches, bucket_mb, allreduce, reference, runs):
    results = runs[dp, micro_batches, bucket_mb, allreduce]
    assert len(results) == dp
    assert len(reference["losses"]) == 5
    # training really moved the weights, so equality is not a tautology
    assert reference["losses"][-1] < reference["losses"][0]
    for rank_result in results:
        assert_parity(rank_result, reference)
    if bucket_mb < 0.01:
        assert results[0]["n_buckets"] >= 8
    else:
        assert results[0]["n_buckets"] == 1


def test_broadcast_and_overlap(runs):
    """Ranks start from different weights; after wrapping they agree. With small buckets,
    some all-reduce starts before the last gradient hook fires (overlap with backward)."""
    r0, r1 = runs["overlap"]
    torch.testing.assert_close(r0["params"], r1["params"], rtol=0, atol=0)
    torch.testing.assert_close(r0["grads"], r1["grads"], rtol=0, atol=0)
    for r in (r0, r1):
        t = r["timing"]
        assert r["n_buckets"] > 3
        earliest_launch = max(b["launched_before_end_s"] for b in t["buckets"])
        assert earliest_launch > t["last_hook_before_end_s"], t
