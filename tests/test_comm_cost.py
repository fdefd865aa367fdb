"""Cost model, profiles, chunking, virtual ranks and the bench CLI: no processes spawned."""

import json
import math

import pytest
import torch

from helpers import assert_one_line_exit_2
from shardwise.cli import bench
from shardwise.cli import comm_table as table
from shardwise.comm import accounting, cost
from shardwise.comm.halving_doubling import Fold
from shardwise.comm.primitives import Call, GroupInfo, balanced_bounds

PRM = cost.LinkParams(alpha=5e-5, beta_link=2.5e-10, beta_host=1e-10, gamma=1e-10,
                      gamma_host=4e-11, native_alpha=2e-4, native_beta=7e-10)
# the textbook model: no contention (Thakur et al. 2005 with beta = beta_link)
FREE = cost.LinkParams(alpha=5e-5, beta_link=2.5e-10, beta_host=0.0, gamma=1e-10,
                       gamma_host=0.0, native_alpha=2e-4, native_beta=7e-10)


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


def test_without_contention_the_formulas_are_thakur_et_al():
    x, n = 64 << 20, 4
    a, b, g = FREE.alpha, FREE.beta_link, FREE.gamma
    assert cost.predict("ring", n, x, FREE) == pytest.approx(6 * a + 1.5 * x * b + 0.75 * x * g)
    assert cost.predict("halving_doubling", n, x, FREE) == pytest.approx(
        4 * a + 1.5 * x * b + 0.75 * x * g)
    assert cost.predict("tree", n, x, FREE) == pytest.approx(4 * a + 4 * x * b + 2 * x * g)
    # naive and parallel: the multi-port limit (the root receives its N-1 messages at once)
    assert cost.predict("naive", n, x, FREE) == pytest.approx(2 * a + 2 * x * b + 3 * x * g)
    assert cost.predict("parallel", n, x, FREE) == pytest.approx(a + x * b + 3 * x * g)
    assert cost.predict("sequential", n, x, FREE) == pytest.approx(6 * (a + x * b) + 3 * x * g)
    assert cost.predict("native", n, x, FREE) == pytest.approx(
        FREE.native_alpha + x * FREE.native_beta)
    assert cost.predict("ring", 1, x, FREE) == 0.0
    with pytest.raises(ValueError, match="butterfly"):
        cost.predict("butterfly", 4, x, FREE)


def test_contention_term_per_step():
    # b(k) = max(beta_link, k beta_host): one message alone runs at the link's rate, k at
    # once share the host's rate; same for the reduction
    assert PRM.b(1) == PRM.beta_link and PRM.b(2) == PRM.beta_link
    assert PRM.b(4) == pytest.approx(4 * PRM.beta_host) and PRM.b(12) == pytest.approx(12e-10)
    assert PRM.g(2) == PRM.gamma and PRM.g(4) == pytest.approx(4 * PRM.gamma_host)
    x, n = 64 << 20, 4
    a = PRM.alpha
    # ring: every step moves N messages of X/N (b(4) = 4e-10), N ranks reduce X/N (g(4))
    assert cost.predict("ring", n, x, PRM) == pytest.approx(
        6 * a + 1.5 * x * 4e-10 + 0.75 * x * 1.6e-10)
    # naive: 3 messages of X to and from the root at once (b(3) = 3e-10); it reduces alone
    assert cost.predict("naive", n, x, PRM) == pytest.approx(2 * a + 2 * x * 3e-10 + 3 * x * 1e-10)
    # sequential: one message at a time, never contended
    assert cost.predict("sequential", n, x, PRM) == cost.predict("sequential", n, x, FREE)
    # parallel: all 12 messages at once (b(12)), every rank reduces 3X (g(4))
    assert cost.predict("parallel", n, x, PRM) == pytest.approx(
        a + x * 12e-10 + 3 * x * 1.6e-10)
    # a step's host term binds once k beta_host > beta_link: N = 2 ring with a slow host
    slow = cost.LinkParams(1e-4, 2e-10, 3e-10, 1e-10, 1e-10, 0, 0)
    assert cost.predict("ring", 2, x, slow) == pytest.approx(2e-4 + x * 6e-10 + 0.5 * x * 2e-10)
    # contention only ever adds time
    for algo in ("ring", "halving_doubling", "tree", "naive", "sequential", "parallel"):
        for k in (2, 3, 4, 5, 8):
            assert cost.predict(algo, k, x, PRM) >= cost.predict(algo, k, x, FREE)


