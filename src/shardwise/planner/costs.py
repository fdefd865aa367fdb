"""The price of one chunk's forward and backward on one micro-batch: compute
(``compute``) and the communication inside it (``comm_price``), composed per block and per
chunk of the engine's cut, with recomputation and ZeRO-3's gathers. The schedule walk
(``schedule_walk``) runs these costs.

Recomputation: full recomputation adds one forward (its collectives again) to every
backward. Korthikanti et al.'s attention-core recomputation (``Layout.selective``, kept for
their published runs) adds the attention core, and under cp its forward ring, to the
backward. The engine's selective recomputation (``Layout.recompute = "selective"``:
matmul and attention outputs kept, the rest of a block recomputed) adds the block's
memory-bound operations but the attention kernel (``compute.recomputed_ops``), no GEMM and
no tp / SP / ep collective (the engine replays them), and under cp one more forward ring
pass of K and V per block, exposed. Each ring pass overlaps the attention compute of its
blocks (forward: the attention core, backward: twice it); only what exceeds it is exposed.
The all-to-alls of ``parallel.cp_comm = "all_to_all"`` / ``"hybrid"`` are exposed whole
(attention waits for them), replayed by the selective recomputation, run again by the full.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from shardwise.planner.comm_price import (
    RingSeconds,
    all_to_all_seconds,
    megatron_send_seconds,
    ring_messages,
    ring_seconds,
    ulysses_seconds,
)
from shardwise.planner.compute import (
    attention_core_ops,
    attention_gemm_flops,
    block_flops,
    block_ops,
    head_seconds,
    op_seconds,
    recomputed_ops,
)
from shardwise.planner.hardware import Cluster
from shardwise.planner.layout import Layout
from shardwise.planner.memory import (
    BYTES,
    chunk_blocks,
    cut,
    padded_vocab,
    rank_expert_params,
    rank_params,
)
from shardwise.planner.specs import ModelSpec


class BlockCosts(NamedTuple):
    """The per-block prices ``chunk_costs`` composes chunks of (``block_costs``); one pass
    of one micro-batch on one rank."""

    tp: float
    """Seconds of a block's tensor-parallel collectives in one pass (forward or backward)."""
    n_sync: int
    """Synchronisations (collectives) of those, a count."""
    embed_tp: float
    """Seconds of the vocabulary-parallel embedding's all-reduce (forward)."""
    loss_tp: float
    """Seconds of the vocabulary-parallel loss's three small all-reduces."""
    block: float
    """Seconds of a block's forward compute."""
    head: float
    """Seconds of the head's forward compute."""
    attention: float
    """Seconds of the attention core's forward (with selective recomputation or cp > 1;
    else 0)."""
    send: float
    """Seconds of a blocking pipeline send (``megatron_send_seconds``; else 0)."""
    cp_forward: float
    """Seconds of the ring's traffic not hidden behind attention, and of the all-to-alls,
    forward."""
    cp_backward: float
    """Seconds of the ring's traffic not hidden behind attention, and of the all-to-alls,
    backward."""
    all_to_all: float
    """Seconds of a block's all-to-alls in one pass (``all_to_all_seconds``)."""
    recomputed: float = 0.0
    """Seconds of what the engine's selective recomputation runs again of a block in
    backward (``recomputed_ops``; ``Layout.recompute = "selective"``)."""
    ring_again: float = 0.0
    """Seconds of the ring's forward pass of K and V run again in that recomputation (cp >
    1), none of it hidden (the attention it overlapped is kept, not recomputed)."""
    attention_backward: float = 0.0
    """Seconds a block's backward spends in the attention kernel beyond twice its forward
    (``OpModel.attn_backward``: measured 3.18 x on the H100, not 2)."""
    frozen_weight_grad: float = 0.0
    """Seconds of a block's weight-gradient GEMMs a LoRA run skips in backward (``spec.lora``:
    the base frozen, so of backward's two GEMMs a linear layer's input gradient only: one
    forward of its linear GEMMs, the attention core's not among them; else 0)."""
    frozen_head_grad: float = 0.0
    """The same for the head's GEMM (its weight frozen under LoRA; else 0)."""
    host: float = 0.0
    """Host seconds of one micro-batch on a rank beyond its layers' priced work
    (``Cluster.micro_batch_s``, measured on local; 0 elsewhere), charged to the forward of
    each of a rank's chunks in equal parts."""
    message: float = 0.0
    """Host seconds of one pipeline send or receive (local: half a cp ring message's,
    ``Cluster.ring_message_s``: a ring step sends and receives; 0 elsewhere and at pp = 1),
    charged to the op that makes it."""


