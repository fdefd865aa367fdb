"""Exact byte / message / step counts of every algorithm, from the per-rank records.

X bytes on N ranks; chunk rounding: a length not divisible by N (37 elements here) gives
chunks differing by one element (primitives.balanced_bounds), so per-rank ring bytes are
then within 2 elements of 2(N-1)/N X while the ranks together send exactly 2(N-1) X.
"""

import math

import pytest

import comm_workers as cw

# make test keeps 3 (an odd world size: uneven chunks) and 4 (a power of two: halving-doubling
# without its fold); 2, 5 and 8 ranks (8: 22 s of a spawn on 2 cores) are in the slow set
SLOW = pytest.mark.slow
WORLD_SIZES = [pytest.param(2, marks=SLOW), 3, 4, pytest.param(5, marks=SLOW),
               pytest.param(8, marks=SLOW)]
ELEM = 4  # float32


def records(n, collective, algorithm, numel, nbytes=None):
    rows = [rec for res in cw.bundle(n) for rec in res["records"][:-1]
            if rec["collective"] == collective and rec["algorithm"] == algorithm
            and rec["nbytes"] == (nbytes or numel * ELEM)]
    assert len(rows) == n, (collective, algorithm, rows)
    return sorted(rows, key=lambda r: r["rank"])


def steps(rows):
    return max(r["last_step"] for r in rows)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_all_reduce_sends_2_n_minus_1_over_n_x(n):
    for numel in cw.ACCT_NUMELS:
        x = numel * ELEM
        rows = records(n, "all_reduce", "ring", numel)
        assert sum(r["bytes_sent"] for r in rows) == 2 * (n - 1) * x
        assert sum(r["bytes_recv"] for r in rows) == 2 * (n - 1) * x
        for r in rows:
            if numel % n == 0:
                assert r["bytes_sent"] * n == 2 * (n - 1) * x
            else:
                assert abs(r["bytes_sent"] - 2 * (n - 1) * x / n) <= 2 * ELEM
            assert r["msgs_sent"] == r["msgs_recv"] == 2 * (n - 1)
        assert steps(rows) == 2 * (n - 1)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_halving_doubling_steps_and_bytes(n):
    numel = 840
    x = numel * ELEM
    rows = records(n, "all_reduce", "halving_doubling", numel)
    p = 1 << (n.bit_length() - 1)
    if p == n:
        assert steps(rows) == 2 * int(math.log2(n))
        assert all(r["bytes_sent"] * n == 2 * (n - 1) * x for r in rows)
    else:  # fix-up: one step in, one step out, whole vectors on the folded pairs
        rem = n - p
        assert steps(rows) == 2 * int(math.log2(p)) + 2
        for r in rows:
            if r["rank"] < 2 * rem and r["rank"] % 2 == 0:
                assert (r["bytes_sent"], r["bytes_recv"], r["steps"]) == (x, x, 2)
            else:
                extra = x if r["rank"] < 2 * rem else 0
                assert r["bytes_sent"] * p == 2 * (p - 1) * x + extra * p


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_naive_puts_n_minus_1_messages_through_the_root(n):
    x = 840 * ELEM
    rows = records(n, "all_reduce", "naive", 840)
    root = rows[0]
    assert (root["msgs_recv"], root["msgs_sent"]) == (n - 1, n - 1)
    assert (root["bytes_recv"], root["bytes_sent"]) == ((n - 1) * x, (n - 1) * x)
    assert all((r["msgs_sent"], r["msgs_recv"], r["bytes_sent"]) == (1, 1, x) for r in rows[1:])
    assert steps(rows) == 2


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_tree_broadcast_reduce_and_all_reduce_steps(n):
    x = 840 * ELEM
    L = math.ceil(math.log2(n))
    bcast = records(n, "broadcast", "tree", 840)
    assert steps(bcast) == L
    assert sum(r["bytes_sent"] for r in bcast) == (n - 1) * x  # every rank but the root once
    assert all(r["bytes_recv"] == (0 if r["rank"] == n - 1 else x) for r in bcast)
    assert steps(records(n, "reduce", "tree", 840)) == L
    ar = records(n, "all_reduce", "tree", 840)
    assert steps(ar) == 2 * L
    assert ar[0]["bytes_sent"] == ar[0]["bytes_recv"] == L * x


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_sequential_parallel_gather_scatter_and_sharded(n):
    x = 840 * ELEM
    seq = records(n, "all_reduce", "sequential", 840)
    assert steps(seq) == 2 * (n - 1)
    assert sum(r["bytes_sent"] for r in seq) == 2 * (n - 1) * x
    par = records(n, "all_reduce", "parallel", 840)
    assert steps(par) == 1 and all(r["bytes_sent"] == (n - 1) * x for r in par)
    assert records(n, "gather", "linear", 840)[0]["msgs_recv"] == n - 1
    assert records(n, "scatter", "linear", 840)[0]["msgs_sent"] == n - 1
    for coll, algo, lg in (("all_gather", "ring", False), ("all_gather", "recursive_doubling", True),
                           ("reduce_scatter", "ring", False),
                           ("reduce_scatter", "recursive_halving", True)):
        rows = records(n, coll, algo, 840, nbytes=n * x)
        p = 1 << (n.bit_length() - 1)
        want = (n - 1) if not lg else (int(math.log2(p)) + (0 if p == n else 2))
        assert steps(rows) == want, (coll, algo)
        if not lg or p == n:
            assert all(r["bytes_sent"] == (n - 1) * x for r in rows), (coll, algo)


@pytest.mark.parametrize("n", [2, 8])
def test_native_is_counted_with_unknown_bytes_and_checks_are_separate(n):
    rows = records(n, "all_reduce", "native", 840)
    assert all(r["bytes_sent"] is None for r in rows)
    for res in cw.bundle(n):
        recs = res["records"]
        # 15 collectives x 2 lengths, each preceded by its argument check; none after disable
        assert recs[-1]["total_records"] == 60
        checks = [r for r in recs[:-1] if r["collective"] == "check"]
        assert len(checks) == 30
        assert all(r["last_step"] == math.ceil(math.log2(n)) for r in checks)