def test_lone_messages_have_their_own_latency():
    prm = cost.LinkParams(alpha=1e-3, beta_link=2.5e-10, beta_host=1e-10, gamma=1e-10,
                          gamma_host=4e-11, native_alpha=0, native_beta=0, alpha_1=1e-4)
    assert prm.a(1) == 1e-4 and prm.a(2) == 1e-3 and PRM.a(1) == PRM.alpha  # -1: as alpha
    x = 1 << 20
    d = prm.alpha - prm.alpha_1
    # sequential and N=2 tree / naive are lone messages only; ring never is
    assert cost.predict("sequential", 4, x, PRM) - cost.predict("sequential", 4, x, prm) \
        == pytest.approx(6 * (PRM.alpha - prm.alpha_1))
    assert cost.predict("tree", 2, x, prm) == pytest.approx(
        cost.predict("tree", 2, x, PRM) - 2 * (PRM.alpha - prm.alpha_1))
    # tree at N=4: step 1 moves 2 messages (alpha), step 2 one (alpha_1), each way
    assert cost.predict("tree", 4, x, prm) - cost.predict("tree", 4, x, cost.LinkParams(
        1e-3, 2.5e-10, 1e-10, 1e-10, 4e-11, 0, 0)) == pytest.approx(-2 * d)
    assert cost.predict("ring", 4, x, prm) == pytest.approx(
        6e-3 + 1.5 * x * prm.b(4) + 0.75 * x * prm.g(4))


def test_halving_doubling_steps_have_the_swap_latency():
    swap = cost.LinkParams(**{**PRM.__dict__, "alpha_swap": 1e-3})
    x = 1 << 20
    for n, steps in ((2, 2), (4, 4), (8, 6)):
        assert cost.predict("halving_doubling", n, x, swap) - cost.predict(
            "halving_doubling", n, x, PRM) == pytest.approx(steps * (1e-3 - PRM.alpha))
        assert cost.predict("ring", n, x, swap) == cost.predict("ring", n, x, PRM)


def test_tree_steps_count_the_messages_of_each_binomial_step():
    assert cost.tree_step_messages(2) == [1]
    assert cost.tree_step_messages(4) == [2, 1]
    assert cost.tree_step_messages(5) == [2, 1, 1]  # v = 1, 3 | 2 | 4
    assert cost.tree_step_messages(8) == [4, 2, 1]
    for n in range(2, 17):  # every rank but the root sends exactly once
        assert sum(cost.tree_step_messages(n)) == n - 1
    x, n = 1 << 20, 5
    a = PRM.alpha
    want = sum(2 * a + 2 * x * PRM.b(c) + x * PRM.g(c) for c in (2, 1, 1))
    assert cost.predict("tree", n, x, PRM) == pytest.approx(want)


@pytest.mark.parametrize("n", [3, 5, 6, 7, 12])
def test_halving_doubling_not_a_power_of_two(n):
    # p = 2^floor(log2 N) ranks run the algorithm (p messages per step), then N - p pairs
    # fold in and out: two steps of N - p messages of X, one reduction of X on N - p ranks
    x, a = 16 << 20, PRM.alpha
    p = 1 << (n.bit_length() - 1)
    core = 2 * math.log2(p) * a + 2 * (p - 1) / p * x * PRM.b(p) + (p - 1) / p * x * PRM.g(p)
    fix = 2 * a + 2 * x * PRM.b(n - p) + x * PRM.g(n - p)
    assert cost.predict("rabenseifner", n, x, PRM) == pytest.approx(core + fix)
    assert cost.predict("halving_doubling", n, x, PRM) > cost.predict("halving_doubling", p, x, PRM)


def test_model_orders_algorithms_sensibly():
    x = 64 << 20
    # latency-bound small messages favour few steps, bandwidth-bound large ones ring
    assert cost.predict("tree", 8, 1024, PRM) < cost.predict("ring", 8, 1024, PRM)
    assert cost.predict("ring", 8, x, PRM) < cost.predict("tree", 8, x, PRM)
    # all N(N-1) messages at once is the most contended pattern
    for n in (4, 8):
        assert cost.predict("parallel", n, x, PRM) > cost.predict("ring", n, x, PRM)


def test_profile_of_another_model_is_a_one_line_error(tmp_path):
    old = {"alpha": 1e-4, "beta_x": 6e-10, "beta_1": 3e-10, "gamma": 1e-10,
           "native_alpha": 1e-3, "native_beta": 7e-10}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"name": "old", "world_sizes": {"2": old}}))
    with pytest.raises(ValueError, match=r"cannot read comm profile .*old.json.*calibrate") as exc:
        cost.load_profile(path)
    assert "\n" not in str(exc.value)


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
        assert 0 < prm.alpha < 1e-2 and 0 < prm.gamma < 1e-8
        assert 0 < prm.beta_link < 1e-8 and 0 < prm.beta_host < 1e-8


