"""Cost model, profiles, chunking, virtual ranks and the bench CLI: no processes spawned."""

import json
import math

import pytest

from shardwise.comm import accounting, bench, cost, table
from shardwise.comm.halving_doubling import Fold
from shardwise.comm.primitives import Call, GroupInfo, balanced_bounds

PRM = cost.LinkParams(alpha=5e-5, beta_x=4e-10, beta_1=2.5e-10, gamma=1e-10,
                      native_alpha=2e-4, native_beta=7e-10)


@pytest.mark.parametrize("numel,parts", [(0, 3), (1, 8), (7, 2), (37, 5), (840, 8)])
def test_balanced_bounds_cover_and_differ_by_at_most_one(numel, parts):
    b = balanced_bounds(numel, parts)
    sizes = [b[i + 1] - b[i] for i in range(parts)]
    assert b[0] == 0 and b[-1] == numel and len(sizes) == parts
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8, 12])
def test_fold_maps_virtual_ranks_one_to_one(n):
    folds = [Fold(n, r) for r in range(n)]
    p = folds[0].p
    assert p & (p - 1) == 0 and p <= n < 2 * p
    active = [f.vrank for f in folds if f.vrank >= 0]
    assert sorted(active) == list(range(p))
    for f in folds:
        if f.vrank >= 0:
            assert f.real(f.vrank) == f.rank
    bb = folds[0].block_bounds(10)
    assert bb[0] == 0 and bb[-1] == 10 * n and bb == sorted(bb)


def test_formulas_follow_thakur_et_al():
    x = 64 << 20
    n = 4
    assert cost.predict("ring", n, x, PRM) == pytest.approx(
        6 * PRM.alpha + 1.5 * x * PRM.beta_x + 0.75 * x * PRM.gamma)
    assert cost.predict("halving_doubling", n, x, PRM) == pytest.approx(
        4 * PRM.alpha + 1.5 * x * PRM.beta_x + 0.75 * x * PRM.gamma)
    assert cost.predict("rabenseifner", 6, x, PRM) > cost.predict("halving_doubling", 4, x, PRM)
    assert cost.predict("tree", n, x, PRM) == pytest.approx(
        4 * PRM.alpha + 4 * x * PRM.beta_1 + 2 * x * PRM.gamma)
    assert cost.predict("native", n, x, PRM) == pytest.approx(
        PRM.native_alpha + x * PRM.native_beta)
    assert cost.predict("ring", 1, x, PRM) == 0.0
    with pytest.raises(ValueError, match="butterfly"):
        cost.predict("butterfly", 4, x, PRM)
    # latency-bound small messages favour few steps, bandwidth-bound large ones ring
    assert cost.predict("tree", 8, 1024, PRM) < cost.predict("ring", 8, 1024, PRM)
    assert cost.predict("ring", 8, x, PRM) < cost.predict("tree", 8, x, PRM)


def test_profile_round_trip_and_auto_choice(tmp_path):
    prof = cost.Profile("t", {2: PRM, 4: PRM}, {"host": "here"})
    path = prof.save(tmp_path / "p.json")
    loaded = cost.load_profile(path)
    assert loaded.world_sizes == prof.world_sizes and loaded.params(3) == PRM
    try:
        cost.use_profile(path)
        assert cost.choose_all_reduce(2, 64 << 20) == min(
            cost.AUTO_CANDIDATES, key=lambda a: cost.predict(a, 2, 64 << 20, PRM))
        assert cost.choose_all_reduce(8, 64 << 20) in cost.AUTO_CANDIDATES
    finally:
        cost.use_profile(None)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"world_sizes": {}}))
    with pytest.raises(ValueError, match="bad.json"):
        cost.load_profile(bad)


def test_committed_default_profile_is_loadable():
    prof = cost.load_profile(cost.REPO_PROFILE)
    assert 2 in prof.world_sizes and 4 in prof.world_sizes
    for prm in prof.world_sizes.values():
        assert 0 < prm.alpha < 1e-2 and 0 < prm.beta_x < 1e-8 and 0 < prm.gamma < 1e-8


def test_accounting_off_costs_nothing_and_on_counts_payload():
    info = GroupInfo(None, (0, 1), 0)
    accounting.disable()
    assert Call("all_reduce", "ring", info, 8).record is None
    accounting.enable()
    try:
        import torch
        call = Call("all_reduce", "ring", info, 8, torch.float32)
        call.record.add_round(3, [(1, torch.ones(2))], [(1, torch.ones(3)), (1, torch.ones(0))])
        call.close()
        row = accounting.table()[-1]
        assert (row["bytes_sent"], row["bytes_recv"], row["msgs_recv"], row["last_step"]) == \
            (8, 12, 1, 3)
        assert "bytes_sent" in accounting.format_table([row])
    finally:
        accounting.disable()
        accounting.reset()


def test_table_formulas_match_seed_orders():
    for n in (2, 4, 8):
        assert table.formulas("ring", n)[3] == pytest.approx(2 * (n - 1) / n)
        assert table.formulas("halving_doubling", n)[1] == 2 * math.log2(n)
        assert table.formulas("parallel", n)[5] == n * (n - 1)


@pytest.mark.parametrize("argv,needle", [
    (["--sizes", "4Q"], "--sizes"),
    (["--sizes", "6"], "multiple of 4"),
    (["--world-size", "0"], "--world-size"),
    (["--repeats", "0"], "--repeats"),
    (["--algorithms", "ring,butterfly"], "butterfly"),
    (["--profile", "/nonexistent.json"], "no such file"),
    (["--table", "--calibrate"], "separate runs"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bench_cli_bad_input_is_one_line_exit_2(argv, needle, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


def test_parse_size():
    assert bench.parse_size("4K") == 4096 and bench.parse_size("64M") == 64 << 20
    assert bench.parse_size("1MiB") == 1 << 20
