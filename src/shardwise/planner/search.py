"""Search over layouts: enumerate, prune with a reason, simulate, rank.

The space: every dp x tp x pp x cp = world size, micro-batch size (a divisor of the global
batch per replica), schedule (1F1B; interleaved with v = 2, 4 where the layers allow),
ZeRO 0-3 (3 with interleaving too: each chunk's units gathered around its own micro-batches),
recomputation on/off,
sequence parallelism on/off (tp > 1), stage cut by layer count or by parameters (pp > 1;
once where both cut the same chunks, ``distinct_cuts``);
context parallelism cp where 2 cp divides the sequence (the engine's load-balanced chunks),
pruned for a model with dropout (the engine refuses cp > 1 with dropout); for a mixture of
experts,
expert parallelism ep over the divisors of dp that divide the experts (with ZeRO-3 too:
``simulate.zero3_seconds``, ``memory.gathered_bytes``; sequence parallelism refused with
experts, as the engine does); FP8 (``fp8=(False, True)``) and
selective recomputation (``selective=(False, True)``: ``Layout.recompute = "selective"``,
the engine's op-level one, ``parallel.recompute = "selective"``; pruned for a mixture of
experts, whose kept bytes are not modelled) only when asked: the engine's FP8 needs tp = 1.
Korthikanti et al.'s attention-core recomputation (``Layout.selective``) is priced for
their published runs (``benchmarks/planner_published.py``), never searched. Tensor
parallelism stays inside a node unless ``tp_across_nodes``.

Order of work (``plan``), each pruned layout keeping its reason (``Pruned``; a whole group
pruned for one reason is one record with its ``count``):

1. reasons that hold for a whole (tp, pp) or (pp, v) group (tp does not divide the heads,
   tp would cross nodes, more chunks than layers) prune the group without enumerating it;
2. the other reasons the engine has, then memory (``memory_of``: static bytes memoised per
   (dp, tp, pp, v, ZeRO, cut), activations per micro-batch size) before any timing;
3. every layout left gets a cheap bound (``Bounds.cheap``: m x the whole model's forward +
   backward / pp + the least of the ranks' extras, from memoised pieces) and, only when that
   comes first in a heap, its lower bound on the step time (``lower_bound``: the busiest
   rank's own work, the forward chain that reaches it and the backward chain back to rank 0,
   its data-parallel and optimizer time; per-chunk costs memoised, ZeRO-3's per chunk
   shape); so layouts leave in the order of ``(lower_bound, index)`` that sorting every
   one would give, and are simulated in it (``simulate.simulate``); once ``top`` have been
   simulated, every layout whose bound exceeds the ``top``-th best step is pruned, saying
   so (the first with its ``lower_bound``, the others with whichever bound of theirs was
   computed, both at least that one): the ``top`` best are exactly the ones simulating
   everything would rank first (``exhaustive=True`` does, for the tests). The cyclic
   garbage collector is paused meanwhile (``_collector_paused``).

On a cluster whose ranks share cores (``local``) the simulator is processor-sharing and the
bound does not hold: there the old pre-rank stays (the chunk costs with the textbook bubble
keep ``simulate_top`` layouts for the simulator, 40 by default).
"""

from __future__ import annotations

import functools
import gc
import heapq
import sys
from dataclasses import dataclass, field, replace
from operator import add

from shardwise.base.config import (
    SPLIT_BACKWARD_KINDS,
    V_SHAPED_KINDS,
    micro_batches_refusal,
    split_backward_refusal,
)
from shardwise.parallel.pipeline.schedules import placement_of
from shardwise.planner.comm_price import dp_seconds, p2p_seconds, tied_seconds
from shardwise.planner.compute import optimizer_seconds
from shardwise.planner.costs import chunk_costs, model_seconds
from shardwise.planner.feasible import (  # noqa: F401 (prune_reason: importable from here)
    SELECTIVE_MOE,
    check,
    chunks_reason,
    cp_reason,
    fp8_reason,
    layout_reason,
    prune_reason,
    tp_reason,
)
from shardwise.planner.hardware import Cluster
from shardwise.planner.layout import Layout
from shardwise.planner.memory import (
    BYTES,
    MEGATRON,
    GiB,
    activation_bytes,
    cut,
    gathered_bytes,
    mask_bytes,
    stage_layers,
    static_bytes,
)
from shardwise.planner.simulate import simulate
from shardwise.planner.specs import ModelSpec


@dataclass
class Candidate:
    """A layout that fits in memory, with its ``memory`` by kind (bytes per GPU) and, once
    simulated, its ``time`` (``simulate``'s split, seconds)."""

    layout: Layout
    memory: dict          # params, grads, optimizer, activations, total (bytes per GPU)
    time: dict = field(default_factory=dict)  # simulate()'s split; "step" seconds