class ChunkCost(NamedTuple):
    """One chunk's seconds for one micro-batch (``chunk_costs``); the tp, wait, cp, ep and
    pp seconds are parts of ``forward`` / ``backward``."""

    forward: float
    """Seconds of its forward: compute, collectives and waiting."""
    backward: float
    """Seconds of its backward (with any recomputation)."""
    tp_forward: float
    """Seconds of communication inside the forward (tp, cp, ep, a blocking send) and its
    waiting."""
    tp_backward: float
    """Seconds of communication inside the backward, and its waiting."""
    wait_forward: float
    """Seconds of the forward spent off the core: ZeRO-3's exposed collectives
    (``_with_zero3``)."""
    wait_backward: float
    """Seconds of the backward spent off the core (as ``wait_forward``)."""
    cp: float
    """Seconds of exposed ring traffic, forward + backward."""
    ep: float
    """Seconds of all-to-alls, forward + backward."""
    pp: float
    """Seconds of blocking pipeline sends, forward + backward."""
    dp: float = 0.0
    """Seconds of ZeRO-3's exposed gathers and reduce-scatters, forward + backward
    (``zero3_seconds``; 0 for ZeRO 0-2)."""


class Zero3Seconds(NamedTuple):
    """Seconds ZeRO-3's collectives add to one micro-batch's forward and backward on one
    pipeline rank (``zero3_seconds``), after what overlaps its compute."""

    forward: float
    """Seconds added to the forward: its gathers not hidden behind compute."""
    backward: float
    """Seconds added to the backward: its gathers again and its reduce-scatters."""


