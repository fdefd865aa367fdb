"""Shared-memory and hierarchical collectives (issue 15) against torch.distributed's own.

One spawn per world size runs every check (``shm_workers.suite``): every op x dtype x
length (uneven, several rounds of a 4 KiB slot) equal to gloo on integer data and, on
random floats, equal to the sum in the algorithm's order (rank order for "shm"; each
host's rank order, then across the two hosts for "hierarchical"); reduce-scatter,
all-gather, broadcast from every root, barrier; exact byte accounting; a stalled and a
killed peer.
"""

import io
import multiprocessing as mp
import os
import time
from multiprocessing import connection

import pytest
import torch

import shm_workers as sw
from shardwise import launch
from shardwise.comm import shm, shm_segment

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs /dev/shm on x86-64")

_runs: dict = {}


def run(n: int, hosts_of: int = 0) -> list:
    if (n, hosts_of) not in _runs:
        _runs[n, hosts_of] = launch.spawn(sw.suite, n, (hosts_of,), threads=1,
                                          join_timeout_s=300)
    return _runs[n, hosts_of]


def _same_everywhere(results, key):
    first = results[0][key]["digests"]
    for rank, res in enumerate(results[1:], 1):
        diff = [k for k, v in res[key]["digests"].items() if first[k] != v]
        assert diff == [], f"rank {rank} differs from rank 0 on {diff[:5]}"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_shm_all_reduce_every_op_dtype_matches_native_and_rank_order(n):
    results = run(n)
    for rank, res in enumerate(results):
        assert res["shm"]["bad"] == [], f"rank {rank}: {res['shm']['bad'][:5]}"
        assert res["shm"]["count"] > 100
    _same_everywhere(results, "shm")


@pytest.mark.parametrize("n", [2, 3, 4])
def test_shm_reduce_scatter_all_gather_broadcast_barrier(n):
    for rank, res in enumerate(run(n)):
        assert res["sharded"]["bad"] == [], f"rank {rank}: {res['sharded']['bad'][:5]}"
        assert res["sharded"]["count"] > 20


@pytest.mark.parametrize("n", [2, 3, 4])
def test_shm_byte_accounting_is_exact(n):
    for rank, res in enumerate(run(n)):
        for row in res["acct"]["rows"]:
            assert row["got"] == row["want"], (rank, row)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_auto_considers_shared_memory_on_one_host(n):
    from shardwise.comm import cost
    want = [cost.choose_all_reduce(n, m * 4, ("shm",)) for m in (1024, 4 << 20)]
    for rank, res in enumerate(run(n)):
        assert res["auto"] == want, (rank, res["auto"])  # the model's argmin, shm included
        if n == 2:
            assert res["auto"][0] == "shm"  # 4 KiB: 2 rounds of shm beat any send/recv
        assert res["auto_value"] == sum(range(n))


