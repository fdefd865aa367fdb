"""Per-layer strategies and what each costs: the collectives it calls, their bytes and time.

A strategy fixes a layer's weight placement and the layouts (``shardwise.apps.cnn.layout``) its
input and output may take:

=============  =======================  ===============  ===============================
strategy       weights                  input -> output  collectives (X in bytes, B batch)
=============  =======================  ===============  ===============================
dp             replicated, gradients    batch -> batch   all-reduce of the gradients,
               summed over ranks                         X = 4 params (step)
replicated     replicated, no sync      full -> full     none (every rank computes the
                                                         whole batch)
column         split by output          full -> feature  all-reduce of the input gradient
               features                                  X = 4 B c_in (backward); from batch:
                                        batch -> feature all-gather + reduce-scatter of
                                                         X = 4 B c_in instead
row            split by input features  feature -> full  all-reduce of the output
                                                         X = 4 B c_out (forward); to batch:
                                        feature -> batch reduce-scatter + all-gather instead,
                                                         and the bias gradient all-reduced
filters        conv split by output     full -> feature  as column, X = 4 B c_in H W (the
               channels (filters)       batch -> feature input map)
channels       conv split by input      feature -> full  as row, X = 4 B c_out H W (the
               channels                 feature -> batch map before pooling)
spatial        conv replicated, its     rows -> rows     halo exchange X = 4 B c_in W (k-1)
               gradients summed                          (forward and backward; a rank sends
                                                         (N-1)/N X on average: the edge
                                                         bands one side), and dp's
                                                         all-reduce X = 4 params (step)
branch         each branch on one rank  batch -> full    input gradient all-reduced
               (an Inception block)     full -> full     (batch: all-gather + reduce-
                                        ... -> batch     scatter), outputs all-gathered
                                                         along the channels (to batch:
                                                         all-to-all both ways instead;
                                                         ``branches``)
=============  =======================  ===============  ===============================

This is seed 000's rule made exact: data parallelism moves the weights (C_in C_out per
layer), tensor parallelism moves activations (B C_in or B C_out). Convolutions take dp,
replicated, filters, channels or spatial (``shardwise.apps.cnn.conv``); fully connected
layers dp, replicated, column or row; an Inception block also takes branch. Layout changes
between layers add an all-gather of the activation (4 B x elements per sample). The bytes
of each row are what ``shardwise.comm``'s accounting measures (a test); ``formula`` names
them.

Times use the alpha-beta model of ``shardwise.comm.cost`` for the ring algorithms the
hybrid runs (Thakur, Rabenseifner & Gropp 2005, section 4; ``b(k)``/``g(k)`` carry the
contention term of that module): ring all-reduce as ``comm.cost.predict("ring")``,
ring all-gather ``(N-1) a(N) + (N-1)/N X b(N)``, ring reduce-scatter that plus
``(N-1)/N X g(N)``. Bytes are those each rank sends: 2(N-1)/N X for an all-reduce,
(N-1)/N X for an all-gather, a reduce-scatter or an all-to-all. Compute is ``3 x forward FLOPs``
(forward + two backward matmuls) at ``flops_per_s`` per rank, divided by N except for
replicated layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.apps.cnn.layout import BATCH, FEATURE, FULL, ROWS
from shardwise.comm import cost as comm_cost
from shardwise.models.cnn import BlockSpec

BRANCH = "branch"  # an Inception block's branches on different ranks (apps.cnn.branches)
STRATEGIES = ("dp", "replicated", "column", "row", "filters", "channels", "spatial", BRANCH)
CONV_ONLY, FC_ONLY = ("filters", "channels", "spatial"), ("column", "row")
INPUTS = {"dp": (BATCH,), "replicated": (FULL,), "column": (BATCH, FULL), "row": (FEATURE,),
          "filters": (BATCH, FULL), "channels": (FEATURE,), "spatial": (ROWS,),
          BRANCH: (BATCH, FULL)}
OUTPUTS = {"dp": (BATCH,), "replicated": (FULL,), "column": (FEATURE,), "row": (FULL, BATCH),
           "filters": (FEATURE,), "channels": (FULL, BATCH), "spatial": (ROWS,),
           BRANCH: (FULL, BATCH)}
ITEMSIZE = 4  # fp32
FLOPS_PER_S = 2e10  # per rank; ~45 GFLOP/s is this machine's fp32 matmul peak per core


@dataclass(frozen=True)
class Collective:
    """One collective of one step: ``nbytes`` is X (the whole vector, as comm records it)."""

    name: str    # all_reduce | all_gather | reduce_scatter | all_to_all | halo
    nbytes: int
    phase: str   # forward | backward | step
    where: str   # layer, or "a -> b" for a layout change
    formula: str = ""  # X in symbols, e.g. "4 B c_in"

    def bytes_sent(self, n: int) -> float:
        """Bytes each rank sends (ring; for a halo exchange, the mean over the ranks)."""
        return (2 if self.name == "all_reduce" else 1) * (n - 1) / n * self.nbytes

    def seconds(self, n: int, prm: comm_cost.LinkParams) -> float:
        """Predicted seconds of this collective over ``n`` ranks with link parameters ``prm``: the
        ring all-reduce's cost model, or (n-1) latency steps and (n-1)/n of the bytes (plus the
        reduction for a reduce-scatter); 0 for one rank."""
        if n == 1:
            return 0.0
        if self.name == "halo":  # both neighbours at once: one round of the interior band's X
            return prm.a(n) + self.nbytes * prm.b(n)
        if self.name == "all_reduce":
            return comm_cost.predict("ring", n, self.nbytes, prm)
        t = (n - 1) * prm.a(n) + (n - 1) / n * self.nbytes * prm.b(n)
        return t + ((n - 1) / n * self.nbytes * prm.g(n) if self.name == "reduce_scatter" else 0.0)


@dataclass(frozen=True)
class LayerPlan:
    """A layer's strategy and the layouts of its input and output; ``placement`` (branch
    only): per rank, the indices of the branches it computes (``place_branches``)."""

    strategy: str
    layout_in: str
    layout_out: str
    placement: tuple[tuple[int, ...], ...] = ()


def place_branches(spec: BlockSpec, n: int) -> tuple[tuple[int, ...], ...]:
    """Per rank, the branches of ``spec`` it computes: longest processing time first (Graham
    1969), i.e. branches by forward FLOPs, largest first (ties: lower index), each to the
    rank with the fewest FLOPs so far (ties: lower rank). More branches than ranks: several
    share a rank; fewer: the last ranks get none (they hold none of the block's weights and
    wait for the gather). The step's compute is the busiest rank's (within 4/3 of the best
    assignment's)."""
    load, out = [0] * n, [[] for _ in range(n)]
    for j in sorted(range(len(spec.branches)), key=lambda j: (-spec.branches[j].flops, j)):
        r = min(range(n), key=lambda r: (load[r], r))
        load[r] += spec.branches[j].flops
        out[r].append(j)
    return tuple(tuple(sorted(m)) for m in out)


def layer_plan(spec: BlockSpec, strategy: str, layout_in: str, layout_out: str,
               n: int) -> LayerPlan:
    """``LayerPlan`` of ``spec`` on ``n`` ranks (with its branch placement for ``branch``)."""
    return LayerPlan(strategy, layout_in, layout_out,
                     place_branches(spec, n) if strategy == BRANCH else ())


def _side(spec: BlockSpec) -> int:
    """A convolution's input height (= width) in pixels."""
    return math.isqrt(spec.in_elems // spec.c_in)


def _refusal(spec: BlockSpec, strategy: str, n: int) -> str | None:
    """Why ``strategy`` cannot run ``spec`` on ``n`` ranks (None if it can)."""
    if strategy not in STRATEGIES:
        return f"expected one of {', '.join(STRATEGIES)}"
    if strategy in FC_ONLY and spec.kind != "fc":
        return ("tensor parallelism splits fully connected layers only; convolutions take "
                f"dp, replicated, {', '.join(CONV_ONLY)}")
    if strategy in CONV_ONLY and spec.kind != "conv":
        return (f"{strategy} splits convolutions only; fully connected layers take dp, "
                "replicated, column or row")
    if strategy == BRANCH and not spec.branches:
        return ("only a block with branches (an Inception block, cnn.inception) places "
                "branches on ranks")
    if strategy == BRANCH and n < 2:
        return "needs cnn.ranks >= 2"
    width, what = {"column": (spec.c_out, "output width"), "row": (spec.c_in, "input width"),
                   "filters": (spec.c_out, "output channels"),
                   "channels": (spec.c_in, "input channels")}.get(strategy, (0, ""))
    if what and width % n:
        return f"{what} {width} is not divisible by cnn.ranks={n}"
    if strategy == "spatial":
        side, halo = _side(spec), spec.kernel // 2
        if side % (2 * n):  # each band pools 2x2 on its own
            return (f"{side} rows do not split into {n} bands of an even height "
                    f"(cnn.ranks={n}, 2x2 pooling after)")
        if halo > side // n:
            return f"a halo of {halo} rows is taller than a band of {side // n} rows"
    return None


def allowed(spec: BlockSpec, n: int) -> list[str]:
    """The strategies ``spec`` can take on ``n`` ranks (widths must divide)."""
    if n == 1:
        return ["dp", "replicated"]
    return [s for s in STRATEGIES if _refusal(spec, s, n) is None]


def check_strategy(spec: BlockSpec, strategy: str, n: int) -> None:
    """ValueError (one line naming the layer) if ``strategy`` cannot run ``spec`` on n ranks."""
    why = _refusal(spec, strategy, n)
    if why is not None:
        shown = strategy if strategy in STRATEGIES else repr(strategy)
        raise ValueError(f"cnn.plan: {spec.name}={shown}: {why}")


def layer_collectives(spec: BlockSpec, lp: LayerPlan, batch: int,
                      input_grad: bool = True) -> list[Collective]:
    """The collectives of layer ``spec`` under ``lp`` in one step of ``batch`` samples.
    ``input_grad=False`` (the first layer: the images need no gradient): without those
    that carry only the input's gradient (autograd never runs them)."""
    out = _layer_collectives(spec, lp, batch)
    if input_grad:
        return out
    # their backward collectives are all the input's gradient (row's and channels' are the
    # output's, which the weights' gradients need)
    if lp.strategy in ("column", "filters", "spatial"):
        return [c for c in out if c.phase != "backward"]
    return out


def _layer_collectives(spec: BlockSpec, lp: LayerPlan, batch: int) -> list[Collective]:
    x_in, x_out = ITEMSIZE * batch * spec.in_elems, ITEMSIZE * batch * spec.out_elems
    s, w = lp.strategy, spec.name
    conv = spec.kind == "conv"
    if conv:  # the map before pooling: c_out channels of the input's H x W (padding k // 2)
        x_out = ITEMSIZE * batch * spec.c_out * (spec.in_elems // spec.c_in)
    f_in, f_out = ("4 B c_in H W", "4 B c_out H W") if conv else ("4 B c_in", "4 B c_out")
    if s == "dp":
        return [Collective("all_reduce", ITEMSIZE * spec.params, "step", w, "4 params")]
    if s == "spatial":
        halo = ITEMSIZE * batch * spec.c_in * _side(spec) * (spec.kernel - 1)
        return [Collective("halo", halo, "forward", w, "4 B c_in W (k-1)"),
                Collective("halo", halo, "backward", w, "4 B c_in W (k-1)"),
                Collective("all_reduce", ITEMSIZE * spec.params, "step", w, "4 params")]
    if s in ("column", "filters") and lp.layout_in == BATCH:
        return [Collective("all_gather", x_in, "forward", w, f_in),
                Collective("reduce_scatter", x_in, "backward", w, f_in)]
    if s in ("column", "filters"):
        return [Collective("all_reduce", x_in, "backward", w, f_in)]
    if s in ("row", "channels") and lp.layout_out == BATCH:  # the bias sees only my rows
        return [Collective("reduce_scatter", x_out, "forward", w, f_out),
                Collective("all_gather", x_out, "backward", w, f_out),
                Collective("all_reduce", ITEMSIZE * spec.c_out, "step", w, "4 c_out")]
    if s in ("row", "channels"):
        return [Collective("all_reduce", x_out, "forward", w, f_out)]
    if s == BRANCH:  # formula: apps.cnn.branches; the gather's parts padded to c_max
        side2 = spec.out_elems // spec.c_out
        c_max = max(sum(spec.branches[j].c_out for j in m) for m in lp.placement)
        part = ITEMSIZE * batch * c_max * side2              # one rank's padded maps
        f_part = "4 B c_max H W"
        entry = ([Collective("all_gather", x_in, "forward", w, "4 B c_in H W"),
                  Collective("reduce_scatter", x_in, "backward", w, "4 B c_in H W")]
                 if lp.layout_in == BATCH
                 else [Collective("all_reduce", x_in, "backward", w, "4 B c_in H W")])
        if lp.layout_out == BATCH:
            return entry + [Collective("all_to_all", part, "forward", w, f_part),
                            Collective("all_to_all", part, "backward", w, f_part)]
        return entry + [Collective("all_gather", len(lp.placement) * part, "forward", w,
                                   "N " + f_part)]
    return []


def change_collectives(elems: int, src: str, dst: str, batch: int) -> list[Collective]:
    """The collectives of a layout change of a (batch, elems) activation."""
    if src == dst:
        return []
    x, where = ITEMSIZE * batch * elems, f"{src} -> {dst}"
    if FULL not in (src, dst):  # through full
        return (change_collectives(elems, src, FULL, batch)
                + change_collectives(elems, FULL, dst, batch))
    phase = "forward" if dst == FULL else "backward"  # gathers to full; keeps a part forward
    return [Collective("all_gather", x, phase, where, "4 B elems")]


def compute_seconds(spec: BlockSpec, strategy: str, batch: int, n: int,
                    flops_per_s: float = FLOPS_PER_S) -> float:
    """Forward + backward time of the layer on one rank (branch: the busiest rank's
    branches on the whole batch)."""
    if strategy == BRANCH:
        return 3 * batch * max(sum(spec.branches[j].flops for j in m)
                               for m in place_branches(spec, n)) / flops_per_s
    share = 1 if strategy == "replicated" else n
    return 3 * spec.flops * batch / share / flops_per_s