def block_costs(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str,
                dedicated: bool = False) -> BlockCosts:
    """The per-block prices ``chunk_costs`` composes chunks of (``BlockCosts``: tp seconds
    of a block, its synchronisations, the embedding's and the loss's tp seconds, a block's
    and the head's forward compute, the attention core's, a blocking send, the ring's
    exposed forward and backward, a block's all-to-alls). Mixed dense and
    mixture blocks (``ModelSpec.mixed``): the mean block's, each price the kinds' weighted
    by their share of the blocks (a chunk's sum is then exact when it holds that share)."""
    if spec.mixed:
        m = spec.moe_share
        a, b = (block_costs(spec.part(k), lay, cluster, precision, dedicated)
                for k in ("moe", "dense"))
        return BlockCosts(*(m * x + (1 - m) * y for x, y in zip(a, b)))
    world = 1 if dedicated else lay.world
    rate, over = cluster.rate(world), cluster.rank_overhead(world)
    e, s, h = BYTES[precision], spec.block_size // lay.cp, spec.n_embd
    tl = cluster.link(lay.tp)
    act = lay.micro_batch_size * s * h * e
    if lay.tp == 1:
        tp_blk, n_sync = 0.0, 0
    elif lay.sp:
        tp_blk, n_sync = 2 * (tl.all_gather(lay.tp, act) + tl.reduce_scatter(lay.tp, act)), 4
    else:  # a mixture's experts all-reduce their k results per token (under SP its region
        # reduce-scatters the weighted sum once, as a dense MLP: docs/moe.md)
        mlp = act * (spec.top_k if spec.moe else 1)
        tp_blk = tl.all_reduce(lay.tp, act, tp=True) + tl.all_reduce(lay.tp, mlp, tp=True)
        n_sync = 2
    # ranks sharing cores: the tp collectives are CPU work (Cluster.comm_stretch), priced
    # as on a core of their own where the shared walk stretches them as it does compute
    cs = (cluster.core_share(lay.tp) if dedicated
          else cluster.comm_stretch(lay.tp, lay.world))
    tp_blk *= cs
    bf = block_flops(spec, lay.micro_batch_size, lay.cp) / lay.tp
    fp8 = lay.fp8 and cluster.fp8_flops is not None
    head_f = 2 * lay.micro_batch_size * s * h * padded_vocab(spec.vocab_size, lay.tp) / lay.tp
    # vocab-parallel embedding: one all-reduce forward; vocab-parallel loss: three small ones
    emb_tp = cs * tl.all_reduce(lay.tp, act, tp=True) if lay.tp > 1 else 0.0
    loss_tp = (cs * 3 * tl.all_reduce(lay.tp, lay.micro_batch_size * s * 4, tp=True)
               if lay.tp > 1 else 0.0)
    core_f = attention_gemm_flops(spec, lay.micro_batch_size, lay.cp) / lay.tp
    attn_b = 0.0
    if cluster.ops is not None:  # per operation (hardware.OpModel)
        ops = block_ops(spec, lay.micro_batch_size, lay.tp, lay.sp, cluster.kernels, e,
                        lay.cp, lay.ep)
        blk_s = op_seconds(cluster, ops, fp8)
        head_s = head_seconds(spec, lay.micro_batch_size, lay.tp, cluster, e, lay.cp)
        if fp8 and cluster.ops.fp8_cast_bytes:  # torchao's casts and amax reductions:
            # bytes per value of every linear layer's input and output (hardware.FP8_CAST)
            T = lay.micro_batch_size * s
            blk_s += cluster.ops.memory(cluster.ops.fp8_cast_bytes * T
                                        * linear_widths(spec) / lay.tp)
        if cluster.ops.attn_backward != 2.0:  # the fused kernel's backward, measured; the
            # attention core's GEMMs are gemms[1:3] (attention_core_ops')
            attn_b = (cluster.ops.attn_backward - 2.0) * sum(
                cluster.ops.gemm(x) for x in ops.gemms[1:3])
    elif fp8:  # the linear layers at twice the rate
        blk_s = (bf - core_f) / (rate * cluster.fp8_flops / cluster.flops) + core_f / rate + over
        head_s = head_f / rate
    else:
        blk_s, head_s = bf / rate + over, head_f / rate
    frozen_b = frozen_h = 0.0
    if spec.lora:  # the base's weight gradients are not computed (adapters: negligible)
        if cluster.ops is not None:
            frozen_b = sum(cluster.ops.gemm(x, fp8) for i, x in enumerate(ops.gemms)
                           if i not in (1, 2))
            frozen_h = cluster.ops.gemm(head_f)
        else:
            frozen_b = (bf - core_f) / (rate * (cluster.fp8_flops / cluster.flops if fp8 else 1))
            frozen_h = head_f / rate
    attn_s = 0.0
    if lay.selective or lay.cp > 1:
        if cluster.ops is not None:
            attn_s = op_seconds(cluster, attention_core_ops(spec, lay.micro_batch_size, lay.tp,
                                                            cluster.kernels, e, lay.cp))
        else:
            attn_s = core_f / rate
    redo = recomputed_ops(spec, lay.micro_batch_size, lay.tp, lay.sp, cluster.kernels, e,
                          lay.cp)
    if cluster.ops is not None:
        redo_s = op_seconds(cluster, redo)
    else:  # the fixed / measured model has no memory-bound kernels of its own: their bytes
        # at the device's (a core's, shared as the matmuls are) bandwidth, and one more pass
        # of the fixed per-block overhead
        redo_s = sum(redo.moves) / cluster.mem_bw * (cluster.flops * cluster.efficiency
                                                      / rate) + over
    send = megatron_send_seconds(spec, lay, cluster, e)
    ring = ring_seconds(spec, lay, cluster, e)
    heads = ulysses_seconds(spec, lay, cluster, e)  # all-to-alls: exposed, each pass
    if cluster.ring_message_s:  # local: each message's seconds as measured (the probe's
        # cp step less its dp step: the transfer and the host's work, which nothing hides)
        ring = RingSeconds(*(x * cluster.ring_message_s for x in ring_messages(spec, lay)))
        cp_f, cp_b = ring.forward + heads, ring.backward + heads
    else:  # the ring's transfers overlapped with the attention
        cp_f = max(0.0, ring.forward - attn_s) + heads
        cp_b = max(0.0, ring.backward - 2 * attn_s) + heads
    a2a = all_to_all_seconds(spec, lay, cluster, e)
    return BlockCosts(tp=tp_blk, n_sync=n_sync, embed_tp=emb_tp, loss_tp=loss_tp,
                      block=blk_s, head=head_s, attention=attn_s, send=send,
                      cp_forward=cp_f, cp_backward=cp_b, all_to_all=a2a,
                      recomputed=redo_s, ring_again=ring.forward, attention_backward=attn_b,
                      frozen_weight_grad=frozen_b, frozen_head_grad=frozen_h,
                      host=cluster.micro_batch_s * (
                          1.0 if dedicated else cluster.sharing(lay.world)),
                      message=cluster.ring_message_s / 2 if lay.pp > 1 else 0.0)