@pytest.mark.slow
def test_shm_at_eight_ranks():
    """N = 8 (4 ranks per core here): everything of the N = 2, 3, 4 tests, and the
    hierarchical path with 2 fake hosts of 4 ranks."""
    results = run(8)
    for rank, res in enumerate(results):
        assert res["shm"]["bad"] == [] and res["sharded"]["bad"] == [], rank
        assert all(row["got"] == row["want"] for row in res["acct"]["rows"]), rank
    _same_everywhere(results, "shm")
    results = run(8, hosts_of=4)
    for rank, res in enumerate(results):
        assert res["hosts"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert res["hier"]["bad"] == [], rank
        assert res["hier_acct"]["got"] == res["hier_acct"]["want"], rank
    _same_everywhere(results, "hier")


def test_hierarchical_two_fake_hosts_of_two_ranks():
    results = run(4, hosts_of=2)
    for rank, res in enumerate(results):
        assert res["hosts"] == [[0, 1], [2, 3]]
        assert res["hier"]["bad"] == [], f"rank {rank}: {res['hier']['bad'][:5]}"
        assert res["hier"]["count"] > 100
        assert res["hier_acct"]["got"] == res["hier_acct"]["want"], (rank, res["hier_acct"])
        assert res["auto"][0] in ("hierarchical", "native", "ring", "halving_doubling", "tree")
    _same_everywhere(results, "hier")


def test_stalled_and_killed_peer_fail_fast_and_leave_nothing_in_dev_shm():
    """3 ranks; rank 2 stalls 5 s, then SIGKILLs itself. With a 4 s timeout the others get
    a one-line CommTimeoutError, then a CommError that rank 2 exited, both naming
    all_reduce(shm); afterwards /dev/shm holds no segment of the job."""
    ctx = mp.get_context("spawn")
    store = launch.loopback_store(60)
    n, conns, procs = 3, [], []
    for rank in range(n):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=launch._worker, args=(rank, n, store.port, sw.killed_peer,
                                                     (4.0, 5.0), child, 1, 60, os.getpid()))
        p.start()
        child.close()
        conns.append(parent)
        procs.append(p)
    results = {}
    try:
        deadline = time.monotonic() + 240  # starting 3 ranks on 2 busy cores can be slow
        pending = {conns[r]: r for r in range(n - 1)}
        while pending and time.monotonic() < deadline:
            for c in connection.wait(list(pending), timeout=1):
                r = pending.pop(c)
                kind, payload = c.recv()
                assert kind == "ok", payload
                results[r] = torch.load(io.BytesIO(payload), weights_only=True)
        assert not pending, f"ranks {sorted(pending.values())} did not report"
        procs[-1].join(60)
        assert procs[-1].exitcode == -9
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    assert sorted(results) == [0, 1]
    pid0 = results[0]["pid0"]
    for r, res in results.items():
        msg, took = res["stalled"]
        assert msg.startswith("CommTimeoutError: all_reduce(shm) on rank"), msg
        assert "\n" not in msg and 3.5 < took < 8, (msg, took)
        msg, took = res["killed"]
        assert msg.startswith("CommError: all_reduce(shm) on rank") and "exited" in msg, msg
        assert "\n" not in msg and "rank 2" in msg and took < 4, (msg, took)
    assert [f for f in os.listdir("/dev/shm") if f.startswith(f"{shm.PREFIX}{pid0}-")] == []


def test_stale_segment_of_a_dead_creator_is_swept_and_a_live_one_kept(tmp_path):
    dead = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    paths = [f"/dev/shm/{shm.PREFIX}{pid}-0-testtoken" for pid in (dead.pid, os.getpid())]
    try:
        for p in paths:
            with open(p, "wb") as f:
                f.write(b"x")
            os.utime(p, (time.time() - 120, time.time() - 120))
        shm_segment._sweep_stale()
        assert [os.path.exists(p) for p in paths] == [False, True]
    finally:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)


def test_cost_model_knows_shm_and_hierarchical_and_refuses_a_foreign_profile(monkeypatch):
    from shardwise.comm import cost
    prof = cost.Profile("t", {2: cost.LinkParams(1e-4, 2.6e-10, 1.3e-10, 9e-11, 5e-11, 5e-4,
                                                 5.5e-10, shm_alpha=2e-5, shm_beta=3e-10)},
                        {"host": "elsewhere", "cores": 64})
    prm = prof.params(2)
    assert cost.predict("shm", 2, 4096, prm) == pytest.approx(2 * 2e-5 + 4096 * 3e-10)
    x = 64 << 20
    rounds = 2 * (x // shm.SLOT_BYTES)
    assert cost.predict("shm", 2, x, prm) == pytest.approx(rounds * 2e-5 + x * 3e-10)
    assert cost.predict_hierarchical(4, 2, x, prof) == pytest.approx(
        cost.predict("shm", 2, x, prm) + cost.predict("ring", 2, x / 2, prm))
    with pytest.warns(RuntimeWarning, match="elsewhere"):
        assert cost._this_machine(prof) is cost.BUILTIN
    here = cost.host_meta()
    prof.meta.update(host=here["host"], cores=here["cores"])
    assert cost._this_machine(prof) is prof
    try:
        cost.use_profile(prof)
        assert cost.choose_all_reduce(2, 4096, ("shm",)) == "shm"
        assert cost.choose_all_reduce(2, 4096) != "shm"
    finally:
        cost.use_profile(None)