@dataclass
class Pruned:
    """Layouts left out and why: ``layout`` (one of them, for a group), ``reason`` (one
    line), ``need`` (bytes per GPU, when pruned for memory), ``count`` (layouts of the
    space this record stands for: a group pruned at once for one reason)."""

    layout: Layout
    reason: str
    need: float | None = None  # bytes per GPU, when pruned for memory
    count: int = 1


def divisors(n: int) -> list[int]:
    """Every divisor of ``n`` (a positive integer), ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_choices(spec: ModelSpec, world: int, cp: list[int] | None = None) -> list[int]:
    """Context-parallel sizes of the space: ``cp`` if given, else every divisor c of the
    world size with 2 c dividing the sequence (each cp rank holds chunks i and 2c-1-i)."""
    if cp is not None:
        return [c for c in cp if world % c == 0]
    return [c for c in divisors(world) if spec.block_size % (2 * c) == 0 or c == 1]


def cp_a2a_choices(spec: ModelSpec, cp: int, tp: int,
                   cp_comm=("ring", "all_to_all", "hybrid")) -> list[int]:
    """All-to-all degrees of cp ranks over tp ones (``Layout.cp_a2a``) among the modes
    ``cp_comm``: 1 (ring), cp (all-to-all) and the hybrid's divisors between 2 and cp / 2,
    each where the query heads per tp rank divide by it and the key/value heads divide it
    or by it (``parallel.context.ulysses``; the config's rule); only cp for a model ring
    attention cannot run (``ModelDescription.ring_attention`` false: MLA, a soft cap)."""
    if cp == 1:
        return [1]
    ring = spec.description is None or spec.description.ring_attention
    h, kv = spec.n_head // tp, max(1, spec.kv_heads // tp)
    out = [1] if "ring" in cp_comm and ring else []
    for a in divisors(cp)[1:]:
        mode = "all_to_all" if a == cp else "hybrid"
        if (mode in cp_comm and (ring or a == cp) and h % a == 0
                and (kv % a == 0 or a % kv == 0)):
            out.append(a)
    return out


def ep_choices(spec: ModelSpec, dp: int, ep: list[int] | None = None) -> list[int]:
    """Expert-parallel sizes for ``dp`` replicas: 1 for a dense model, else the divisors of
    dp that divide the experts (or those of ``ep``)."""
    if not spec.moe:
        return [1]
    return [e for e in (ep or divisors(dp)) if dp % e == 0 and spec.n_experts % e == 0]


def enumerate_layouts(spec: ModelSpec, world: int, global_batch: int, *,
                      micro_batches: list[int] | None = None, zero: list[int] = (0, 1, 2, 3),
                      recompute: list[bool] = (False, True), sp: list[bool] = (False, True),
                      schedules: list[str] = ("1f1b", "interleaved"), vs: list[int] = (2, 4),
                      pp_max: int | None = None, partitions: list[str] = ("layers", "params"),
                      cp: list[int] | None = None, ep: list[int] | None = None,
                      fp8: list[bool] = (False,), selective: list[bool] = (False,),
                      cp_comm=("ring",)):
    """Yield every layout of the space (feasible or not)."""
    modes = _modes(recompute, selective)
    for c in cp_choices(spec, world, cp):
        for tp in divisors(world // c):
            degrees = cp_a2a_choices(spec, c, tp, cp_comm) or [1]  # none: pruned as one
            for pp in divisors(world // (tp * c)):
                if pp_max and pp > pp_max:
                    continue
                dp = world // (tp * pp * c)
                if global_batch % dp:
                    yield Layout(dp, tp, pp, 0, 0, cp=c), \
                        f"global batch {global_batch} is not divisible by dp={dp}"
                    continue
                per = global_batch // dp
                for mb in (micro_batches or divisors(per)):
                    if per % mb:
                        continue
                    m = per // mb
                    scheds = _schedules(pp, schedules, vs)
                    for kind, v in scheds:
                        for e in ep_choices(spec, dp, ep):
                            for z in zero:
                                for f8 in fp8:
                                    for rc, sel in modes:
                                        for s in (sp if tp > 1 else (False,)):
                                            for cut_by, a in ((x, a) for x in
                                                              distinct_cuts(spec, pp, v,
                                                                            partitions)
                                                              for a in degrees):
                                                yield Layout(dp, tp, pp, mb, m, kind, v, z, rc,
                                                             s, cut_by, sel, c, e, f8,
                                                             cp_a2a=a), None




def distinct_cuts(spec: ModelSpec, pp: int, v: int, partitions) -> tuple[str, ...]:
    """The ways of ``partitions`` ("layers", "params") to cut ``pp`` x ``v`` chunks that
    build different engines: one where two cut the same bounds (the first named kept).
    At pp = 1 there is nothing to cut: ("layers",). Where the chunks cannot be cut from
    the layers (``chunks_reason``), each of ``partitions``: the group is pruned whole.

    A search that kept both would list the same engine twice under two names, priced
    alike; ``benchmarks/planner_local.py`` trained such a pair among its top four, and the
    two copies of one engine measured 2.8-4.3% apart: its noise (docs/benchmarks.md)."""
    if pp == 1:
        return ("layers",)
    if chunks_reason(spec, pp, v):
        return tuple(partitions)
    out, seen = [], set()
    for by in partitions:
        bounds = cut(spec, pp * v, by).bounds
        if bounds not in seen:
            seen.add(bounds)
            out.append(by)
    return tuple(out)


def _modes(recompute, selective) -> list[tuple]:
    """The (``Layout.recompute``, ``Layout.selective``) pairs searched: each of
    ``recompute``, and the engine's selective recomputation where ``selective`` holds
    True."""
    return [(rc, False) for rc in recompute] + (
        [("selective", False)] if True in selective else [])


def held_bytes(spec: ModelSpec, dp: int, tp: int, pp: int, v: int, zero: int, precision: str,
               sp: bool = False, partition: str = "layers", cp: int = 1, ep: int = 1,
               dp_replicate: int = 1, schedule: str = "1f1b") -> dict:
    """``static_bytes`` (params, grads, optimizer) and ``"gathered"``, ZeRO-3's units in
    flight at the peak (``gathered_bytes``; 0 for ZeRO 0-2), bytes per GPU; ``"total"``
    their sum; ``dp_replicate``: HSDP's replicas (ZeRO shards over dp / dp_replicate).
    Each is its largest pipeline rank's, so the total may exceed every one rank's by the
    difference between the ranks' gathered units (a bound, never below)."""
    st = static_bytes(spec, dp, tp, pp, v, zero, precision, sp, partition=partition, cp=cp,
                      ep=ep, dp_replicate=dp_replicate, schedule=schedule)
    g = gathered_bytes(spec, dp, tp, pp, zero, precision, partition, cp, ep, v, dp_replicate)
    return {**st, "gathered": g, "total": st["total"] + g}


def memory_of(spec: ModelSpec, lay: Layout, precision: str, kernels: str = "shardwise",
              static: bool = True, compiled: bool = False) -> dict:
    """Bytes per GPU of ``lay``: what it holds between steps and ZeRO-3's gathered units
    (``held_bytes``) and the activations of the kernels a block runs (``hardware.KERNELS``:
    shardwise's measured model, or Megatron-LM's of Korthikanti et al. 2022 for
    ``megatron-2021``). ``compiled``: shardwise's blocks and loss under torch.compile
    (``Cluster.compiled``, the GPU presets). ``static=False``: the activations' bytes alone
    (a number). ``ValueError`` naming the reason for a layout the engine cannot run
    (``check``)."""
    check(spec, lay)
    act = activation_bytes(spec, mb=lay.micro_batch_size, tp=lay.tp, pp=lay.pp,
                           micro_batches=lay.micro_batches, v=lay.chunks_per_rank,
                           schedule=lay.schedule, sp=lay.sp, recompute=lay.recompute,
                           precision=precision, partition=lay.partition,
                           am=MEGATRON if kernels == "megatron-2021" else None,
                           selective=lay.selective, cp=lay.cp, a2a=lay.cp_a2a,
                           compiled=compiled)
    if not static:
        return act
    st = held_bytes(spec, lay.dp, lay.tp, lay.pp, lay.chunks_per_rank, lay.zero, precision,
                    lay.sp, lay.partition, lay.cp, lay.ep, lay.dp_replicate, lay.schedule)
    return {**st, "activations": act, "total": st["total"] + act}


def quick_estimate(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str) -> float:
    """Analytic step time: chunk costs x (v m + p - 1) per rank (the textbook bubble).
    ``ValueError`` naming the reason for a layout the engine cannot run (``check``)."""
    check(spec, lay, cluster)
    costs = chunk_costs(spec, lay, cluster, precision)
    per_chunk = max(c.forward + c.backward for c in costs)
    return per_chunk * (lay.chunks_per_rank * lay.micro_batches + lay.pp - 1)


class Bounds:
    """``lower_bound`` with its per-chunk costs and per-rank extras memoised for one search
    (chunk costs do not depend on the micro-batch count, nor on ZeRO and dp but for
    ZeRO-3's gathers inside them; the extras not on the micro-batch size)."""

    def __init__(self, spec: ModelSpec, cluster: Cluster, precision: str):
        self.spec, self.cluster, self.precision = spec, cluster, precision
        self._costs: dict = {}
        self._blocks: dict = {}  # chunk_costs' per-block prices
        self._extras: dict = {}
        self._ranks: dict = {}  # a rank's extras by what they read of its layers
        self._ends: dict = {}  # lower_bound's per-rank ends, by chunk costs and m

    @staticmethod
    def costs_key(lay: Layout) -> tuple:
        """What ``chunk_costs`` reads of a layout (not the micro-batch count; ZeRO and dp
        only for ZeRO-3, whose gathers are inside the chunks)."""
        return (lay.tp, lay.pp, lay.chunks_per_rank, lay.micro_batch_size, lay.sp,
                lay.recompute, lay.partition, lay.selective, lay.cp, lay.cp_a2a, lay.ep,
                lay.fp8,
                (lay.dp, lay.dp_replicate) if lay.zero == 3 else 0)

    def costs(self, lay: Layout):
        """``chunk_costs`` of ``lay`` (one ``ChunkCost`` per global chunk, seconds of one
        micro-batch), memoised by ``costs_key``."""
        key = self.costs_key(lay)
        c = self._costs.get(key)
        if c is None:
            c = self._costs[key] = chunk_costs(self.spec, lay, self.cluster, self.precision,
                                               memo=self._blocks)
        return c

    def extras(self, lay: Layout) -> list[float]:
        """Per pipeline rank: seconds after its last compute that ``simulate`` adds: dp
        collectives after the flush, the tied embedding's all-reduce, the optimizer (the
        same functions)."""
        key = (lay.dp, lay.tp, lay.pp, lay.chunks_per_rank, lay.partition, lay.zero,
               lay.cp, lay.ep, lay.dp_replicate, lay.schedule in V_SHAPED_KINDS)  # its V
        x = self._extras.get(key)
        if x is None:
            spec, cl, prec = self.spec, self.cluster, self.precision
            x = []
            L = spec.n_layer
            for r, layers in enumerate(stage_layers(spec, lay.pp, lay.chunks_per_rank,
                                                    lay.partition, lay.schedule)):
                # a named size's dp and optimizer seconds read only how many blocks a rank
                # holds and whether the embedding and head are among them (rank_params)
                sig = ((len(layers), 0 in layers, L + 1 in layers)
                       if spec.description is None else tuple(layers))
                rk = (key, sig)
                own = self._ranks.get(rk)
                if own is None:
                    dp = dp_seconds(spec, lay, cl, prec, layers)
                    own = self._ranks[rk] = (dp.after, optimizer_seconds(spec, lay, cl, layers))
                x.append(own[0] + tied_seconds(spec, lay, cl, prec, r) + own[1])
            self._extras[key] = x
        return x


    def cheap(self, lay: Layout) -> float:
        """A bound below ``lower_bound`` for ``lay``, from memoised pieces alone (no chunk
        costs): the busiest rank does at least the average rank's work, m x (forward +
        backward of one micro-batch through the whole model, ``simulate.model_seconds``:
        the chunks' sum less their sends and ZeRO-3 gathers) / pp, and then at least the
        least of the ranks' extras. Scaled by 1 - 1e-12 so that rounding (the chunks summed
        in another order) cannot lift it above ``lower_bound``."""
        w = model_seconds(self.spec, lay, self.cluster, self.precision, self._blocks)
        return (lay.micro_batches * w / lay.pp + min(self.extras(lay))) * (1 - 1e-12)


def lower_bound(b: Bounds, lay: Layout) -> float:
    """Seconds ``simulate`` cannot go below for ``lay`` (1F1B or interleaved, ranks with a
    GPU each). Rank r runs m x (its chunks' forward + backward) of work; it cannot start
    before micro-batch 0's forward has passed chunks 0..r-1 (each its forward time and one
    transfer), its last op is the backward of the last micro-batch on chunk r, after which
    chunks r-1..0 still run their backward (and transfers) before rank 0 ends; then each
    rank adds its dp, tied-embedding and optimizer time. The maximum over ranks."""
    costs = b.costs(lay)
    p, m = lay.pp, lay.micro_batches
    ex = b.extras(lay)
    if p == 1:
        return m * sum(c.forward + c.backward for c in costs) + ex[0]
    key = (b.costs_key(lay), m, lay.schedule)
    ends = b._ends.get(key)
    if ends is None:  # per rank: the end of its own work, and of the backward chain after
        spec, e = b.spec, BYTES[b.precision]
        hop = p2p_seconds(spec, lay, b.cluster, e)
        work = [0.0] * p
        place = placement_of(lay.schedule, p, lay.chunks_per_rank)
        for c, cc in enumerate(costs):
            work[place[c]] += cc.forward + cc.backward
        own, chain, head, tail = [], [], 0.0, 0.0
        for r in range(p):
            end = head + m * work[r]
            own.append(end)
            chain.append(end + tail)
            head += costs[r].forward + hop
            tail += costs[r].backward + hop
        ends = b._ends[key] = (own, max(chain))
    own, chain = ends
    if lay.schedule in SPLIT_BACKWARD_KINDS:  # W's need not trail the backward chain
        return max(map(add, own, ex))
    return max(max(map(add, own, ex)), chain + ex[0])


def _schedules(pp: int, schedules, vs) -> list[tuple[str, int]]:
    """The (kind, v) schedules of the space at ``pp``: 1F1B, interleaved at each of ``vs``,
    and the zero-bubble ``zb1p`` (v 1), ``zbv`` and ``dualpipev`` (v 2) when ``schedules``
    names them."""
    if pp == 1:
        return [("1f1b", 1)]
    return [("1f1b", 1)] + ([("interleaved", v) for v in vs] if "interleaved" in schedules
                            else []) + [(k, 2 if k in V_SHAPED_KINDS else 1)
                                        for k in SPLIT_BACKWARD_KINDS if k in schedules]


def _space(spec, world, global_batch, micro_batches, schedules, vs, pp_max, cps):
    """Per (cp, tp, pp): dp, the micro-batch sizes, the (kind, v) schedules of the space."""
    for cp in cps:
        for tp in divisors(world // cp):
            for pp in divisors(world // (tp * cp)):
                if pp_max and pp > pp_max:
                    continue
                dp = world // (tp * pp * cp)
                scheds = _schedules(pp, schedules, vs)
                per = global_batch // dp if global_batch % dp == 0 else 0
                mbs = [mb for mb in (micro_batches or divisors(per)) if per and per % mb == 0]
                yield cp, tp, pp, dp, per, mbs, scheds


def _count(spec, mbs, scheds, zero, modes, sp, partitions, tp, pp, eps=(1,),
           fp8=(False,)) -> int:
    """How many layouts ``enumerate_layouts`` yields for these choices (its cuts per
    schedule from ``distinct_cuts``)."""
    cuts = sum(len(distinct_cuts(spec, pp, v, partitions)) for _, v in scheds)
    return (len(mbs) * cuts * len(zero) * len(modes) * len(eps) * len(fp8)
            * (len(sp) if tp > 1 else 1))


def _collector_paused(fn):
    """``fn`` with Python's cyclic garbage collector paused while it runs (restored after,
    as it was). A search keeps about a million small objects (layouts, candidates, their
    memory dicts, pruned records) and forms no reference cycles: the collector, run every
    few hundred allocations, traverses the growing heap again and again for nothing (about
    40% of the CPU time of the 146B search, ``docs/benchmarks.md``)."""

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()
    return paused


@_collector_paused
def plan(spec: ModelSpec, cluster: Cluster, world: int, global_batch: int, *,
         precision: str | None = None, memory_limit: float | None = None,
         tp_across_nodes: bool = False, top: int = 10, exhaustive: bool = False,
         simulate_top: int | None = None, progress: bool = False,
         micro_batches: list[int] | None = None, zero: list[int] = (0, 1, 2, 3),
         recompute: list[bool] = (False, True), sp: list[bool] = (False, True),
         schedules: list[str] = ("1f1b", "interleaved"), vs: list[int] = (2, 4),
         pp_max: int | None = None, partitions: list[str] = ("layers", "params"),
         selective: list[bool] = (False,), cp: list[int] | None = None,
         ep: list[int] | None = None, fp8: list[bool] = (False,),
         dp_replicate: list[int] = (1,),
         cp_comm: list[str] = ("ring",)) -> tuple[list, list]:
    """``(feasible ranked by predicted step time, pruned with reasons)`` (module docstring).
    ``feasible`` holds the simulated layouts: at least the ``top`` best (``simulate_top``
    is the older name of ``top``), every one with ``exhaustive``. ``progress``: a bar on
    stderr when the search takes over a second. ``selective=(False, True)`` adds the
    engine's selective recomputation (``Layout.recompute = "selective"``; pruned for a
    mixture of experts) and ``fp8=(False, True)`` FP8 linear layers to the space, off by
    default (the engine's FP8 runs with tp = 1 only; its selective recomputation is refused
    on CUDA until checked there).
    ``cp`` / ``ep``: the context / expert-parallel sizes to search (None: every one the
    model allows, ``cp_choices`` / ``ep_choices``). ``dp_replicate``: HSDP's replica counts
    to search with ZeRO 1-3 (each one that divides dp; ZeRO-0 is the same at every split).
    ``cp_comm``: how cp > 1 attention may reach the other ranks (``parallel.cp_comm``; each
    layout with cp > 1 tried with every all-to-all degree of those the heads allow,
    ``cp_a2a_choices``): the ring alone by default, all three from ``shardwise plan``."""
    from tqdm import tqdm

    for what, n in (("world", world), ("global_batch", global_batch)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{what}={n!r}: expected an integer >= 1")
    precision = precision or cluster.precision
    limit = memory_limit or cluster.memory_per_rank(world)
    if simulate_top is not None:
        top = simulate_top
    top = max(1, int(top))
    feasible, pruned = [], []
    modes = _modes(recompute, selective)
    sel_moe = spec.moe and ("selective", False) in modes  # pruned whole, one record
    if sel_moe:
        modes.remove(("selective", False))
    n_sel = 0
    bar = {"file": sys.stderr, "delay": 1.0, "disable": not progress, "leave": False}
    fp8s = tuple(fp8)
    am = MEGATRON if cluster.kernels == "megatron-2021" else None  # as memory_of's
    compiled = cluster.compiled
    groups = list(_space(spec, world, global_batch, micro_batches, schedules, vs, pp_max,
                         cp_choices(spec, world, cp)))
    for c, tp, pp, dp, per, mbs, scheds in tqdm(groups, desc="plan: layouts",
                                                unit="cp x tp x pp", **bar):
        if not per:
            pruned.append(Pruned(Layout(dp, tp, pp, 0, 0, cp=c),
                                 f"global batch {global_batch} is not divisible by dp={dp}"))
            continue
        eps = ep_choices(spec, dp, ep)
        degrees = cp_a2a_choices(spec, c, tp, cp_comm)  # each layout below once per degree
        why = None if degrees else (
            f"cp={c}: ring attention cannot run {spec.name}'s attention (latent attention or "
            "a soft cap) and no all-to-all of parallel.cp_comm "
            f"({', '.join(cp_comm)}) splits its heads" if spec.description is not None
            and not spec.description.ring_attention else
            f"cp={c}: no way of parallel.cp_comm ({', '.join(cp_comm)}) splits the "
            f"{spec.n_head} heads over tp={tp}")
        degrees = degrees or [1]
        k = len(degrees)
        if sel_moe:
            n_sel += k * _count(spec, mbs, scheds, zero, [None], sp, partitions, tp, pp, eps, fp8s)
        first = Layout(dp, tp, pp, mbs[0], per // mbs[0], cp=c) if mbs else None
        why = tp_reason(spec, tp, cluster, tp_across_nodes) or cp_reason(spec, c) or why
        if why:
            n = k * _count(spec, mbs, scheds, zero, modes, sp, partitions, tp, pp, eps, fp8s)
            if n:
                pruned.append(Pruned(first, why, count=n))
            continue
        f8s = fp8s
        if True in fp8s and cluster.fp8_flops is None:  # the whole fp8 half, one record
            n = k * _count(spec, mbs, scheds, zero, modes, sp, partitions, tp, pp, eps, (True,))
            if n:
                pruned.append(Pruned(replace(first, fp8=True), fp8_reason(cluster), count=n))
            f8s = tuple(f for f in fp8s if not f)
        for kind, v in scheds:
            why = chunks_reason(spec, pp, v)
            if why:
                n = k * _count(spec, mbs, [(kind, v)], zero, modes, sp, partitions, tp, pp,
                               eps, f8s)
                if n:
                    pruned.append(Pruned(Layout(dp, tp, pp, mbs[0], per // mbs[0], kind, v,
                                                cp=c), why, count=n))
                continue
            sps = sp if tp > 1 else (False,)
            for cut_by in distinct_cuts(spec, pp, v, partitions):
                # memory first by a bound: the least static bytes of any ZeRO stage, ep and
                # sp of the group, then per micro-batch size the least activations; the
                # layouts left are priced from these same memoised pieces
                base = Layout(dp, tp, pp, mbs[0] if mbs else 0, per // mbs[0] if mbs else 0,
                              kind, v, partition=cut_by, cp=c)
                # sequence parallelism's own reasons (the sequence, experts) read nothing
                # a group's layouts differ in
                sp_why = layout_reason(spec, replace(base, sp=True)) if True in sps else None
                # (not for a ZeRO stage or sp the engine refuses here whatever the rest:
                # _expand prunes those by their reason)
                reps = {z: [r for r in dp_replicate if dp % r == 0] if z else [1]
                        for z in zero}  # HSDP's replica counts
                statics = {(z, e, s, r): held_bytes(spec, dp, tp, pp, v, z, precision, s,
                                                    cut_by, c, e, r, kind)
                           for z in zero for e in eps for s in sps for r in reps[z]
                           if not (z and dp * c == 1 or s and sp_why
                                   or split_backward_refusal(kind, z))}
                least = min((x["total"] for x in statics.values()), default=0.0)
                n_mb = k * _count(spec, [1], [(kind, v)], zero, modes, sp, [cut_by], tp, 1,
                                  eps, f8s)
                if statics and least > limit:
                    if mbs and n_mb:
                        pruned.append(Pruned(base, _needs(least, limit, True), least,
                                             count=n_mb * len(mbs)))
                    continue
                for mb in mbs:
                    m = per // mb
                    at = Layout(dp, tp, pp, mb, m, kind, v, partition=cut_by, cp=c)
                    why = micro_batches_refusal(kind, pp, m, v) if pp > 1 else None
                    if why and kind == "dualpipev":  # its memory walks its lists: none here
                        pruned.append(Pruned(at, why, count=n_mb))
                        continue
                    # memory_of(static=False) of each, without building the layouts
                    acts = {(rc, sel, s): activation_bytes(
                        spec, mb=mb, tp=tp, pp=pp, micro_batches=m, v=v, schedule=kind, sp=s,
                        recompute=rc, precision=precision, partition=cut_by, am=am,
                        selective=sel, cp=c, compiled=compiled)
                        for rc, sel in modes for s in sps}
                    least_act = {s: min(acts[(rc, sel, s)] for rc, sel in modes) for s in sps}
                    if c in degrees and mask_bytes(spec, mb, precision) != (0.0, 0.0):
                        # the all-to-all alone keeps whole sequences' masks (mask_bytes)
                        acts.update({(rc, sel, s, c): activation_bytes(
                            spec, mb=mb, tp=tp, pp=pp, micro_batches=m, v=v, schedule=kind,
                            sp=s, recompute=rc, precision=precision, partition=cut_by, am=am,
                            selective=sel, cp=c, a2a=c, compiled=compiled)
                        for rc, sel in modes for s in sps})
                    if statics and least + min(acts.values()) > limit:
                        need = least + min(acts.values())
                        pruned.append(Pruned(at, _needs(need, limit, True), need, count=n_mb))
                        continue
                    for e in eps:
                        for z, r in ((z, r) for z in zero for r in reps[z]):
                            for f8 in f8s:
                                rep = Layout(dp, tp, pp, mb, m, kind, v, z,
                                             partition=cut_by, cp=c, ep=e, fp8=f8,
                                             dp_replicate=r)
                                _expand(spec, rep, modes, sps, statics, acts, least_act,
                                        sp_why, limit, feasible, pruned, degrees)
    if sel_moe and n_sel:
        pruned.append(Pruned(Layout(world, 1, 1, 0, 0, recompute="selective"), SELECTIVE_MOE,
                             count=n_sel))
    if cluster.cores:  # ranks share cores: the processor-sharing walk, no bound (docstring)
        keep = max(top, 40 if simulate_top is None else simulate_top)
        if len(feasible) > keep and not exhaustive:
            feasible.sort(key=lambda c: quick_estimate(spec, c.layout, cluster, precision))
            feasible = feasible[:keep]
        for c in tqdm(feasible, desc="plan: simulating", unit="layout", **bar):
            c.time = simulate(spec, c.layout, cluster, precision)
        feasible.sort(key=lambda c: (c.time["step"], c.memory["total"]))
        return feasible, pruned
    b = Bounds(spec, cluster, precision)
    # layouts in order of (lower_bound, index), lazily: each enters the heap with its cheap
    # bound (Bounds.cheap <= lower_bound) and gets its lower_bound only when that comes
    # first, so the exact entries leave in the order sorting every lower_bound would give
    # and a layout whose cheap bound is already past the top-th best never needs one
    heap = [(b.cheap(c.layout), i, False) for i, c in enumerate(feasible)]
    heapq.heapify(heap)
    done: list[Candidate] = []
    kth: list[float] = []  # the top best steps so far, as a max-heap (negated)
    with tqdm(desc="plan: simulating", unit="layout", **bar) as pbar:
        while heap:
            lb, i, exact = heapq.heappop(heap)
            if not exact:
                heapq.heappush(heap, (lower_bound(b, feasible[i].layout), i, True))
                continue
            if not exhaustive and len(kth) >= top and lb * (1 - 1e-9) > -kth[0]:
                # every entry left is (bound, index) after (lb, i): its layout's
                # lower_bound is at least its entry's bound, at least lb; each record says
                # its entry's bound (lower_bound, or the cheap one where that sufficed)
                worst = -kth[0]
                for lb2, i2, _ in [(lb, i, exact)] + sorted(heap):
                    pruned.append(Pruned(feasible[i2].layout,
                                         f"at least {lb2:.5g} s per step (a lower bound), "
                                         f"slower than the slowest of the {top} best "
                                         f"({worst:.5g} s)"))
                break
            c = feasible[i]
            c.time = simulate(spec, c.layout, cluster, precision)
            done.append(c)
            heapq.heappush(kth, -c.time["step"])
            if len(kth) > top:
                heapq.heappop(kth)
            pbar.update(1)
            pbar.set_postfix_str(f"bound {lb:.4g} s, {len(kth)}th best {-kth[0]:.4g} s",
                                 refresh=False)
    done.sort(key=lambda c: (c.time["step"], c.memory["total"]))
    return done, pruned


def _expand(spec, rep: Layout, modes, sps, statics, acts, least_act, sp_why, limit,
            feasible, pruned, degrees=(1,)) -> None:
    """The layouts of ``rep`` (a micro-batch size, ZeRO stage, ep, fp8) over recomputation
    modes and sequence parallelism into ``feasible``, or ``pruned`` with a reason (``sp_why``:
    the group's reason against sequence parallelism, or None): one
    record for a reason every one of them has (the engine's rules that read neither
    recomputation nor sp: ``rep`` has neither; memory over the least activations), else
    one each. Each layout once per all-to-all degree of ``degrees`` (``Layout.cp_a2a``;
    ``acts`` keyed with the degree where its masks differ from the ring's)."""
    k = len(degrees)
    if not k:
        return
    why = layout_reason(spec, rep)
    if why:
        pruned.append(Pruned(rep, why, count=k * len(modes) * len(sps)))
        return
    for s in sps:
        if s and sp_why:  # sequence parallelism's own reason (the sequence, experts)
            pruned.append(Pruned(_variant(rep, rep.recompute, True, rep.selective), sp_why,
                                 count=k * len(modes)))
            continue
        st = statics[(rep.zero, rep.ep, s, rep.dp_replicate)]
        least = st["total"] + least_act[s]
        if least > limit:
            pruned.append(Pruned(_variant(rep, rep.recompute, s, rep.selective),
                                 _needs(least, limit, True), least, count=k * len(modes)))
            continue
        for rc, sel in modes:
            lay = _variant(rep, rc, s, sel)
            why = layout_reason(spec, lay)
            if why:
                pruned.append(Pruned(lay, why, count=k))
                continue
            for a2a in degrees:
                one = lay if a2a == 1 else _variant(lay, rc, s, sel, a2a)
                act = acts.get((rc, sel, s, a2a), acts[(rc, sel, s)])
                total = st["total"] + act
                if total > limit:
                    pruned.append(Pruned(one, _needs(total, limit), total))
                    continue
                feasible.append(Candidate(one, {**st, "activations": act, "total": total}))


def _variant(rep: Layout, recompute, sp: bool, selective: bool, cp_a2a: int = 1) -> Layout:
    """``replace(rep, recompute=, sp=, selective=, cp_a2a=)``, built positionally: ``_expand``
    makes ~200,000 of them for a 1T model on 3072 GPUs, and ``dataclasses.replace`` (which
    walks the fields by name) took ~15% of the search (cProfile). Every field is passed
    (``test_planner_search`` checks it against ``replace``)."""
    return Layout(rep.dp, rep.tp, rep.pp, rep.micro_batch_size, rep.micro_batches,
                  rep.schedule, rep.chunks_per_rank, rep.zero, recompute, sp, rep.partition,
                  selective, rep.cp, rep.ep, rep.fp8, rep.dp_replicate, cp_a2a)


def _needs(need: float, limit: float, bound: bool = False) -> str:
    return (f"needs {'at least ' if bound else ''}{need / GiB:.3g} GiB per GPU"
            f"{' (its group: a bound)' if bound else ''}, more than the {limit / GiB:.3g} "
            "GiB it has")


def smallest_need(pruned: list[Pruned]) -> float | None:
    """The least memory per GPU any layout pruned only for memory needs (bytes)."""
    need = [p.need for p in pruned if p.need is not None]
    return min(need) if need else None