def linear_widths(spec: ModelSpec) -> float:
    """Per token, the input and output widths of a block's linear layers summed (Q K V, the
    output projection, the MLP's matrices; a mixture's experts at top-k): the values an FP8
    recipe casts (``hardware.FP8_CAST``)."""
    h, att, f = spec.n_embd, spec.attn_width, spec.ffn
    kv = 2 * spec.kv_heads * (att // spec.n_head)
    if spec.moe:
        f = spec.top_k * spec.expert_ffn + spec.moe_shared_ffn
    mlp = (3 if spec.gated else 2) * (h + f)
    return (h + att + kv) + (att + h) + mlp


def chunk_costs(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str,
                dedicated: bool = False, memo: dict | None = None) -> list[ChunkCost]:
    """Per global chunk, a ``ChunkCost``: (forward s, backward s, tp s in forward, tp s in
    backward, waiting s in forward, waiting s in backward, cp s, ep s, blocking pp s),
    seconds of one micro-batch. Waiting: ZeRO-3's exposed collectives, spent off the core.
    ``dedicated``:
    compute as if the rank had a core to itself (the shared walk slows it down). cp, ep and
    pp: the exposed ring, all-to-all and blocking-send seconds of the chunk, forward +
    backward, counted in the tp columns too (communication inside compute; ``simulate``
    splits them out). ``memo``: a dict kept by the caller for one search, holding the
    per-block prices (``block_costs``) of layouts that differ only in their chunks."""
    blk = _block_prices(spec, lay, cluster, precision, dedicated, memo)
    chunks = chunk_blocks(spec, lay.pp * lay.chunks_per_rank, lay.partition)
    out = []
    seen: dict = {}
    for c, (nb, head) in enumerate(chunks):
        shape = (nb, head, c == 0)  # the first chunk holds the embedding
        cc = seen.get(shape)  # the same arithmetic as the chunk priced before
        if cc is None:
            cc = seen[shape] = _chunk_cost(blk, lay, *shape)
        out.append(cc)
    if lay.zero == 3:  # each chunk's units gathered around every micro-batch's ops on it
        part = cut(spec, lay.pp * lay.chunks_per_rank, lay.partition)
        if memo is None and spec.description is not None:  # a described model's layers
            # may differ in size: price each chunk on its own layers
            return [_with_zero3(c, zero3_seconds(spec, lay, cluster, precision,
                                                 list(part.layers(i))))
                    for i, c in enumerate(out)]
        # else ZeRO-3's price of a chunk reads only its shape (blocks, head, embedding:
        # zero3_seconds' memo key, or a named size's closed-form parameter counts), so it
        # is priced once per shape, on the first chunk of that shape
        priced: dict = {}
        for i, (nb, head) in enumerate(chunks):
            shape = (nb, head, i == 0)
            if shape not in priced:
                priced[shape] = _with_zero3(out[i], zero3_seconds(
                    spec, lay, cluster, precision, list(part.layers(i)), memo))
        out = [priced[(nb, head, i == 0)] for i, (nb, head) in enumerate(chunks)]
    return out


def _block_prices(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str,
                  dedicated: bool, memo: dict | None) -> BlockCosts:
    """``block_costs``, memoised in ``memo`` (when given) by what it reads of ``lay``: on a
    GPU preset pp only through the links a blocking send and the experts' all-to-all cross
    (``cluster.link`` of their spans), so layouts of other pp share one price."""
    key = (lay.world if cluster.cores else 0, lay.tp, _pp_key(lay, cluster),
           lay.micro_batch_size, lay.sp, lay.cp, lay.cp_a2a, lay.ep, lay.fp8, lay.selective,
           dedicated)
    blk = None if memo is None else memo.get(key)
    if blk is None:
        blk = block_costs(spec, lay, cluster, precision, dedicated)
        if memo is not None:
            memo[key] = blk
    return blk


def _pp_key(lay: Layout, cluster: Cluster):
    """What ``block_costs`` reads of ``lay.pp``: all of it with cores (``local``), else the
    links of ``megatron_send_seconds``' span (tp cp pp) and ``all_to_all_seconds``' (ep pp
    cp tp): whether each stays in a node, as ``Cluster.link`` picks intra or inter."""
    if cluster.cores:
        return lay.pp
    span, g = lay.tp * lay.cp * lay.pp, cluster.gpus_per_node
    return span <= g, lay.ep * span <= g


def _chunk_cost(blk: BlockCosts, lay: Layout, nb: int, head: bool, emb: bool) -> ChunkCost:
    """``chunk_costs``' price of one chunk of ``nb`` blocks, with the head and the embedding
    or not (without ZeRO-3: ``_with_zero3``), from the per-block prices ``blk``."""
    tp_blk, n_sync = blk.tp, blk.n_sync
    emb_tp, loss_tp, blk_s, head_s = blk.embed_tp, blk.loss_tp, blk.block, blk.head
    attn_s, send, a2a = blk.attention, blk.send, blk.all_to_all
    cp_f, cp_b = blk.cp_forward, blk.cp_backward
    comp_f = nb * blk_s + (head_s if head else 0.0)
    cpf, epf = nb * cp_f, nb * a2a
    tpf = nb * tp_blk + (emb_tp if emb else 0.0) + (loss_tp if head else 0.0) + cpf + epf
    wait_f = wait_b = 0.0  # off the core: ZeRO-3's, added by _with_zero3
    cpb, epb = nb * cp_b, nb * a2a
    tpb = nb * tp_blk + (loss_tp if head else 0.0) + cpb + epb  # backward: the block's
    comp_b = (2 * comp_f + nb * blk.attention_backward
              - nb * blk.frozen_weight_grad - (blk.frozen_head_grad if head else 0.0))
    if lay.recompute == "selective":  # the engine's: the block's memory-bound ops again,
        # its collectives replayed (nothing moved), but under cp its ring passes K and V
        # again (parallel.context.ring_comm runs the shifts again), none of it hidden
        comp_b += nb * blk.recomputed
        again = nb * blk.ring_again
        cpb, tpb = cpb + again, tpb + again
    elif lay.recompute == "full":  # the engine's per block: every block's forward again, its
        # collectives replayed, the cp ring's shifts again
        comp_b += comp_f
        cpb += nb * blk.ring_again
    elif lay.recompute:
        comp_b += comp_f
        tpb += tpf
        wait_b += wait_f
        cpb, epb = cpb + cpf, epb + epf
    elif lay.selective:  # the attention core's forward again: no tp collective in it, but
        # under cp its ring passes K and V again (the engine's recomputation runs the shifts
        # again too, rather than keeping cp - 1 blocks: parallel.context.ring_comm)
        comp_b += nb * attn_s
        cpb, tpb = cpb + cpf, tpb + cpf
    # a blocking send (Megatron-LM 2021): the activation on, unless the head is here;
    # the gradient back, unless the embedding is
    ppf, ppb = (0.0 if head else send), (0.0 if emb else send)
    tpf, tpb = tpf + ppf, tpb + ppb
    if blk.host:  # the executor's own seconds (local), with the forward
        comp_f += blk.host / lay.chunks_per_rank
    if blk.message:  # local: a chunk receives its input unless it embeds and sends its
        # output unless it has the head; backward the gradients the other way
        n_msg = (not emb) + (not head)
        comp_f, comp_b = comp_f + n_msg * blk.message, comp_b + n_msg * blk.message
    return ChunkCost(comp_f + tpf + wait_f, comp_b + tpb + wait_b, tpf + wait_f,
                     tpb + wait_b, wait_f, wait_b, cpf + cpb, epf + epb, ppf + ppb)


def model_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str,
                  memo: dict | None = None) -> float:
    """Forward + backward seconds of one micro-batch through every layer of the model, priced
    as one chunk holding them all (``_chunk_cost``): the sum of ``chunk_costs``' forward +
    backward over any cut of ``lay`` (every term is linear in the blocks, the embedding and
    the head are each in one chunk; equal to rounding) less the parts a cut adds, none
    negative: blocking sends between chunks and ZeRO-3's gathers. A lower bound's brick
    (``search.Bounds.cheap``). ``memo``: ``chunk_costs``' dict for one search, keyed here by
    what the answer reads of ``lay``."""
    key = ("model", lay.world if cluster.cores else 0, lay.tp, _pp_key(lay, cluster),
           lay.micro_batch_size, lay.sp, lay.cp, lay.cp_a2a, lay.ep, lay.fp8, lay.selective,
           lay.recompute)
    out = None if memo is None else memo.get(key)
    if out is None:
        blk = _block_prices(spec, lay, cluster, precision, False, memo)
        c = _chunk_cost(blk, lay, spec.n_layer, True, True)
        out = c.forward + c.backward
        if memo is not None:
            memo[key] = out
    return out