def test_accounting_off_costs_nothing_and_on_counts_payload():
    info = GroupInfo(None, (0, 1), 0)
    accounting.disable()
    assert Call("all_reduce", "ring", info, 8).record is None
    accounting.enable()
    try:
        import torch
        call = Call("all_reduce", "ring", info, 8, torch.float32)
        call.record.add_message(3, 8, sent=True)
        call.record.add_message(3, 12, sent=False)
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
    (["--spawns", "0"], "--spawns"),
    (["--algorithms", "ring,butterfly"], "butterfly"),
    (["--profile", "/nonexistent.json"], "no such file"),
    (["--table", "--calibrate"], "separate runs"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bench_cli_bad_input_is_one_line_exit_2(argv, needle, capsys):
    assert_one_line_exit_2(argv, capsys, needle, main=bench.main)


def test_parse_size():
    assert bench.parse_size("4K") == 4096 and bench.parse_size("64M") == 64 << 20
    assert bench.parse_size("1MiB") == 1 << 20


def test_quiet_values_keep_undisturbed_repeats_or_all():
    from shardwise.comm import quiet
    vals, loads = [1.0, 9.0, 2.0, 3.0], [0.0, 1.0, 0.05, 0.1]
    assert quiet.quiet_values(vals, loads) == [1.0, 2.0, 3.0]
    assert quiet.quiet_values(vals, [1.0, 1.0, 0.0, 1.0]) == vals  # fewer than 3 quiet: all
    f = quiet.Foreign([])
    assert f.stop() == 0.0  # never started


def test_auto_is_the_native_collective_on_cuda_with_nccl_and_a_foreign_profile_is_refused(
        monkeypatch):
    """The repository's profile is gloo on this CPU; for CUDA tensors on NCCL ``auto`` must
    not route gradients through our send/recv algorithms with those constants (issue 23)."""
    from shardwise.comm import api
    from shardwise.comm.primitives import GroupInfo

    cpu = cost.Profile("cpu-here", {2: PRM, 4: PRM}, {"backend": "gloo", "device": "cpu"})
    h100 = "cuda:NVIDIA H100 80GB HBM3"
    cost._refused.clear()
    try:
        cost.use_profile(cpu)
        assert cost.choose_all_reduce(2, 25 << 20, (), 1, "gloo", "cpu") != "native"
        with pytest.warns(RuntimeWarning) as seen:
            assert cost.choose_all_reduce(2, 25 << 20, (), 1, "nccl", h100) == "native"
        (w,) = seen
        line = str(w.message)
        assert "\n" not in line and "gloo/cpu" in line and f"nccl/{h100}" in line
        # through the public choice: an NCCL group and a CUDA tensor (a meta tensor stands in
        # for the CUDA one; its device kind is what a CUDA device reports)
        monkeypatch.setattr(api, "backend_of", lambda group: "nccl")
        monkeypatch.setattr(cost, "device_kind", lambda device: h100)
        info = GroupInfo(None, (0, 1), 0)
        grads = torch.empty(25 << 18, device="meta")  # a 25 MiB bucket of fp32 gradients
        assert api.choose(info, grads) == "native"
        # a profile calibrated with NCCL on this GPU model does choose, among ours too
        gpu = cost.Profile("h100", {2: PRM}, {"backend": "nccl", "device": h100})
        cost.use_profile(gpu)
        assert api.choose(info, grads) == min(
            cost.AUTO_CANDIDATES, key=lambda a: cost.predict(a, 2, 25 << 20, PRM))
        # ... but not for another GPU model
        monkeypatch.setattr(cost, "device_kind", lambda device: "cuda:NVIDIA A100-SXM4-80GB")
        with pytest.warns(RuntimeWarning, match="not nccl/cuda:NVIDIA A100"):
            assert api.choose(info, grads) == "native"
    finally:
        cost.use_profile(None)
        cost._refused.clear()


def test_old_profiles_count_as_gloo_on_the_cpu_and_calibration_records_where():
    old = cost.Profile("old", {2: PRM}, {"host": "vm"})
    assert (old.backend, old.device) == ("gloo", "cpu")
    assert (cost.BUILTIN.backend, cost.BUILTIN.device) == ("gloo", "cpu")
    assert cost.device_kind(torch.device("cpu")) == "cpu"


def test_zero_and_pipeline_collectives_are_nccls_own_on_nccl(monkeypatch):
    """ZeRO's gathers and reduce-scatters, DDP's and the pipeline's broadcasts ask for "auto":
    the backend's own collective on NCCL, ours (bytes counted) on gloo."""
    from shardwise.comm import api

    monkeypatch.setattr(api, "backend_of", lambda group: "nccl")
    assert [api.resolve_auto("auto", None, c) for c in ("all_gather", "reduce_scatter",
                                                         "broadcast")] == ["native"] * 3
    assert api.resolve_auto("ring", None, "all_gather") == "ring"  # by name, on every backend
    monkeypatch.setattr(api, "backend_of", lambda group: "gloo")
    assert [api.resolve_auto("auto", None, c) for c in ("all_gather", "reduce_scatter",
                                                         "broadcast")] == ["ring", "ring", "tree"]
