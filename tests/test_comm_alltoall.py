"""``shardwise.comm.all_to_all_single`` / ``all_to_all`` with uneven splits: each algorithm
(native, pairwise, linear) equals ``torch.distributed.all_to_all_single`` on gloo, on groups
of 2, 3 and 4 ranks, with zero-row blocks; bytes, messages and steps are the formulas; split
sizes that ranks disagree on raise one ``CommError`` on every rank instead of aborting.
One spawn of 4 ranks, ~5 s."""

import alltoall_workers as aw

WORLD = 4
_cache: dict = {}


def results() -> list[dict]:
    if "ranks" not in _cache:
        from shardwise.launch import spawn
        _cache["ranks"] = spawn(aw.bundle, WORLD, join_timeout_s=300)
    return _cache["ranks"]


def test_every_algorithm_equals_torch_with_uneven_splits():
    for rank, res in enumerate(results()):
        p = res["parity"]
        assert p["bad"] == [], (rank, p["bad"][:5])
        # groups of 2 and 3 (ranks inside them), and of 4: 3 seeds x 2 widths x 2 dtypes x 3
        assert p["count"] == 36 * ((rank < 2) + (rank < 3) + 1), (rank, p["count"])
        assert p["list_ok"] == [True] * 3 and p["even"], (rank, p)


def test_bytes_messages_and_steps():
    """Per rank: ours send exactly the rows addressed to others (X_sent = sum over j != r of
    rows[r][j] x row bytes) and receive what others address to it; pairwise takes N-1 steps
    of at most one message each way, linear one step; native is counted, bytes unknown."""
    ranks = results()
    rows = ranks[0]["records"]["rows"]
    row_bytes = 5 * 4
    for r, res in enumerate(ranks):
        recs = {rec["algorithm"]: rec for rec in res["records"]["records"]
                if rec["collective"] == "all_to_all"}
        assert set(recs) == {"native", "pairwise", "linear"}, recs
        sent = sum(rows[r][j] for j in range(WORLD) if j != r) * row_bytes
        recv = sum(rows[i][r] for i in range(WORLD) if i != r) * row_bytes
        for algo in ("pairwise", "linear"):
            rec = recs[algo]
            assert rec["nbytes"] == sum(rows[r]) * row_bytes
            assert (rec["bytes_sent"], rec["bytes_recv"]) == (sent, recv), (r, algo, rec)
            assert rec["msgs_sent"] == sum(1 for j in range(WORLD) if j != r and rows[r][j])
            assert rec["msgs_recv"] == sum(1 for i in range(WORLD) if i != r and rows[i][r])
        assert recs["pairwise"]["last_step"] <= WORLD - 1
        assert recs["linear"]["last_step"] <= 1
        assert recs["native"]["bytes_sent"] is None
        # the split check's swap is its own row, never mixed into the algorithm's
        checks = [rec for rec in res["records"]["records"] if rec["collective"] == "check"]
        assert checks and all(c["algorithm"] in ("pairwise", "dissemination") for c in checks)
    # the ranks together move every off-diagonal row once
    total = sum(rows[i][j] for i in range(WORLD) for j in range(WORLD) if i != j) * row_bytes
    assert sum(next(rec for rec in res["records"]["records"] if rec["algorithm"] == "pairwise"
                    and rec["collective"] == "all_to_all")["bytes_sent"]
               for res in ranks) == total


def test_disagreeing_splits_raise_on_every_rank():
    for r, res in enumerate(results()):
        m = res["mismatch"]
        assert m["msg"].startswith("all_to_all(pairwise)"), (r, m["msg"])
        assert "split sizes disagree" in m["msg"] and "\n" not in m["msg"], m["msg"]
        if r == 1:
            assert "rank 0 sends 1 rows to rank 1, which expects 2" in m["msg"], m["msg"]
        assert m["seconds"] < 10, m  # raised at once, not after the timeout
        assert "input_split_sizes=[2, 2, 2, 2] must be 4 sizes >= 0 summing to dim 0" in \
            m["bad_sizes"], m["bad_sizes"]
        assert m["still_works"], m