def _with_zero3(c: ChunkCost, z: Zero3Seconds) -> ChunkCost:
    """``c`` with ZeRO-3's exposed seconds inside its forward and backward (communication
    inside compute: the walk delays whatever waits on this chunk by them), spent off the
    core (``walk_shared`` does not slow them down by core sharing,
    as the step's ZeRO-3 seconds were priced before they moved into the chunks)."""
    return c._replace(forward=c.forward + z.forward, backward=c.backward + z.backward,
                      tp_forward=c.tp_forward + z.forward, tp_backward=c.tp_backward + z.backward,
                      wait_forward=c.wait_forward + z.forward,
                      wait_backward=c.wait_backward + z.backward, dp=z.forward + z.backward)


def unit_forward_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster,
                         precision: str, memo: dict | None = None) -> dict:
    """Forward seconds of one micro-batch through one layer of each kind (its compute and
    tensor-parallel collectives, as ``chunk_costs`` prices them): ``embed``, ``block``,
    ``head``. ``memo``: ``chunk_costs``' dict for one search (one spec, cluster and
    precision), keyed here by what the answer depends on."""
    key = ("unit_forward", lay.tp, lay.micro_batch_size, lay.sp, lay.cp, lay.cp_a2a, lay.fp8)
    if memo is not None and key in memo:
        return memo[key]
    one = Layout(1, lay.tp, 1, lay.micro_batch_size, 1, sp=lay.sp, cp=lay.cp, fp8=lay.fp8,
                 cp_a2a=lay.cp_a2a)
    c = chunk_costs(replace(spec, n_layer=1), one, cluster, precision)[0]
    blk = chunk_costs(replace(spec, n_layer=2), one, cluster, precision)[0].forward - c.forward
    e = BYTES[precision]
    act = lay.micro_batch_size * spec.block_size // lay.cp * spec.n_embd * e
    emb = cluster.link(lay.tp).all_reduce(lay.tp, act, tp=True) if lay.tp > 1 else 0.0
    out = {"embed": emb, "block": blk, "head": c.forward - blk - emb}
    if memo is not None:
        memo[key] = out
    return out


