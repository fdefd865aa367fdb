"""Step time of one layout, by walking the pipeline schedule's instruction lists.

The simulator runs ``pipeline.schedules.schedule(kind, p, m, v).ranks`` -- the lists the
executor runs -- on a model of the machine: each rank runs its list in order; a
``Forward``/``Backward`` starts when the rank is free and its input (the previous chunk's
activation, the next chunk's gradient) has arrived, and lasts its compute time plus its
tensor-parallel collectives; a ``Send*`` posts the tensor on the rank's communication thread
(one message at a time), to arrive after ``Link.p2p``; a ``Recv*`` costs nothing (the
executor posts receives without waiting; the compute that needs the tensor waits).
After the flush, the data-parallel gradient sync (ZeRO-0 all-reduce, ZeRO-1/2
reduce-scatter + parameter all-gather; ZeRO-3 gathers per micro-batch, inside compute) and
the optimizer run; the step ends when the slowest rank is done (the global norm is one
collective over all ranks).

Compute: forward FLOPs per block and micro-batch of b sequences 24 b s h^2 + 4 b s^2 h
(Narayanan et al. 2021, sec. 5.1), the LM head 2 b s h V; backward twice the forward;
recomputation adds one forward; all divided by tp; seconds = FLOPs / (peak x efficiency)
+ a fixed overhead per block pass. Tensor parallelism: per block two all-reduces of b s h e
bytes forward and two backward (Shoeybi et al. 2019), or with sequence parallelism an
all-gather and a reduce-scatter in place of each (Korthikanti et al. 2022); priced on the
link the tp group crosses. The time split reported: ``compute``, ``tp``, ``pp`` (waiting
on pipeline transfers beyond the ideal bubble), ``bubble`` (idle with free transfers),
``dp`` and ``optimizer``, for the slowest rank; they add up to ``step``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from shardwise.parallel.pipeline.schedules import (
    Backward,
    Forward,
    SendActivation,
    SendGrad,
    schedule,
    warmup_forwards,
)
from shardwise.planner.hardware import Cluster
from shardwise.planner.memory import (
    BYTES,
    chunk_blocks,
    padded_vocab,
    rank_params,
    stage_layers,
)
from shardwise.planner.specs import ModelSpec, block_matmul_params


@dataclass(frozen=True)
class Layout:
    """One point of the search: sizes, micro-batching, schedule and memory options."""

    dp: int
    tp: int
    pp: int
    micro_batch_size: int  # sequences per micro-batch
    micro_batches: int     # micro-batches per step (per dp replica)
    schedule: str = "1f1b"
    chunks_per_rank: int = 1  # model chunks per pipeline rank (interleaved: v)
    zero: int = 0
    recompute: bool = False
    sp: bool = False
    partition: str = "layers"  # how the engine cuts layers into chunks: layers or params
    selective: bool = False  # recompute only the attention core (Korthikanti et al. 2022)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def label(self) -> str:
        v = self.chunks_per_rank
        sched = "" if self.pp == 1 else (f" {self.schedule}" + (f" v{v}" if v > 1 else ""))
        extra = ("" if not self.recompute else " rc") + (" rc=attn" if self.selective else "") + (
            "" if not self.sp else " sp") + (
            " cut=params" if self.partition == "params" and self.pp > 1 else "")
        return (f"dp{self.dp} tp{self.tp} pp{self.pp} mb{self.micro_batch_size} "
                f"m{self.micro_batches}{sched} z{self.zero}{extra}")


def block_flops(spec: ModelSpec, mb: int) -> float:
    """Forward FLOPs of one block: 2 per weight of its matrices per token (GPT: 24 s h^2),
    and Q K^T and softmax(.) V, 4 s^2 H D (H D = h for the GPT and Llama)."""
    s = spec.block_size
    return 2 * mb * s * block_matmul_params(spec) + 4 * mb * s * s * spec.attn_width


def block_ops(spec: ModelSpec, mb: int, tp: int, sp: bool, kernels: str, e: int):
    """One block's forward on one tp rank, as operations: ``(gemms, moves)``, the FLOPs of
    each GEMM and the bytes each memory-bound operation reads and writes (``e`` bytes per
    value; T = mb s tokens, d = h / a, k = key/value heads x d, f the MLP width):

    - GEMMs: Q K V 2 T h (h + 2k) / t; Q K^T and P V 2 mb s^2 H D / t each (batched over
      the rank's heads); the output projection 2 T h^2 / t; the MLP 2 T h f / t per matrix
      (2 matrices, 3 gated);
    - two norms (read and write T h; / t under sequence parallelism);
    - attention, by kernel: ``megatron-2021`` materialises the s x s scores (a fused
      scale-mask-softmax reads and writes them, a dropout reads them and writes them and a
      1-byte mask); ``shardwise`` (flash) keeps them on chip and moves only Q, K, V and the
      output;
    - the MLP's activation (read and write T f / t; SwiGLU reads two);
    - the two residual adds: ``megatron-2021`` fused bias + dropout + add (reads two,
      writes one, a mask), ``shardwise`` a plain add (reads two, writes one).
    Backward is priced as twice the forward (its GEMMs are two of the same shape, its
    element-wise kernels read and write about twice as much)."""
    s, h, a = spec.block_size, spec.n_embd, spec.n_head
    T = mb * s
    d = h // a
    k = spec.kv_heads * d
    f = spec.ffn
    att = spec.attn_width
    gemms = [2 * T * h * (h + 2 * k) / tp, 2 * mb * s * s * att / tp, 2 * mb * s * s * att / tp,
             2 * T * h * h / tp] + [2 * T * h * f / tp] * (3 if spec.gated else 2)
    th = T * h * e / (tp if sp else 1)  # a whole-width activation on this rank
    moves = [2 * th, 2 * th]
    if kernels == "megatron-2021":
        scores = mb * (a // tp if a % tp == 0 else a / tp) * s * s
        moves += [2 * scores * e, scores * (2 * e + 1)]
        moves += [T * h / (tp if sp else 1) * (3 * e + 1)] * 2
    else:
        moves += [T * (h + 2 * k + h) * e / tp]
        moves += [3 * th] * 2
    moves += [(3 if spec.gated else 2) * T * f * e / tp]
    return gemms, moves


def attention_core_ops(spec: ModelSpec, mb: int, tp: int, kernels: str, e: int):
    """The part of ``block_ops`` selective recomputation runs again (Korthikanti et al.
    2022, sec. 5: Q K^T, softmax, dropout, P V): ``(gemms, moves)``."""
    gemms, moves = block_ops(spec, mb, tp, False, kernels, e)
    return gemms[1:3], (moves[2:4] if kernels == "megatron-2021" else moves[2:3])


def op_seconds(cluster: Cluster, ops) -> float:
    gemms, moves = ops
    return sum(cluster.ops.gemm(x) for x in gemms) + sum(cluster.ops.memory(x) for x in moves)


def head_seconds(spec: ModelSpec, mb: int, tp: int, cluster: Cluster, e: int) -> float:
    """The LM head's forward under the per-operation model: its GEMM 2 T h V / t, the final
    norm, and the vocabulary-parallel cross entropy reading the logits three times (max,
    exp-sum, loss) in fp32."""
    T, h = mb * spec.block_size, spec.n_embd
    V = padded_vocab(spec.vocab_size, tp) / tp
    return (cluster.ops.gemm(2 * T * h * V) + cluster.ops.memory(2 * T * h * e)
            + cluster.ops.memory(3 * T * V * 4))


def chunk_costs(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str,
                dedicated: bool = False):
    """Per global chunk: (forward s, backward s, tp s in forward, tp s in backward, waiting
    s in forward, waiting s in backward). Waiting: the sync penalty of ranks sharing cores
    (``contention``), spent off the core. ``dedicated``: compute as if the rank had a core
    to itself (the shared walk slows it down)."""
    world = 1 if dedicated else lay.world
    rate, over = cluster.rate(world), cluster.rank_overhead(world)
    e, s, h = BYTES[precision], spec.block_size, spec.n_embd
    tl = cluster.link(lay.tp)
    act = lay.micro_batch_size * s * h * e
    pen = cluster.sync_penalty_s
    if lay.tp == 1:
        tp_blk, n_sync = 0.0, 0
    elif lay.sp:
        tp_blk, n_sync = 2 * (tl.all_gather(lay.tp, act) + tl.reduce_scatter(lay.tp, act)), 4
    else:
        tp_blk, n_sync = 2 * tl.all_reduce(lay.tp, act), 2
    bf = block_flops(spec, lay.micro_batch_size) / lay.tp
    head_f = 2 * lay.micro_batch_size * s * h * padded_vocab(spec.vocab_size, lay.tp) / lay.tp
    # vocab-parallel embedding: one all-reduce forward; vocab-parallel loss: three small ones
    emb_tp = tl.all_reduce(lay.tp, act) if lay.tp > 1 else 0.0
    loss_tp = 3 * tl.all_reduce(lay.tp, lay.micro_batch_size * s * 4) if lay.tp > 1 else 0.0
    chunks = chunk_blocks(spec, lay.pp * lay.chunks_per_rank, lay.partition)
    out = []
    if cluster.ops is not None:  # per operation (hardware.OpModel)
        blk_s = op_seconds(cluster, block_ops(spec, lay.micro_batch_size, lay.tp, lay.sp,
                                              cluster.kernels, e))
        head_s = head_seconds(spec, lay.micro_batch_size, lay.tp, cluster, e)
    else:
        blk_s, head_s = bf / rate + over, head_f / rate
    attn_s = 0.0
    if lay.selective:
        if cluster.ops is not None:
            attn_s = op_seconds(cluster, attention_core_ops(spec, lay.micro_batch_size, lay.tp,
                                                            cluster.kernels, e))
        else:
            attn_s = 4 * lay.micro_batch_size * s * s * spec.attn_width / lay.tp / rate
    for c, (nb, head) in enumerate(chunks):
        emb = c == 0  # the first chunk holds the embedding
        comp_f = nb * blk_s + (head_s if head else 0.0)
        tpf = nb * tp_blk + (emb_tp if emb else 0.0) + (loss_tp if head else 0.0)
        syncs = (nb * n_sync + (1 if emb else 0) + (3 if head else 0)) if lay.tp > 1 else 0
        wait_f = syncs * pen
        tpb = nb * tp_blk + (loss_tp if head else 0.0)  # backward: the block collectives
        wait_b = (nb * n_sync + (1 if head else 0)) * pen if lay.tp > 1 else 0.0
        comp_b = 2 * comp_f
        if lay.recompute:
            comp_b += comp_f
            tpb += tpf
            wait_b += wait_f
        elif lay.selective:  # the attention core's forward again, no collective in it
            comp_b += nb * attn_s
        out.append((comp_f + tpf + wait_f, comp_b + tpb + wait_b, tpf + wait_f, tpb + wait_b,
                    wait_f, wait_b))
    return out


def dp_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str,
               layers: list[int]) -> tuple[float, float]:
    """(seconds of dp collectives after the flush, seconds of ZeRO-3 gathers inside the
    schedule) for a rank holding ``layers``."""
    if lay.dp == 1:
        return 0.0, 0.0
    e = BYTES[precision]
    P = rank_params(spec, layers, lay.tp, lay.pp)
    link = cluster.link(lay.world)
    n, x, pen = lay.dp, P * e, cluster.sync_penalty_s
    if lay.zero == 0:
        return link.all_reduce(n, x) + pen, 0.0
    if lay.zero in (1, 2):
        return link.reduce_scatter(n, x) + link.all_gather(n, x) + 2 * pen, 0.0
    if cluster.zero3_overlap and not cluster.cores:
        return 0.0, lay.micro_batches * zero3_exposed(spec, lay, cluster, precision, layers)
    units = len(layers)  # ZeRO-3 gathers unit by unit (a layer each), per micro-batch
    return 0.0, lay.micro_batches * (2 * link.all_gather(n, x) + link.reduce_scatter(n, x)
                                     + 3 * units * pen)


def unit_forward_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster,
                         precision: str) -> dict:
    """Forward seconds of one micro-batch through one layer of each kind (its compute and
    tensor-parallel collectives, as ``chunk_costs`` prices them): ``embed``, ``block``,
    ``head``."""
    one = Layout(1, lay.tp, 1, lay.micro_batch_size, 1, sp=lay.sp)
    c = chunk_costs(replace(spec, n_layer=1), one, cluster, precision)[0]
    blk = chunk_costs(replace(spec, n_layer=2), one, cluster, precision)[0][0] - c[0]
    e = BYTES[precision]
    act = lay.micro_batch_size * spec.block_size * spec.n_embd * e
    emb = cluster.link(lay.tp).all_reduce(lay.tp, act) if lay.tp > 1 else 0.0
    return {"embed": emb, "block": blk, "head": c[0] - blk - emb}


def zero3_exposed(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str,
                  layers: list[int]) -> float:
    """Seconds per micro-batch that ZeRO-3's collectives add to a rank's compute, with the
    engine's overlap (``parallel.zero.stage3``): each unit (a layer) is all-gathered before
    it runs, the next unit's gather launched as it starts (prefetch), so in forward only
    the first gather and what each later gather takes beyond the previous unit's compute
    is exposed; in backward the unit's gather again (prefetched during the later unit's
    backward, which also carries that unit's reduce-scatter on the same stream), and the
    last reduce-scatter after the last backward."""
    e, n, L = BYTES[precision], lay.dp, spec.n_layer
    link = cluster.link(lay.world)
    fwd = unit_forward_seconds(spec, lay, cluster, precision)
    kind = ["embed" if i == 0 else "head" if i == L + 1 else "block" for i in layers]
    g = [link.all_gather(n, rank_params(spec, [i], lay.tp, lay.pp) * e) for i in layers]
    r = [link.reduce_scatter(n, rank_params(spec, [i], lay.tp, lay.pp) * e) for i in layers]
    c = [fwd[k] for k in kind]
    b = [(3 if lay.recompute else 2) * x for x in c]
    exposed = g[0] + sum(max(0.0, g[i] - c[i - 1]) for i in range(1, len(layers)))
    k = len(layers) - 1
    exposed += g[k]  # the last unit, freed after forward, gathered again for backward
    for j in range(k, -1, -1):  # during unit j's backward: unit j-1's gather, j+1's scatter
        comm = (g[j - 1] if j >= 1 else 0.0) + (r[j + 1] if j + 1 <= k else 0.0)
        exposed += max(0.0, comm - b[j])
    return exposed + r[0]  # the first unit's scatter, after the last backward


def tied_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str, r: int) -> float:
    """The all-reduce of a tied embedding's gradient between the first and last pipeline
    ranks (``r`` one of them, pp > 1), else 0."""
    if lay.pp > 1 and spec.tie_weights and (r in (0, lay.pp - 1)):
        return cluster.link(lay.tp * lay.pp).all_reduce(
            2, padded_vocab(spec.vocab_size, lay.tp) * spec.n_embd / lay.tp * BYTES[precision])
    return 0.0


def optimizer_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, layers: list[int]) -> float:
    """AdamW over this rank's masters: ~40 bytes of memory traffic per element."""
    P = rank_params(spec, layers, lay.tp, lay.pp)
    if lay.zero:
        P = P / lay.dp
    share = max(1.0, lay.world / cluster.cores) if cluster.cores else 1.0
    return 40 * P / cluster.mem_bw * share


def _post_send(ins, r: int, comm_free: list, done: dict, arrival: dict, p2p: float) -> None:
    """A send of rank ``r``: it leaves once its compute is done and the rank's link is free,
    occupies the link ``p2p`` seconds, and arrives then (``arrival[(kind, mb, chunk)]``)."""
    src = (Forward if isinstance(ins, SendActivation) else Backward)(ins.mb, ins.chunk)
    t0 = max(comm_free[r], done[src])
    comm_free[r] = t0 + p2p
    kind = "act" if isinstance(ins, SendActivation) else "grad"
    arrival[(kind, ins.mb, ins.chunk)] = t0 + p2p


def walk(sched, costs, p2p: float):
    """Run the instruction lists; returns per rank (end of its last compute, busy compute
    seconds, tp seconds) and the timeline events."""
    p = sched.p
    free, comm_free = [0.0] * p, [0.0] * p
    busy, tp_time = [0.0] * p, [0.0] * p
    pc = [0] * p
    done: dict = {}
    arrival: dict = {}
    events = []
    lists = sched.ranks
    n_chunks = sched.n_chunks
    remaining = sum(len(x) for x in lists)
    while remaining:
        progressed = False
        for r in range(p):
            while pc[r] < len(lists[r]):
                ins = lists[r][pc[r]]
                if isinstance(ins, Forward):
                    if ins.chunk == 0:
                        ready = 0.0
                    elif (ins.chunk - 1) % p == r:
                        if Forward(ins.mb, ins.chunk - 1) not in done:
                            break
                        ready = done[Forward(ins.mb, ins.chunk - 1)]
                    else:
                        key = ("act", ins.mb, ins.chunk - 1)
                        if key not in arrival:
                            break
                        ready = arrival[key]
                    f = costs[ins.chunk]
                    start = max(free[r], ready)
                    end = start + f[0]
                    busy[r] += f[0] - f[2]
                    tp_time[r] += f[2]
                elif isinstance(ins, Backward):
                    own = done.get(Forward(ins.mb, ins.chunk))
                    if own is None:
                        break
                    ready = own
                    if ins.chunk < n_chunks - 1:
                        if (ins.chunk + 1) % p == r:
                            nxt = done.get(Backward(ins.mb, ins.chunk + 1))
                            if nxt is None:
                                break
                            ready = max(ready, nxt)
                        else:
                            key = ("grad", ins.mb, ins.chunk + 1)
                            if key not in arrival:
                                break
                            ready = max(ready, arrival[key])
                    f = costs[ins.chunk]
                    start = max(free[r], ready)
                    end = start + f[1]
                    busy[r] += f[1] - f[3]
                    tp_time[r] += f[3]
                elif isinstance(ins, (SendActivation, SendGrad)):
                    _post_send(ins, r, comm_free, done, arrival, p2p)
                    pc[r] += 1
                    remaining -= 1
                    progressed = True
                    continue
                else:  # receives and the optimizer step: no time on the compute stream
                    pc[r] += 1
                    remaining -= 1
                    progressed = True
                    continue
                done[ins] = end
                free[r] = end
                events.append({"rank": r, "kind": type(ins).__name__, "mb": ins.mb,
                               "chunk": ins.chunk, "start": start, "end": end})
                pc[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("schedule deadlocked in the simulator")
    return free, busy, tp_time, events


@lru_cache(maxsize=16)
def _orders(p: int, m: int, v: int):
    """The compute orders of ``schedules.compute_order("1f1b"/"interleaved", p, m, v)`` as
    arrays ``[rank, position]`` (``tests/test_planner_search.py`` holds them equal), with
    what ``walk_fast`` reads: per op its micro-batch, chunk, backward flag; the rank and
    position of the op its remote input comes from (the previous chunk's forward, the next
    chunk's backward: a send), the position of a backward's own forward, and per rank the
    positions of the ops that send (in order: a rank posts its sends one at a time)."""
    import numpy as np

    mv, n = m * v, p * v
    k = np.arange(mv)
    mb = (k // (p * v)) * p + k % p
    local = (k // p) % v
    bwd = np.zeros((p, 2 * mv), dtype=bool)
    O_mb = np.empty((p, 2 * mv), dtype=np.int64)
    O_c = np.empty((p, 2 * mv), dtype=np.int64)
    for r in range(p):
        w = warmup_forwards(p, m, v, r)
        b = np.concatenate([np.zeros(w, bool), np.tile([False, True], mv - w), np.ones(w, bool)])
        bwd[r] = b
        O_mb[r, ~b], O_c[r, ~b] = mb, local * p + r
        O_mb[r, b], O_c[r, b] = mb, (v - 1 - local) * p + r
    pos = np.empty((2, m, n), dtype=np.int64)
    pos[bwd.astype(np.int64), O_mb, O_c] = np.arange(2 * mv)[None, :]
    rem_c = np.where(bwd, O_c + 1, O_c - 1)
    has_rem = np.where(bwd, O_c < n - 1, O_c > 0)
    rem_k = pos[bwd.astype(np.int64), O_mb, np.clip(rem_c, 0, n - 1)]
    own_k = pos[0, O_mb, O_c]
    sends = np.where(bwd, O_c > 0, O_c < n - 1) if p > 1 else np.zeros_like(bwd)
    send_pos = [np.nonzero(sends[r])[0] for r in range(p)]
    return bwd, O_c, has_rem, rem_c % p, rem_k, own_k, send_pos


def walk_fast(p: int, m: int, v: int, costs, p2p: float):
    """``walk``'s (end of each rank's last compute, busy compute seconds, tp seconds) for the
    1F1B and interleaved schedules, without walking instruction by instruction.

    The walk is a longest-path problem on a fixed graph: an op ends at max(its rank's
    previous op, its input) + its cost; a send arrives at max(the rank's previous send,
    its source op) + ``p2p``. Along one rank both are max-plus prefix scans (``end_k =
    C_k + max_{j<=k}(ready_j - C_{j-1})``, C the running cost), one numpy call each. The
    ranks are swept down and up (Gauss-Seidel), each scan reading its neighbours' latest
    arrivals, until nothing moves: every value only grows towards the longest path, which
    it reaches after as many sweeps as the critical path turns between going down and up
    the pipeline (3 to 7 here). Sums of busy time are taken in the walk's order (``cumsum``),
    so they are the walk's to the last bit; end times agree to rounding (1e-12)."""
    import numpy as np

    bwd, O_c, has_rem, rem_r, rem_k, own_k, send_pos = _orders(p, m, v)
    n = bwd.shape[1]
    cf = np.array([c[0] for c in costs])
    cb = np.array([c[1] for c in costs])
    cost = np.where(bwd, cb[O_c], cf[O_c])
    busy_v = np.where(bwd, np.array([c[1] - c[3] for c in costs])[O_c],
                      np.array([c[0] - c[2] for c in costs])[O_c])
    tp_v = np.where(bwd, np.array([c[3] for c in costs])[O_c],
                    np.array([c[2] for c in costs])[O_c])
    busy = np.cumsum(busy_v, axis=1)[:, -1].tolist()
    tp_time = np.cumsum(tp_v, axis=1)[:, -1].tolist()
    C = np.cumsum(cost, axis=1)
    Cp = C - cost
    sentinel = p * n  # a cell that stays 0: the input of an op that has none
    src = np.where(has_rem, rem_r * n + rem_k, sentinel)
    own = np.where(bwd, np.arange(p)[:, None] * n + own_k, sentinel)
    end = np.zeros(p * n + 1)
    arrival = np.zeros(p * n + 1)
    steps = [np.arange(len(s)) * p2p for s in send_pos]
    sends = [r * n + s for r, s in enumerate(send_pos)]
    order = list(range(p)) + list(range(p - 2, 0, -1)) if p > 2 else list(range(p))
    while True:
        before = end.copy()
        for r in order:
            ready = np.maximum(arrival[src[r]], end[own[r]])
            e = C[r] + np.maximum.accumulate(ready - Cp[r])
            end[r * n:(r + 1) * n] = e
            sp = send_pos[r]
            if len(sp):
                arrival[sends[r]] = steps[r] + p2p + np.maximum.accumulate(e[sp] - steps[r])
        if np.array_equal(before, end):
            break
    return end[n - 1:p * n:n].tolist(), busy, tp_time


def walk_shared(sched, costs, p2p: float, cores: int, replicas: int):
    """``walk`` for ranks that share ``cores`` cores (this machine): processor sharing. At
    every moment the ranks computing (times ``replicas``: the dp x tp copies of each
    pipeline rank, running the same schedule at once) share the cores equally, so a rank
    idle in the bubble lends its core to the others. Costs are a dedicated core's."""
    p = sched.p
    lists, n_chunks = sched.ranks, sched.n_chunks
    pc, comm_free = [0] * p, [0.0] * p
    busy, tp_time, end_of = [0.0] * p, [0.0] * p, [0.0] * p
    running: dict[int, list] = {}  # rank -> [op, remaining work, start, tp share]
    done: dict = {}
    arrival: dict = {}
    events = []
    t = 0.0

    def ready_time(r, ins):
        """When ``ins``'s inputs are there (None: not yet known)."""
        if isinstance(ins, Forward):
            if ins.chunk == 0:
                return 0.0
            if (ins.chunk - 1) % p == r:
                return done.get(Forward(ins.mb, ins.chunk - 1))
            return arrival.get(("act", ins.mb, ins.chunk - 1))
        own = done.get(Forward(ins.mb, ins.chunk))
        if own is None:
            return None
        if ins.chunk == n_chunks - 1:
            return own
        if (ins.chunk + 1) % p == r:
            nxt = done.get(Backward(ins.mb, ins.chunk + 1))
        else:
            nxt = arrival.get(("grad", ins.mb, ins.chunk + 1))
        return None if nxt is None else max(own, nxt)

    def _advance(r, wake):
        while r not in running and pc[r] < len(lists[r]):
            ins = lists[r][pc[r]]
            if isinstance(ins, (SendActivation, SendGrad)):
                _post_send(ins, r, comm_free, done, arrival, p2p)
                pc[r] += 1
                continue
            if not isinstance(ins, (Forward, Backward)):
                pc[r] += 1
                continue
            rt = ready_time(r, ins)
            if rt is None:
                break
            if rt > t + 1e-15:
                wake.append(rt)
                break
            f = costs[ins.chunk]
            fwd = isinstance(ins, Forward)
            work, tpw, wait = (f[0], f[2], f[4]) if fwd else (f[1], f[3], f[5])
            running[r] = [ins, work - wait, t, tpw / work if work else 0.0, wait]
            pc[r] += 1

    while True:
        moved = True
        while moved:  # a send found late in the pass can unblock an earlier rank
            moved = False
            wake = []
            for r in range(p):
                before = pc[r]
                _advance(r, wake)
                moved |= pc[r] != before
        computing = {r: v for r, v in running.items() if v[1] > 1e-12}
        waiting = {r: v for r, v in running.items() if v[1] <= 1e-12}
        if not running:
            if not wake:
                if all(pc[r] >= len(lists[r]) for r in range(p)):
                    break
                raise RuntimeError("schedule deadlocked in the simulator")
            t = min(wake)
            continue
        speed = min(1.0, cores / (max(1, len(computing)) * replicas))
        ends = [v[1] / speed for v in computing.values()] + [v[4] for v in waiting.values()]
        t_next = t + min(ends)
        if wake:
            t_next = min(t_next, min(wake))
        for r in list(running):
            ins, rem, start, tpf, wait = running[r]
            if rem > 1e-12:
                rem -= speed * (t_next - t)
                running[r][1] = rem
                continue
            wait -= t_next - t
            running[r][4] = wait
            if wait <= 1e-12:
                done[ins] = t_next
                dur = t_next - start
                busy[r] += dur * (1 - tpf)
                tp_time[r] += dur * tpf
                end_of[r] = t_next
                events.append({"rank": r, "kind": type(ins).__name__, "mb": ins.mb,
                               "chunk": ins.chunk, "start": start, "end": t_next})
                del running[r]
        t = t_next
    return end_of, busy, tp_time, events


def simulate(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str | None = None,
             with_events: bool = False) -> dict:
    """Predicted seconds of one optimizer step and its split (see the module docstring)."""
    precision = precision or cluster.precision
    kind = lay.schedule if lay.pp > 1 else "1f1b"
    shared = bool(cluster.cores)
    costs = chunk_costs(spec, lay, cluster, precision, dedicated=shared)
    e = BYTES[precision]
    msg = lay.micro_batch_size * spec.block_size * spec.n_embd * e / (lay.tp if lay.sp else 1)
    p2p = (cluster.link(lay.tp * lay.pp).p2p(msg) + cluster.sync_penalty_s) if lay.pp > 1 else 0.0
    fast = not shared and not with_events and kind in ("1f1b", "interleaved")
    p, m, v = lay.pp, lay.micro_batches, lay.chunks_per_rank
    if fast:  # the same numbers as walk(), without the instruction lists
        run = lambda c: walk_fast(p, m, v, costs, c) + ([],)
    elif shared:
        sched = schedule(kind, p, m, v)
        run = lambda c: walk_shared(sched, costs, c, cluster.cores, lay.dp * lay.tp)
    else:
        sched = schedule(kind, p, m, v)
        run = lambda c: walk(sched, costs, c)
    end, busy, tp_time, events = run(p2p)
    ideal_end = run(0.0)[0] if lay.pp > 1 else end
    per_rank = stage_layers(spec, lay.pp, lay.chunks_per_rank, lay.partition)
    totals, parts = [], []
    for r in range(lay.pp):
        dp_after, dp_inside = dp_seconds(spec, lay, cluster, precision, per_rank[r])
        opt = optimizer_seconds(spec, lay, cluster, per_rank[r])
        tied = tied_seconds(spec, lay, cluster, precision, r)
        totals.append(end[r] + dp_inside + dp_after + tied + opt)
        parts.append({"compute": busy[r], "tp": tp_time[r],
                      "pp": max(0.0, end[r] - ideal_end[r]),
                      "dp": dp_after + dp_inside + tied, "optimizer": opt})
    # the split of the bottleneck stage (most compute); its idle time is the bubble
    star = max(range(lay.pp), key=lambda r: busy[r] + tp_time[r])
    step = max(totals)
    split = parts[star]
    split["bubble"] = step - sum(split.values())
    best = (step, split)
    out = {"step": best[0], **best[1]}
    if with_events:
        out["events"] = events
    return out
