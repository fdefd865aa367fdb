"""Pipeline schedules as pure data: validity, in-flight counts, warm-ups, bubbles, errors."""

import pytest

from shardwise.parallel.pipeline.bubble import ideal_bubble
from shardwise.parallel.pipeline.check import check, check_stream
from shardwise.parallel.pipeline.schedules import (
    KINDS,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    Schedule,
    ScheduleError,
    SendActivation,
    SendGrad,
    compute_order,
    schedule,
    time_orders,
    warmup_forwards,
)
from shardwise.parallel.pipeline.stream import Stream, cut, stream


def _cases():
    for kind in KINDS:
        for v in (range(1, 5) if kind == "interleaved" else [2] if kind in ("zbv", "dualpipev")
                  else [1]):
            yield kind, v


@pytest.mark.parametrize("kind, v", list(_cases()))
def test_every_schedule_is_valid(kind, v):
    for p in range(1, 9):
        for m in range(1, 17):
            if kind == "interleaved" and v > 1 and m % p:
                with pytest.raises(ScheduleError, match="multiple of parallel.pp"):
                    schedule(kind, p, m, v)
                continue
            if kind == "dualpipev" and m < 2 * p:
                with pytest.raises(ScheduleError, match="at least 2 x parallel.pp"):
                    schedule(kind, p, m, v)
                continue
            s = schedule(kind, p, m, v)
            rep = check(s)
            if kind == "gpipe":
                assert rep.peak_in_flight == (m,) * p
            elif kind in ("1f1b", "pipedream") or (kind == "interleaved" and v == 1):
                assert rep.peak_in_flight == tuple(min(p - r, m) for r in range(p))
            elif kind == "naive":
                assert rep.peak_in_flight == (1,) * p
            elif kind in ("zb1p", "zbv"):  # 1F1B's peak (p stages' worth) on every rank
                assert max(rep.peak_in_flight) <= min(p, m) * v
            elif kind == "dualpipev":  # DualPipe's p + 1 micro-batches, in half-stages
                assert max(rep.peak_in_flight) <= 2 * p + 1
            else:  # interleaved, Narayanan et al. SC 2021: warm-up 2(p-r-1) + (v-1)p
                for r in range(p):
                    warm = min(2 * (p - r - 1) + (v - 1) * p, m * v)
                    assert warmup_forwards(p, m, v, r) == warm
                    assert rep.forwards_before_backward[r] == min(warm + 1, m * v)
                    assert rep.peak_in_flight[r] == min(warm + 1, m * v)
            assert rep.steps == ((m * v,) * p if kind == "pipedream" else (1,) * p)


def test_interleaved_steady_state_alternates():
    """After the warm-up, rank r alternates one forward and one backward m*v - warm times."""
    p, m, v = 4, 8, 2
    orders = compute_order("interleaved", p, m, v)
    for r, order in enumerate(orders):
        warm = warmup_forwards(p, m, v, r)
        steady = order[warm:warm + 2 * (m * v - warm)]
        assert [type(op) for op in steady] == [Forward, Backward] * (m * v - warm)
        assert all(isinstance(op, Backward) for op in order[warm + 2 * (m * v - warm):])
        # chunks of a rank are p apart; micro-batches go through in groups of p per chunk
        assert [op.chunk for op in order if isinstance(op, Forward)][:p + 1] == [r] * p + [r + p]