def zero3_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str,
                  layers: list[int], memo: dict | None = None) -> Zero3Seconds:
    """``Zero3Seconds(forward, backward)``: seconds ZeRO-3's collectives add to one
    micro-batch's forward and backward of a chunk holding ``layers`` (a pipeline stage, or
    with the interleaved schedule one of a rank's v chunks, each a ``ZeroStage3`` of its
    own, gathered and reduce-scattered around its own ops alone), over dp x cp ranks on the
    link ``lay.world`` ranks span (zero when ``lay.zero`` is not 3 or dp x cp = 1).
    ``parallel.zero.stage3`` gathers a rank's units for every micro-batch's forward and
    again for its backward and reduce-scatters every backward, pipeline or not, so this is
    charged per micro-batch per op (``chunk_costs`` adds it to the chunk's forward and
    backward: the walk delays the stages waiting on it, the pipeline's fill and drain
    included).

    With the engine's overlap (``Cluster.zero3_overlap``, ranks with a device each): each
    unit (a layer; gather g_i, reduce-scatter r_i, forward compute c_i, backward b_i = 2 c_i,
    3 c_i with recomputation) is all-gathered before it runs, the next unit's gather launched
    as it starts (prefetch), so the forward exposes g_0 + sum_{i>=1} max(0, g_i - c_{i-1});
    the backward the last unit's gather again (g_k: freed after forward), then during unit
    j's backward unit j-1's gather and unit j+1's reduce-scatter (one stream): sum_j max(0,
    g_{j-1} + r_{j+1} - b_j), and the first unit's scatter r_0, waited for at the end of the
    backward. The engine prefetches only within an op (the first unit's gather is launched
    by the op's own first hook), so every op pays its exposed part, in the steady state
    and in the pipeline's fill and drain alike, and none hides in the bubble.

    Without overlap (``zero3_overlap=False``): the rank's parameters x all-gathered whole
    per pass and reduce-scattered per backward: forward g(x), backward g(x) + r(x). Ranks
    sharing cores (local): each unit's own calls, stretched as CPU work shared with the
    other ranks (``Cluster.comm_stretch`` k): forward k sum_i g(x_i), backward k sum_i
    (g(x_i) + r(x_i)). ``memo``: ``chunk_costs``' dict for one search (a search prices
    hundreds of thousands of ZeRO-3 layouts that share these answers).

    With expert parallelism (``lay.ep > 1``: ``ZeroStage3(expert_group=)``) a block is two
    units, its dense parameters (gathered and reduce-scattered over n = dp x cp) and this
    rank's E / ep experts (over n_x = dp / ep x cp, the ranks holding the same experts,
    nothing to move where n_x = 1), run back to back on the one stream: g_i = g_n(dense_i) +
    g_{n_x}(experts_i), r_i = r_n(dense_i) + r_{n_x}(experts_i) in the formulas above, and
    without overlap g_n(dense) + g_{n_x}(experts) (likewise r) with u counting two units per
    block."""
    n = lay.dp // lay.dp_replicate * lay.cp  # HSDP: one replica's shard group
    if lay.zero != 3 or n == 1:
        return Zero3Seconds(0.0, 0.0)
    # the answer depends on the layers only through their kinds: a chunk's layers are
    # consecutive, the embedding (0) first and the head (L + 1) last where it holds them
    emb, head = layers[0] == 0, layers[-1] == spec.n_layer + 1
    key = ("zero3", lay.dp, lay.cp, lay.cp_a2a, lay.tp, lay.pp, lay.ep, lay.micro_batch_size,
           lay.sp, lay.fp8, lay.recompute, emb, len(layers) - emb - head, head, lay.dp_replicate)
    if memo is not None and key in memo:
        return memo[key]
    out = _zero3_seconds(spec, lay, cluster, precision, layers, n, memo)
    if memo is not None:
        memo[key] = out
    return out


