"""Every algorithm of shardwise.comm against torch.distributed's own collectives.

One spawn per world size (see comm_workers.bundle) runs all checks; data are small integers
so every summation order gives the same bits and results must be *equal*, not close.
"""

import pytest

import comm_workers as cw

# 5 ranks (17 s of a spawn on 2 cores) in the slow set: 3 is the odd world size of make test
WORLD_SIZES = [2, 3, 4, pytest.param(5, marks=pytest.mark.slow), 8]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_reduce_every_algorithm_op_dtype_matches_native(n):
    results = cw.bundle(n)
    for rank, res in enumerate(results):
        ar = res["all_reduce"]
        assert ar["bad"] == [], f"rank {rank}: {ar['bad'][:5]}"
        assert ar["count"] >= 100
    # all ranks hold bitwise identical results for every case (DDP replicas stay in sync)
    first = results[0]["all_reduce"]["digests"]
    for rank, res in enumerate(results[1:], 1):
        diff = [k for k, v in res["all_reduce"]["digests"].items() if first[k] != v]
        assert diff == [], f"rank {rank} differs from rank 0 on {diff[:5]}"


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_rooted_and_sharded_collectives_match_native(n):
    for rank, res in enumerate(cw.bundle(n)):
        assert res["other"]["bad"] == [], f"rank {rank}: {res['other']['bad'][:5]}"
        assert res["other"]["count"] > 50


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_async_handles_p2p_exchange_and_barrier(n):
    for rank, res in enumerate(cw.bundle(n)):
        a = res["async"]
        assert all(a["waits"]) and all(a["same"]) and a["mid"] and a["done"], (rank, a)
        assert a["p2p"] == (0.0 if rank == 0 else float(rank))
        assert a["async_p2p"] and a["exchange"], (rank, a)