@pytest.mark.parametrize("kind, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("naive", 1)])
def test_simulated_bubble_matches_formula(kind, v):
    for p in (2, 4):
        for m in (4, 8):
            times = time_orders(compute_order(kind, p, m, v), p, v, forward_cost=1.0 / v)
            span = max(e for _, e in times.values())
            busy = sum(e - s for s, e in times.values())
            assert 1 - busy / (p * span) == pytest.approx(ideal_bubble(kind, p, m, v))


def test_checker_catches_bad_schedules():
    r0, r1 = schedule("gpipe", 2, 2).ranks
    # a backward moved before its forward
    b = r1.index(Backward(0, 1))
    moved = r1[:1] + (Backward(0, 1),) + tuple(op for i, op in enumerate(r1[1:], 1) if i != b)
    with pytest.raises(ScheduleError, match="before its forward"):
        check(Schedule("x", 2, 2, 1, (r0, moved)))
    # a receive nobody sends
    with pytest.raises(ScheduleError, match="pair up"):
        check(Schedule("x", 2, 2, 1, (tuple(op for op in r0 if op != SendActivation(1, 0, 1)), r1)))
    # a micro-batch never computed
    with pytest.raises(ScheduleError, match="never runs"):
        check(Schedule("x", 1, 2, 1, ((Forward(0, 0), Backward(0, 0), OptimizerStep()),)))
    # rank 1 sends its gradient before receiving the second activation, rank 0 sends its
    # second activation before receiving that gradient: with rendezvous sends, a deadlock
    bad0 = (Forward(0, 0), SendActivation(0, 0, 1), Forward(1, 0), SendActivation(1, 0, 1),
            RecvGrad(0, 0, 1), Backward(0, 0), RecvGrad(1, 0, 1), Backward(1, 0), OptimizerStep())
    bad1 = (RecvActivation(0, 1, 0), Forward(0, 1), Backward(0, 1), SendGrad(0, 1, 0),
            RecvActivation(1, 1, 0), Forward(1, 1), Backward(1, 1), SendGrad(1, 1, 0),
            OptimizerStep())
    with pytest.raises(ScheduleError, match="deadlock"):
        check(Schedule("x", 2, 2, 1, (bad0, bad1)))


@pytest.mark.parametrize("args, match", [
    (("zigzag", 2, 4), "unknown schedule"),
    (("gpipe", 0, 4), "positive integer"),
    (("1f1b", 2, 4, 2), "chunks_per_rank=2 with parallel.schedule=1f1b"),
    (("interleaved", 4, 6, 2), "micro_batches=6 must be a multiple of parallel.pp=4"),
    (("zbv", 4, 8, 1), "in a V: set parallel.chunks_per_rank = 2, not 1"),
    (("zb1p", 4, 8, 2), "one chunk per rank"),
    (("dualpipev", 4, 8, 1), "schedule=dualpipev places two chunks per rank in a V: set "
                             "parallel.chunks_per_rank = 2, not 1"),
    (("dualpipev", 4, 7, 2), "micro_batches=7 must be at least 2 x parallel.pp = 8"),
])
def test_bad_arguments_are_one_line_errors(args, match):
    with pytest.raises(ScheduleError, match=match) as exc:
        schedule(*args)
    assert "\n" not in str(exc.value)


def test_pipedream_stream_never_flushes():
    """PipeDream's stream cut into per-step segments: every segment deadlock-free on its own,
    the concatenation (segments, then the drain) exactly the uncut 1F1B order over all
    steps * m micro-batches, and the periodic lists equal to a direct simulation."""
    for p in range(1, 9):
        for m in range(1, 17):
            s = stream(p, m)
            steps = s.steady_from + 3
            rep = check_stream(s, steps)
            assert rep.peak_in_flight == tuple(min(p - r, steps * m) for r in range(p))
            assert rep.steps == (steps * m,) * p  # a weight update per backward
            segments, drain = cut(p, m, steps)
            assert [s.segment(k) for k in range(steps)] == segments
            assert s.drain(steps - 1) == drain
            uncut = compute_order("pipedream", p, steps * m)
            for r in range(p):
                ops = [op for lists in segments + [drain] for op in lists[r]]
                assert [op for op in ops if isinstance(op, (Forward, Backward))] == uncut[r]
                # the drain holds only the backwards still in flight: p - r - 1 of them
                assert [type(op) for op in drain[r]].count(Backward) == min(p - r - 1, steps * m)


def test_pipedream_stream_segment_is_self_contained():
    """A transfer never spans two segments: the trainer's collectives run between them."""
    s = stream(4, 2)
    for k in range(6):
        lists = s.segment(k)
        sends = {(r, op.mb, type(op).__name__[4:]) for r, ops in enumerate(lists) for op in ops
                 if isinstance(op, (SendActivation, SendGrad))}
        recvs = {(op.peer, op.mb, type(op).__name__[4:]) for ops in lists for op in ops
                 if isinstance(op, (RecvActivation, RecvGrad))}
        assert sends == recvs and sends
    broken = list(s.segment(3))
    broken[1] = tuple(op for op in broken[1] if not isinstance(op, RecvActivation))
    segments = tuple(s.segment(k) for k in range(3)) + (tuple(broken),)
    drains = tuple(s.drain(k) for k in range(4))
    with pytest.raises(ScheduleError, match="segment 3: sends and receives do not pair up"):
        check_stream(Stream(4, 2, 3, segments, drains), 4)


def test_pipedream_steady_step_bubble():
    """A steady step of the stream has no fill or drain; only the start after the loss
    broadcast costs rank r r forwards: (p-1) t_f / ((p-1) t_f + m (t_f + t_b))."""
    for p in range(1, 9):
        for m in range(1, 17):
            assert ideal_bubble("pipedream", p, m) == pytest.approx((p - 1) / (3 * m + p - 1))
            assert ideal_bubble("pipedream", p, m) < ideal_bubble("1f1b", p, m) or p == 1


# -- zero-bubble schedules (Qi et al. 2023, arXiv:2401.10241): the backward split in B and W

@pytest.mark.parametrize("kind", ["zb1p", "zbv"])
def test_zero_bubble_schedules_are_valid(kind):
    """Every B after its F, every W after its B, counts balance, no deadlock, 1F1B's peak."""
    v = 2 if kind == "zbv" else 1
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            s = schedule(kind, p, m, v)
            rep = check(s)  # blocking rendezvous: raises on a deadlock
            assert s.split and rep.steps == (1,) * p
            assert max(rep.peak_in_flight) <= p * v  # 1F1B holds p stages on rank 0
            for r, ops in enumerate(s.ranks):
                pos = {op: i for i, op in enumerate(ops)}
                for c in s.chunks_of(r):
                    for mb in range(m):
                        f, b, w = Forward(mb, c), BackwardInput(mb, c), BackwardWeight(mb, c)
                        assert pos[f] < pos[b] < pos[w]
                assert not any(isinstance(op, Backward) for op in ops)
                counts = [sum(isinstance(op, t) for op in ops)
                          for t in (Forward, BackwardInput, BackwardWeight)]
                assert counts == [m * v] * 3


def test_zbv_places_chunks_in_a_v():
    s = schedule("zbv", 4, 8, 2)
    assert [s.chunks_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    # chunks 3 and 4 meet on rank 3: no transfer between them
    assert not any(isinstance(op, (SendActivation, SendGrad)) and op.peer == 3
                   for op in s.ranks[3])


@pytest.mark.parametrize("kind, v", [("zb1p", 1), ("zbv", 2)])
def test_zero_bubble_beats_1f1b_on_the_ideal_machine(kind, v):
    """Unit costs (F = B = W): the split schedules' idle fraction is below 1F1B's and, for
    ZB-V, below the interleaved schedule's at v = 2."""
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            times = time_orders(compute_order(kind, p, m, v), p, v, forward_cost=1.0 / v)
            span = max(e for _, e in times.values())
            bubble = 1 - sum(e - s for s, e in times.values()) / (p * span)
            assert bubble < ideal_bubble("1f1b", p, m)
            if kind == "zbv":
                assert bubble < ideal_bubble("interleaved", p, m, 2)
            assert 0 <= bubble < ideal_bubble("1f1b", p, m)


def test_checker_catches_bad_split_backwards():
    s = schedule("zb1p", 2, 2)
    r0, r1 = s.ranks

    def swap(ops, a, b):
        ops = list(ops)
        i, j = ops.index(a), ops.index(b)
        ops[i], ops[j] = ops[j], ops[i]
        return tuple(ops)
    with pytest.raises(ScheduleError, match="weight gradient before its input gradient"):
        check(Schedule("x", 2, 2, 1, (r0, swap(r1, BackwardInput(0, 1), BackwardWeight(0, 1))),
                       split=True))
    fused = tuple(Backward(op.mb, op.chunk) if isinstance(op, BackwardInput) else op
                  for op in r1 if not isinstance(op, BackwardWeight))
    check(Schedule("x", 2, 2, 1, (r0, fused), split=True))  # a split schedule may fuse some
    with pytest.raises(ScheduleError, match="fused schedule cannot run BackwardInput"):
        check(Schedule("x", 2, 2, 1, (r0, r1)))
    both = tuple(x for op in r1 for x in ((op, Backward(op.mb, op.chunk))
                                          if isinstance(op, BackwardWeight) else (op,)))
    with pytest.raises(ScheduleError, match="already ran fused or split"):
        check(Schedule("x", 2, 2, 1, (r0, both), split=True))
    with pytest.raises(ScheduleError, match="never runs BackwardWeight"):
        check(Schedule("x", 2, 2, 1, (r0, tuple(op for op in r1 if op != BackwardWeight(1, 1))),
                       split=True))
    with pytest.raises(ScheduleError, match="does not hold the consumer"):
        wrong = tuple(SendActivation(0, 0, 0) if op == SendActivation(0, 0, 1) else op for op in r0)
        check(Schedule("x", 2, 2, 1, (wrong, r1), split=True))


# -- DualPipeV (DeepSeek-V3, arXiv:2412.19437): ZB-V's V, fused and split backwards mixed

def _torch_dualpipev(p: int, m: int) -> list[list]:
    """torch's ScheduleDualPipeV per-rank order, from its order function alone (no process
    group): each overlapped pair flattened forward first, as our executor runs it."""
    from torch.distributed.pipelining import schedules as ts

    sched = ts.ScheduleDualPipeV.__new__(ts.ScheduleDualPipeV)
    sched.pp_group_size, sched._n_microbatches = p, m
    kinds = {ts.FORWARD: Forward, ts.FULL_BACKWARD: Backward,
             ts.BACKWARD_INPUT: BackwardInput, ts.BACKWARD_WEIGHT: BackwardWeight}
    out = []
    for r in range(p):
        ops = []
        for a in sched._calculate_single_rank_operations(r):
            for x in (a.sub_actions or (a,)):
                ops.append(kinds[x.computation_type](x.microbatch_index, x.stage_index))
        out.append(ops)
    return out


def test_dualpipev_is_torchs_order_and_valid():
    """The order is torch's ScheduleDualPipeV's; the lists pass the checker (every B after
    its F, every W after its B, each pair's backward fused or split, no deadlock) for
    p in {2, 4, 8}, m in {2p, 3p, 4p} (m = p is refused: DualPipe needs m >= 2p)."""
    for p in (2, 4, 8):
        for m in (2 * p, 3 * p, 4 * p):
            assert compute_order("dualpipev", p, m, 2) == _torch_dualpipev(p, m), (p, m)
            s = schedule("dualpipev", p, m, 2)
            rep = check(s)
            assert s.split and s.placement == tuple(c if c < p else 2 * p - 1 - c
                                                    for c in range(2 * p))
            assert rep.steps == (1,) * p and max(rep.peak_in_flight) <= 2 * p + 1
            for r, ops in enumerate(s.ranks):
                pos = {op: i for i, op in enumerate(ops)}
                for c in s.chunks_of(r):
                    for mb in range(m):
                        if (mb, c) in s.split_pairs:
                            b, w = BackwardInput(mb, c), BackwardWeight(mb, c)
                            assert pos[Forward(mb, c)] < pos[b] < pos[w]
                        else:
                            assert pos[Forward(mb, c)] < pos[Backward(mb, c)]
            fused = sum(isinstance(op, Backward) for ops in s.ranks for op in ops)
            assert 0 < fused < 2 * p * m  # both kinds of backward
            assert len(s.split_pairs) == 2 * p * m - fused
    with pytest.raises(ScheduleError, match="at least 2 x parallel.pp"):
        schedule("dualpipev", 4, 4, 2)


def test_dualpipev_bubble_on_the_ideal_machine():
    """Unit costs (F = B = W, a fused backward B + W): DualPipeV's idle fraction is ZB-V's
    at p = 4, m = 8 (0.059) and below 1F1B's and the interleaved schedule's everywhere."""
    assert ideal_bubble("dualpipev", 4, 8, 2) == pytest.approx(ideal_bubble("zbv", 4, 8, 2))
    for p in (2, 4, 8):
        for m in (2 * p, 4 * p):
            assert ideal_bubble("dualpipev", p, m, 2) < ideal_bubble("interleaved", p, m, 2)


def test_zb1p_reaches_the_papers_zb_h1_bubble():
    """ZB-H1's handcrafted order (W's deferred into the cool-down): on unit costs its idle
    fraction is the paper's (p-1)/(3m+p-1) for m >= p (0.111 at p 4, m 8: the greedy order
    gave 0.172), 1F1B's peak p on every rank; below m = p, 1F1B's order split."""
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            assert ideal_bubble("zb1p", p, m) == pytest.approx((p - 1) / (3 * m + p - 1))
            assert check(schedule("zb1p", p, m)).peak_in_flight == (p,) * p
    assert ideal_bubble("zb1p", 4, 2) < ideal_bubble("1f1b", 4, 2)