def _zero3_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str,
                   layers: list[int], n: int, memo: dict | None) -> Zero3Seconds:
    e, L = BYTES[precision], spec.n_layer
    link = cluster.link(lay.world // lay.dp_replicate)  # HSDP: a replica's links
    nx = lay.dp // lay.ep * lay.cp  # the ranks holding the same experts (ep_dp x cp)

    def parts(ls: list[int]) -> tuple[float, float]:
        """Bytes of the dense and the expert units of ``ls`` (experts a unit apart: ep > 1)."""
        X = rank_expert_params(spec, ls, lay.tp, lay.ep) if lay.ep > 1 else 0
        return (rank_params(spec, ls, lay.tp, lay.pp, lay.ep) - X) * e, X * e

    def gather(d: float, x: float) -> float:
        return link.all_gather(n, d) + link.all_gather(nx, x)

    def scatter(d: float, x: float) -> float:
        return link.reduce_scatter(n, d) + link.reduce_scatter(nx, x)

    if not cluster.zero3_overlap or cluster.cores:
        if not cluster.cores:
            d, x = parts(layers)
            return Zero3Seconds(gather(d, x), gather(d, x) + scatter(d, x))
        # ranks sharing cores (local): each unit is gathered and reduce-scattered by calls
        # of its own, latencies and all (the engine's ZeroStage3 hooks), stretched as CPU
        # work shared with the other ranks (Cluster.comm_stretch)
        each = [parts([i]) for i in layers]
        st = cluster.comm_stretch(n, lay.world)
        g = st * sum(gather(*u) for u in each)
        return Zero3Seconds(g, g + st * sum(scatter(*u) for u in each))
    fwd = unit_forward_seconds(spec, lay, cluster, precision, memo)
    # the layers are consecutive: the embedding first, the head last where they are here
    emb, head = layers[0] == 0, layers[-1] == L + 1
    nb = len(layers) - emb - head
    # a layer of each kind (every block is alike; the last block stands for them)
    one = {**({"embed": 0} if emb else {}), **({"block": layers[-1 - head]} if nb else {}),
           **({"head": L + 1} if head else {})}
    x = {k: parts([i]) for k, i in one.items()}
    gk = {k: gather(*v) for k, v in x.items()}
    rk = {k: scatter(*v) for k, v in x.items()}
    mult = 3 if lay.recompute in (True, "full") else 2  # selective's recomputed ops: not counted
    # a block between two blocks adds the same terms: sum the sequence with three blocks
    # (its ends, and one such middle block) and the other middle blocks in one product
    middle = max(0, nb - 3)
    kind = ["embed"] * emb + ["block"] * min(nb, 3) + ["head"] * head
    g, r, c = [gk[k] for k in kind], [rk[k] for k in kind], [fwd[k] for k in kind]
    b = [mult * x for x in c]
    forward = g[0] + sum(max(0.0, g[i] - c[i - 1]) for i in range(1, len(kind)))
    k = len(kind) - 1
    backward = g[k]  # the last unit, freed after forward, gathered again for backward
    for j in range(k, -1, -1):  # during unit j's backward: unit j-1's gather, j+1's scatter
        comm = (g[j - 1] if j >= 1 else 0.0) + (r[j + 1] if j + 1 <= k else 0.0)
        backward += max(0.0, comm - b[j])
    if middle:
        forward += middle * max(0.0, gk["block"] - fwd["block"])
        backward += middle * max(0.0, gk["block"] + rk["block"] - mult * fwd["block"])
    backward += r[0]  # the first unit's scatter, at the end
    # what prefetch cannot hide on a GPU, over NVLink (hardware.ZERO3_EXPOSED: llm-foundry's
    # run); across nodes the NIC moves the bytes and prefetch hides them
    share = cluster.zero3_exposed if lay.world // lay.dp_replicate <= cluster.gpus_per_node \
        else 0.0
    if share:
        gs = sum(g) + (middle * gk["block"] if middle else 0.0)
        rs = sum(r) + (middle * rk["block"] if middle else 0.0)
        forward, backward = max(forward, share * gs), max(backward, share * (gs + rs))
    return Zero3Seconds(forward, backward)
