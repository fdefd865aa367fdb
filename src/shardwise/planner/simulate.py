"""Step time of one layout, by walking the pipeline schedule's instruction lists.

The simulator runs ``pipeline.schedules.schedule(kind, p, m, v).ranks`` -- the lists the
executor runs -- on a model of the machine: each rank runs its list in order; a
``Forward``/``Backward`` starts when the rank is free and its input (the previous chunk's
activation, the next chunk's gradient) has arrived, and lasts its compute time plus its
tensor-parallel collectives; a ``Send*`` posts the tensor on the rank's communication thread
(one message at a time), to arrive after ``Link.p2p``; a ``Recv*`` costs nothing (the
executor posts receives without waiting; the compute that needs the tensor waits).
After the flush, the data-parallel gradient sync (ZeRO-0 all-reduce, ZeRO-1/2
reduce-scatter + parameter all-gather; ZeRO-3's gathers and reduce-scatters are inside every
micro-batch's forward and backward, pipeline or not: ``zero3_seconds``) and the optimizer
run; the step ends when the slowest rank is done (the global norm is one
collective over all ranks).

Compute: forward FLOPs per block and micro-batch of b sequences 24 b s h^2 + 4 b s^2 h
(Narayanan et al. 2021, sec. 5.1), the LM head 2 b s h V; backward twice the forward;
recomputation adds one forward; all divided by tp; seconds = FLOPs / (peak x efficiency)
+ a fixed overhead per block pass. Tensor parallelism: per block two all-reduces of b s h e
bytes forward and two backward (Shoeybi et al. 2019), or with sequence parallelism an
all-gather and a reduce-scatter in place of each (Korthikanti et al. 2022); priced on the
link the tp group crosses. The time split reported: ``compute``, ``tp``, ``cp`` (ring
traffic not hidden behind attention), ``ep`` (all-to-all), ``pp`` (waiting on pipeline
transfers beyond the ideal bubble), ``bubble`` (idle with free transfers), ``dp`` and
``optimizer``, for the slowest rank; they add up to ``step``.

Context parallelism (``Layout.cp``; Liu et al. 2023, ring attention; the engine's
``parallel.context``): a rank holds s / cp tokens of each sequence, so every per-token
GEMM and kernel runs on s / cp tokens and its attention on its queries against all s keys
(1 / cp of the score FLOPs, causal chunks load-balanced). Per block, forward, the K and V
blocks go cp - 1 steps round the ring: 2 (cp - 1) / cp of the sequence's K/V bytes
(2 s b k e / t, k the width passed: ``ring_kv_width``) received per rank; backward K and V
again and their gradient accumulators dK, dV (fp32, as the engine keeps them) cp steps.
A sliding window that leaves some ranks' blocks unseen by others moves only the blocks
seen, directly (``parallel.context.ring_attention.kv_transfers``: with W <= s / (2 cp), a
rank's two neighbours' blocks), and backward their dK/dV straight back (``_ring_counts``),
and its attention is priced for the slowest rank (``attention_keys``). Each ring pass
overlaps the attention compute of its blocks (forward: the attention core, backward: twice
it), so only what exceeds it is exposed. With selective recomputation
(``Layout.selective``) the attention core is computed again in backward and its ring with
it: the forward's exposed ring seconds are added to the backward's (Korthikanti et al.'s
attention-core recomputation, ``Layout.selective``, kept for their published runs). The
engine's selective recomputation (``Layout.recompute = "selective"``, ``parallel.recompute
= "selective"``: matmul and attention outputs kept, the rest of a block recomputed) adds to
the backward the block's memory-bound operations but the attention kernel (norms,
activation, residual adds: ``recomputed_ops``), no GEMM and no tp / SP / ep collective (the
engine replays them), and under cp one more forward ring pass of K and V per block, exposed
(the attention it overlapped is not run again). Gradients of
replicated weights are reduced over dp x cp (``Topology``'s folded ``dp_cp`` group).

Expert parallelism (``Layout.ep``, folded over dp, mixture-of-experts specs; Lepikhin et
al. 2020, GShard; the engine's ``parallel.experts``): per MoE block and micro-batch, the
dispatch and the combine are all-to-alls of the rank's T k token copies (T tokens of h
values, k experts each), (ep - 1) / ep of them leaving the rank: 2 T k h e (ep - 1) / ep
bytes forward and as many backward, on the critical path (not overlapped). The experts'
GEMMs: a rank runs E / ep experts on T k ep / E tokens each (balanced routing), so more ep
means fewer, larger expert GEMMs. Expert gradients are reduced over the (dp / ep) x cp ranks
holding the same experts (``ep_dp_cp``), the dense ones over dp x cp.

FP8 (``Layout.fp8``): the block's linear-layer GEMMs at the FP8 tensor-core peak (twice
the bf16 one: the H100 datasheet's 1,979 dense TFLOP/s) on a cluster that has one
(``Cluster.fp8_flops``: ``dgx-h100``; none on the A100s), the attention core, the head
and every memory-bound kernel as before (Transformer Engine's recipe: FP8 for the linear
layers only; Micikevicius et al. 2022, "FP8 formats for deep learning"). Memory is
priced as bf16 (the engine has no FP8; its savings on activations are not claimed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

from shardwise.parallel.pipeline.schedules import (
    Backward,
    Forward,
    SendActivation,
    SendGrad,
    schedule,
    warmup_forwards,
)
from shardwise.planner.attention import FUSED_PAIR
from shardwise.planner.hardware import Cluster
from shardwise.planner.memory import (
    BYTES,
    chunk_blocks,
    cut,
    padded_vocab,
    rank_expert_params,
    rank_params,
    stage_layers,
    written_score_bytes,
)
from shardwise.planner.specs import ModelSpec, active_matmul_params


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
    recompute: bool | str = False  # True: full; "selective": the engine's op-level one
    sp: bool = False
    partition: str = "layers"  # how the engine cuts layers into chunks: layers or params
    selective: bool = False  # recompute only the attention core (Korthikanti et al. 2022)
    cp: int = 1  # context-parallel ranks per sequence (s / cp tokens each)
    ep: int = 1  # expert-parallel ranks, folded over dp (ep divides dp)
    fp8: bool = False  # linear-layer GEMMs in FP8 (Cluster.fp8_flops)
    dp_replicate: int = 1  # HSDP replicas: ZeRO over dp / dp_replicate, a mean across them

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def label(self) -> str:
        v = self.chunks_per_rank
        sched = "" if self.pp == 1 else (f" {self.schedule}" + (f" v{v}" if v > 1 else ""))
        rc = " rc=sel" if self.recompute == "selective" else " rc" if self.recompute else ""
        extra = rc + (" rc=attn" if self.selective else "") + (
            "" if not self.sp else " sp") + (
            " cut=params" if self.partition == "params" and self.pp > 1 else "") + (
            " fp8" if self.fp8 else "")
        ep = (f" hsdp{self.dp_replicate}" if self.dp_replicate > 1 else "") + (
            f" ep{self.ep}" if self.ep > 1 else "")
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        return (f"dp{self.dp}{ep} tp{self.tp} pp{self.pp}{cp} mb{self.micro_batch_size} "
                f"m{self.micro_batches}{sched} z{self.zero}{extra}")


class Ops(NamedTuple):
    """One block's forward as operations (``block_ops``; ``op_seconds`` prices them)."""

    gemms: list[float]
    """FLOPs of each GEMM, in the block's order (``gemms[1:3]``: the attention core's)."""
    moves: list[float]
    """Bytes each memory-bound operation reads and writes."""


class RingBytes(NamedTuple):
    """Bytes one rank receives round the cp ring per block (``ring_bytes``)."""

    forward: float
    """Bytes, forward: the other cp - 1 K/V blocks."""
    backward: float
    """Bytes, backward: the K/V blocks again and the fp32 dK/dV accumulators."""


class RingSeconds(NamedTuple):
    """Seconds of one block's ring traffic on one rank, before overlap (``ring_seconds``)."""

    forward: float
    """Seconds, forward."""
    backward: float
    """Seconds, backward."""


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
    """Seconds of the ring's traffic not hidden behind attention, forward."""
    cp_backward: float
    """Seconds of the ring's traffic not hidden behind attention, backward."""
    all_to_all: float
    """Seconds of a block's all-to-alls in one pass (``all_to_all_seconds``)."""
    sync_penalty: float
    """Seconds each synchronisation waits on a machine whose ranks share cores
    (``Cluster.sync_penalty_s``)."""
    recomputed: float = 0.0
    """Seconds of what the engine's selective recomputation runs again of a block in
    backward (``recomputed_ops``; ``Layout.recompute = "selective"``)."""
    ring_again: float = 0.0
    """Seconds of the ring's forward pass of K and V run again in that recomputation (cp >
    1), none of it hidden (the attention it overlapped is kept, not recomputed)."""


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
    """Seconds of the forward spent off the core: its sync penalty (ranks sharing cores)
    and ZeRO-3's exposed collectives (``_with_zero3``)."""
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


class DpSeconds(NamedTuple):
    """A rank's data-parallel seconds (``dp_seconds``)."""

    after: float
    """Seconds of dp collectives after the flush (ZeRO-0 all-reduce, ZeRO-1/2 reduce-scatter
    and all-gather; 0 for ZeRO-3, whose collectives are inside every micro-batch's forward
    and backward: ``zero3_seconds``, ``ChunkCost.dp``)."""


class Zero3Seconds(NamedTuple):
    """Seconds ZeRO-3's collectives add to one micro-batch's forward and backward on one
    pipeline rank (``zero3_seconds``), after what overlaps its compute."""

    forward: float
    """Seconds added to the forward: its gathers not hidden behind compute."""
    backward: float
    """Seconds added to the backward: its gathers again and its reduce-scatters."""


class RankComm(NamedTuple):
    """Seconds one pipeline rank spends in communication inside its compute over a step
    (``_rank_comm``): m passes of each of its chunks."""

    cp: float
    """Seconds of exposed ring traffic."""
    ep: float
    """Seconds of all-to-alls."""
    pp: float
    """Seconds of blocking pipeline sends."""
    dp: float
    """Seconds of ZeRO-3's exposed collectives."""


class Walk(NamedTuple):
    """What a walk of the schedule gives per pipeline rank (``walk``, ``walk_fast``,
    ``walk_shared``)."""

    end: list[float]
    """Seconds from the step's start to the end of each rank's last compute."""
    busy: list[float]
    """Seconds each rank computes (its ops' time less their communication)."""
    tp: list[float]
    """Seconds each rank spends in communication inside its ops (``ChunkCost.tp_*``)."""
    events: list[dict]
    """The timeline: one dict per op (rank, kind, mb, chunk, start, end seconds); empty
    from ``walk_fast``."""


def attention_keys(spec: ModelSpec, cp: int = 1) -> float:
    """The keys a query is priced against in the attention FLOPs of the slowest of ``cp``
    ranks, averaged over the blocks. At cp = 1 the engine's calls
    (``ModelSpec.attention_calls``, ``planner.attention``): s for a plain causal block (the
    triangle counted whole, as PaLM counts it); every other call by the pairs it scores
    (a fused kernel's at ``attention.FUSED_PAIR``, written-out scores' at 1): 2 s with
    document masks, about 2 (c + W - 1) for a sliding window in chunks of c. Under cp,
    without a window: s (the same price: each rank's diagonal triangles and full boxes);
    with one, the pairs the slowest rank's ring kernels score over its s / cp queries, at
    ``FUSED_PAIR`` (``ring_attention.scored_pairs``: a diagonal task half its box; the
    layout balances full attention, not a band: mistral-7b at 32k tokens on cp 4, its
    middle ranks score two triangles and two band boxes of c = s / 2 cp, about 3 c keys a
    query); the slowest rank over the sum of the blocks, per block. With document masks
    (``block_causal``) the ring's diagonal boxes are masked calls too, scored whole: c more
    keys a query."""
    if cp == 1:
        return spec.attention_calls.priced_keys
    s = spec.block_size
    whole = s / (2 * cp) if spec.attention_mask == "block_causal" else 0.0
    if not spec.attention_windows or s < 2 * cp:
        return spec.attn_keys + whole
    return _attention_keys(spec.attention_windows, s, cp) + whole


@lru_cache(maxsize=256)
def _attention_keys(windows: tuple, s: int, cp: int) -> float:
    from shardwise.parallel.context.ring_attention import scored_pairs  # as _ring_counts'

    per_rank = [0.0] * cp
    for w in windows:
        if w is None:
            per_rank = [k + s for k in per_rank]
            continue
        pairs = scored_pairs(cp, s // (2 * cp), w)
        per_rank = [k + FUSED_PAIR * p * cp / s for k, p in zip(per_rank, pairs)]
    return max(per_rank) / len(windows)


def block_flops(spec: ModelSpec, mb: int, cp: int = 1) -> float:
    """Forward FLOPs of one block on one cp rank (``s / cp`` tokens) as the planner prices
    them: 2 per weight of its matrices a token meets (GPT: 24 s h^2; experts: the top-k a
    token goes to), and Q K^T and softmax(.) V, 4 s K H D (H D = h for the GPT and Llama;
    K the keys a query is priced against, ``attention_keys``: s for a plain causal block,
    the engine's masked calls at their price otherwise, averaged over the blocks), of which
    a cp rank's queries do 1 / cp."""
    s = spec.block_size
    return (2 * mb * s * active_matmul_params(spec)
            + 4 * mb * s * attention_keys(spec, cp) * spec.attn_width) / cp


def attention_gemm_flops(spec: ModelSpec, mb: int, cp: int = 1) -> float:
    """Of ``block_flops``, the attention core's (Q K^T and P V): 4 s K H D / cp."""
    s = spec.block_size
    return 4 * mb * s * attention_keys(spec, cp) * spec.attn_width / cp


def block_ops(spec: ModelSpec, mb: int, tp: int, sp: bool, kernels: str, e: int,
              cp: int = 1, ep: int = 1) -> Ops:
    """One block's forward on one tp rank, as operations: ``Ops(gemms, moves)``, the FLOPs
    of each GEMM and the bytes each memory-bound operation reads and writes (``e`` bytes per
    value; T = mb s / cp tokens on a rank of ``cp`` context-parallel ones, H D the
    attention width (``attn_width``: h but with a head_dim of its own), d = H D / a, k =
    key/value heads x d, f the MLP width); ``gemms[1:3]`` are the attention core's:

    - GEMMs: Q K V 2 T h (H D + 2k) / t (MLA, ``models.mla``: its down projections 2 T h
      (r_q + r_kv + R) whole, its up projections 2 T (r_q H Dqk + r_kv H (D_nope + D_v)) / t,
      the output 2 T H D_v h / t; H D the mean of Dqk and D_v per head); Q K^T and P V
      2 mb s K H D / (t cp) each (batched
      over the rank's heads; its s / cp queries against K keys, ``attention_keys``: s,
      or the engine's masked calls' price); the output projection
      2 T H D h / t; the MLP 2 T h f / t per matrix (2 matrices, 3 gated); with experts, the
      router 2 T h E (whole on every tp rank) and, per matrix, E / ``ep`` grouped GEMMs
      of 2 (T k ep / E) h F / t each (balanced routing); a shared expert 2 T h F_s / t
      per matrix, its gate 2 T h (whole);
    - two norms (read and write T h; / t under sequence parallelism), four with Gemma's
      sandwich norms (``ModelSpec.sandwich_norm``; the two more last in ``moves``);
    - attention, by kernel: ``megatron-2021`` materialises the s x s scores (a fused
      scale-mask-softmax reads and writes them, a dropout reads them and writes them and a
      1-byte mask); ``shardwise`` (flash) keeps them on chip and moves only Q, K, V and the
      output, unless the model writes its scores out (``ModelSpec.written_scores`` n > 0,
      at cp = 1: Gemma 2's soft cap, the math path), whose every score tensor (the Q K^T
      output, n - 1 more, the fp32 softmax, the probabilities cast back; T x T, or the
      pairs of a window's chunks: ``AttentionCalls.written_keys`` a query) is written and
      read once;
    - the MLP's activation (read and write T f / t; SwiGLU reads two; experts: T k F / t,
      plus a shared expert's T F_s / t);
    - the two residual adds: ``megatron-2021`` fused bias + dropout + add (reads two,
      writes one, a mask), ``shardwise`` a plain add (reads two, writes one).
    Backward is priced as twice the forward (its GEMMs are two of the same shape, its
    element-wise kernels read and write about twice as much)."""
    s, h, a = spec.block_size, spec.n_embd, spec.n_head
    T = mb * s // cp
    att = spec.attn_width  # H D: h, or wider / narrower with a head_dim of its own (Qwen3)
    d = att // a
    k = spec.kv_heads * d
    f = spec.ffn
    core = 2 * mb * s * attention_keys(spec, cp) * att / (tp * cp)
    gemms = [2 * T * h * (att + 2 * k) / tp, core, core, 2 * T * att * h / tp]
    if spec.latent_attention:  # DeepSeek's MLA (models.mla): the down projections whole
        # on every tp rank, the up projections and the output split
        rq, r, nope, rope, dv = spec.latent_attention
        H = spec.n_head
        down = h * (rq + r + rope)
        up = (rq or h) * H * (nope + rope) + r * H * (nope + dv)
        gemms[0], gemms[3] = 2 * T * (down + up / tp), 2 * T * H * dv * h / tp
    if spec.moe:
        E, F, top = spec.n_experts, spec.expert_ffn, spec.top_k
        local = max(1, E // ep)
        gemms += [2 * T * h * E] + [2 * (T * top / local) * h * F / tp] * (3 * local)
        if spec.moe_shared_ffn:  # every token through the shared expert (and its gate)
            gemms += [2 * T * h * spec.moe_shared_ffn / tp] * 3
            gemms += [2 * T * h] if spec.moe_shared_gate else []
        f_moved = top * F + spec.moe_shared_ffn
    else:
        gemms += [2 * T * h * f / tp] * (3 if spec.gated else 2)
        f_moved = f
    th = T * h * e / (tp if sp else 1)  # a whole-width activation on this rank
    moves = [2 * th, 2 * th]
    # this rank's scores, if written (only at cp = 1: the ring writes none)
    keys = spec.attention_calls.written_keys if cp == 1 else s
    scores = mb * (a // tp if a % tp == 0 else a / tp) * s * keys / cp
    if kernels == "megatron-2021":
        moves += [2 * scores * e, scores * (2 * e + 1)]
        moves += [T * h / (tp if sp else 1) * (3 * e + 1)] * 2
    else:
        moves += [T * (att + 2 * k + att) * e / tp]
        if spec.written_scores and cp == 1:  # the scores written out (ModelSpec): the
            # Q K^T output, the tanh's (n - 1 of them), the fp32 softmax and the cast
            # probabilities written, and read again once each
            moves[-1] += 2 * scores * written_score_bytes(spec.written_scores + 1, e)
        moves += [3 * th] * 2
    moves += [(3 if spec.gated else 2) * T * f_moved * e / tp]
    if spec.sandwich_norm:  # Gemma's norms of the attention's and the MLP's outputs
        moves += [2 * th, 2 * th]
    return Ops(gemms, moves)


def attention_core_ops(spec: ModelSpec, mb: int, tp: int, kernels: str, e: int,
                       cp: int = 1) -> Ops:
    """The part of ``block_ops`` selective recomputation runs again (Korthikanti et al.
    2022, sec. 5: Q K^T, softmax, dropout, P V), as ``Ops``."""
    ops = block_ops(spec, mb, tp, False, kernels, e, cp)
    return Ops(ops.gemms[1:3],
               ops.moves[2:4] if kernels == "megatron-2021" else ops.moves[2:3])


def recomputed_ops(spec: ModelSpec, mb: int, tp: int, sp: bool, kernels: str, e: int,
                   cp: int = 1) -> Ops:
    """The part of ``block_ops`` the engine's selective recomputation runs again in backward
    (``parallel.activation_checkpoint``: torch's policy keeps the matmuls' and fused
    attention's outputs, recomputes the rest): no GEMM; the memory-bound operations but the
    attention kernel's (the two norms, the residual adds, the MLP's activation; RoPE is
    not in ``block_ops`` and not here either). A dense block's (a mixture's selective
    recomputation is not priced: ``search.layout_reason``)."""
    ops = block_ops(spec, mb, tp, sp, kernels, e, cp)
    att = 2 if kernels == "megatron-2021" else 1  # the attention kernel's moves
    return Ops([], ops.moves[:2] + ops.moves[2 + att:])


def op_seconds(cluster: Cluster, ops: Ops, fp8: bool = False) -> float:
    """Seconds of ``ops`` under ``cluster.ops``; ``fp8``: the GEMMs but the attention
    core's (``gemms[1:3]`` of a whole block) at the FP8 peak."""
    g = sum(cluster.ops.gemm(x, fp8 and i not in (1, 2)) for i, x in enumerate(ops.gemms))
    return g + sum(cluster.ops.memory(x) for x in ops.moves)


def ring_kv_width(spec: ModelSpec) -> int:
    """Width of the K and V a cp ring passes: the kv_heads x d of grouped-query attention
    (the engine's ring attention, like Megatron-LM's, passes the key/value heads and repeats
    them to the query heads per block; ``parallel.context.ring_attention``)."""
    return spec.kv_heads * (spec.attn_width // spec.n_head)


@lru_cache(maxsize=256)
def _ring_counts(windows: tuple, s: int, cp: int) -> tuple[tuple, ...]:
    """Per cp rank, ``(K/V blocks received, K/V messages, dK/dV blocks received, dK/dV
    messages)`` of one block's pass, averaged over the blocks of sliding windows
    ``windows`` (one per block, None: none; () : no block has one) on ``s`` tokens: round
    the ring (cp - 1, cp - 1, cp, cp) where every rank needs every block, else only the
    transfers the engine makes (``ring_attention.kv_transfers``): a block from each rank
    whose keys the rank's queries see, its dK/dV from each rank that saw its own, one
    message per hop distance taken part in (sending or receiving: they go together)."""
    ring = (float(cp - 1), float(cp - 1), float(cp), float(cp))
    if not windows:
        return (ring,) * cp
    # imported here: the package's import pulls in torch's compiler (1.6 s of the CLI's
    # start), wanted only for a windowed model under cp
    from shardwise.parallel.context.ring_attention import kv_transfers

    per_layer = list(windows)
    c = s // (2 * cp)
    totals = [[0.0] * 4 for _ in range(cp)]
    for w in per_layer:
        needs = kv_transfers(cp, c, w) if w is not None and c > 0 else None
        if needs is None or len(needs) == cp * (cp - 1):
            for t in totals:
                t[0], t[1], t[2], t[3] = t[0] + cp - 1, t[1] + cp - 1, t[2] + cp, t[3] + cp
            continue
        hops = {(d - src) % cp for src, d in needs}
        for i, t in enumerate(totals):
            calls = sum((i, (i + h) % cp) in needs or ((i - h) % cp, i) in needs
                        for h in hops)
            t[0] += sum((src, i) in needs for src in range(cp))
            t[2] += sum((i, d) in needs for d in range(cp))
            t[1], t[3] = t[1] + calls, t[3] + calls
    return tuple(tuple(x / len(per_layer) for x in t) for t in totals)


def ring_block_bytes(spec: ModelSpec, lay: Layout, e: int) -> float:
    """Bytes of one K/V block a cp rank passes on: K and V of its s / cp tokens,
    2 mb (s / cp) k e / t (k = ``ring_kv_width``)."""
    kw = ring_kv_width(spec)
    return 2 * lay.micro_batch_size * (spec.block_size // lay.cp) * kw * e / lay.tp


def ring_bytes(spec: ModelSpec, lay: Layout, e: int) -> RingBytes:
    """Bytes one rank receives round the cp ring per block, ``RingBytes(forward,
    backward)``: forward
    the cp - 1 other K/V blocks, 2 (cp - 1) / cp of the sequence's K/V bytes
    (2 mb s k e / t, K and V); backward those again and the fp32 dK/dV accumulators of
    every block (cp steps; the engine accumulates in fp32). Under a sliding window
    (``ModelSpec.attention_windows``) only the blocks the rank's queries see, and backward
    those and the fp32 dK/dV of its own block from each rank that saw it (``_ring_counts``:
    with W <= s / (2 cp), 2 blocks on the middle ranks where the ring brings cp - 1);
    averaged over the blocks, for the rank that receives the most."""
    if lay.cp == 1:
        return RingBytes(0.0, 0.0)
    kv = ring_block_bytes(spec, lay, e)
    counts = _ring_counts(spec.attention_windows, spec.block_size, lay.cp)
    return RingBytes(max(n * kv for n, _, _, _ in counts),
                     max(n * kv + m * kv * 4 / e for n, _, m, _ in counts))


def ring_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, e: int) -> RingSeconds:
    """Seconds of one block's ring traffic on one rank, ``RingSeconds(forward, backward)``,
    before any overlap (``ring_bytes``): each step one message to the next rank of the ring
    (``Link.p2p``), on the link the cp group crosses (cp x tp consecutive ranks); under a
    sliding window one message per hop distance the rank sends or receives over
    (``_ring_counts``), for the slowest rank."""
    if lay.cp == 1:
        return RingSeconds(0.0, 0.0)
    link = cluster.link(lay.tp * lay.cp)
    blk = ring_block_bytes(spec, lay, e)
    kv, dkv = link.p2p(blk), link.p2p(blk * 4 / e)
    counts = _ring_counts(spec.attention_windows, spec.block_size, lay.cp)
    return RingSeconds(max(n * kv for _, n, _, _ in counts),
                       max(n * kv + m * dkv for _, n, _, m in counts))


def all_to_all_bytes(spec: ModelSpec, lay: Layout, e: int) -> float:
    """Bytes one rank sends to other ranks per MoE block and pass (forward; backward the
    same): dispatch and combine each move the rank's T k token copies of h values, (ep - 1)
    / ep of them away: 2 T k h e (ep - 1) / ep, T = mb s / cp tokens."""
    if lay.ep == 1 or not spec.moe:
        return 0.0
    T = lay.micro_batch_size * spec.block_size // lay.cp
    return 2 * T * spec.top_k * spec.n_embd * e * (lay.ep - 1) / lay.ep


def all_to_all_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, e: int) -> float:
    """Seconds of one MoE block's all-to-alls in one pass (dispatch + combine) on one rank
    (``all_to_all_bytes``; ``Link.all_to_all`` each), on the link the ep group crosses (ep
    consecutive dp ranks: ep x pp x cp x tp ranks)."""
    if lay.ep == 1 or not spec.moe:
        return 0.0
    T = lay.micro_batch_size * spec.block_size // lay.cp
    link = cluster.link(lay.ep * lay.pp * lay.cp * lay.tp)
    return 2 * link.all_to_all(lay.ep, T * spec.top_k * spec.n_embd * e)


def head_seconds(spec: ModelSpec, mb: int, tp: int, cluster: Cluster, e: int,
                 cp: int = 1) -> float:
    """The LM head's forward under the per-operation model: its GEMM 2 T h V / t, the final
    norm, and the vocabulary-parallel cross entropy reading the logits three times (max,
    exp-sum, loss) in fp32."""
    T, h = mb * spec.block_size // cp, spec.n_embd
    V = padded_vocab(spec.vocab_size, tp) / tp
    return (cluster.ops.gemm(2 * T * h * V) + cluster.ops.memory(2 * T * h * e)
            + cluster.ops.memory(3 * T * V * 4))


def block_costs(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str,
                dedicated: bool = False) -> BlockCosts:
    """The per-block prices ``chunk_costs`` composes chunks of (``BlockCosts``: tp seconds
    of a block, its synchronisations, the embedding's and the loss's tp seconds, a block's
    and the head's forward compute, the attention core's, a blocking send, the ring's
    exposed forward and backward, a block's all-to-alls, the sync penalty). Mixed dense and
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
    pen = cluster.sync_penalty_s
    if lay.tp == 1:
        tp_blk, n_sync = 0.0, 0
    elif lay.sp:
        tp_blk, n_sync = 2 * (tl.all_gather(lay.tp, act) + tl.reduce_scatter(lay.tp, act)), 4
    else:  # a mixture's experts all-reduce their k results per token (under SP its region
        # reduce-scatters the weighted sum once, as a dense MLP: docs/moe.md)
        mlp = act * (spec.top_k if spec.moe else 1)
        tp_blk, n_sync = tl.all_reduce(lay.tp, act) + tl.all_reduce(lay.tp, mlp), 2
    bf = block_flops(spec, lay.micro_batch_size, lay.cp) / lay.tp
    fp8 = lay.fp8 and cluster.fp8_flops is not None
    head_f = 2 * lay.micro_batch_size * s * h * padded_vocab(spec.vocab_size, lay.tp) / lay.tp
    # vocab-parallel embedding: one all-reduce forward; vocab-parallel loss: three small ones
    emb_tp = tl.all_reduce(lay.tp, act) if lay.tp > 1 else 0.0
    loss_tp = 3 * tl.all_reduce(lay.tp, lay.micro_batch_size * s * 4) if lay.tp > 1 else 0.0
    core_f = attention_gemm_flops(spec, lay.micro_batch_size, lay.cp) / lay.tp
    if cluster.ops is not None:  # per operation (hardware.OpModel)
        blk_s = op_seconds(cluster, block_ops(spec, lay.micro_batch_size, lay.tp, lay.sp,
                                              cluster.kernels, e, lay.cp, lay.ep), fp8)
        head_s = head_seconds(spec, lay.micro_batch_size, lay.tp, cluster, e, lay.cp)
    elif fp8:  # the linear layers at twice the rate
        blk_s = (bf - core_f) / (rate * cluster.fp8_flops / cluster.flops) + core_f / rate + over
        head_s = head_f / rate
    else:
        blk_s, head_s = bf / rate + over, head_f / rate
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
    cp_f = max(0.0, ring.forward - attn_s)  # overlapped
    cp_b = max(0.0, ring.backward - 2 * attn_s)
    a2a = all_to_all_seconds(spec, lay, cluster, e)
    return BlockCosts(tp=tp_blk, n_sync=n_sync, embed_tp=emb_tp, loss_tp=loss_tp,
                      block=blk_s, head=head_s, attention=attn_s, send=send,
                      cp_forward=cp_f, cp_backward=cp_b, all_to_all=a2a, sync_penalty=pen,
                      recomputed=redo_s, ring_again=ring.forward)


def chunk_costs(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str,
                dedicated: bool = False, memo: dict | None = None) -> list[ChunkCost]:
    """Per global chunk, a ``ChunkCost``: (forward s, backward s, tp s in forward, tp s in
    backward, waiting s in forward, waiting s in backward, cp s, ep s, blocking pp s),
    seconds of one micro-batch. Waiting: the sync
    penalty of ranks sharing cores (``contention``), spent off the core. ``dedicated``:
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
    """``block_costs``, memoised in ``memo`` (when given) by what it reads of ``lay``."""
    key = (lay.world if cluster.cores else 0, lay.tp, lay.pp, lay.micro_batch_size, lay.sp,
           lay.cp, lay.ep, lay.fp8, lay.selective, dedicated)
    blk = None if memo is None else memo.get(key)
    if blk is None:
        blk = block_costs(spec, lay, cluster, precision, dedicated)
        if memo is not None:
            memo[key] = blk
    return blk


def _chunk_cost(blk: BlockCosts, lay: Layout, nb: int, head: bool, emb: bool) -> ChunkCost:
    """``chunk_costs``' price of one chunk of ``nb`` blocks, with the head and the embedding
    or not (without ZeRO-3: ``_with_zero3``), from the per-block prices ``blk``."""
    tp_blk, n_sync, pen = blk.tp, blk.n_sync, blk.sync_penalty
    emb_tp, loss_tp, blk_s, head_s = blk.embed_tp, blk.loss_tp, blk.block, blk.head
    attn_s, send, a2a = blk.attention, blk.send, blk.all_to_all
    cp_f, cp_b = blk.cp_forward, blk.cp_backward
    comp_f = nb * blk_s + (head_s if head else 0.0)
    cpf, epf = nb * cp_f, nb * a2a
    tpf = nb * tp_blk + (emb_tp if emb else 0.0) + (loss_tp if head else 0.0) + cpf + epf
    syncs = (nb * n_sync + (1 if emb else 0) + (3 if head else 0)) if lay.tp > 1 else 0
    wait_f = syncs * pen
    cpb, epb = nb * cp_b, nb * a2a
    tpb = nb * tp_blk + (loss_tp if head else 0.0) + cpb + epb  # backward: the block's
    wait_b = (nb * n_sync + (1 if head else 0)) * pen if lay.tp > 1 else 0.0
    comp_b = 2 * comp_f
    if lay.recompute == "selective":  # the engine's: the block's memory-bound ops again,
        # its collectives replayed (nothing moved), but under cp its ring passes K and V
        # again (parallel.context.ring_comm runs the shifts again), none of it hidden
        comp_b += nb * blk.recomputed
        again = nb * blk.ring_again
        cpb, tpb = cpb + again, tpb + again
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
    key = ("model", lay.world if cluster.cores else 0, lay.tp, lay.pp, lay.micro_batch_size,
           lay.sp, lay.cp, lay.ep, lay.fp8, lay.selective, lay.recompute)
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
    core as the sync penalty is (``walk_shared`` does not slow them down by core sharing,
    as the step's ZeRO-3 seconds were priced before they moved into the chunks)."""
    return c._replace(forward=c.forward + z.forward, backward=c.backward + z.backward,
                      tp_forward=c.tp_forward + z.forward, tp_backward=c.tp_backward + z.backward,
                      wait_forward=c.wait_forward + z.forward,
                      wait_backward=c.wait_backward + z.backward, dp=z.forward + z.backward)


def dp_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str,
               layers: list[int]) -> DpSeconds:
    """``DpSeconds(after)``: seconds of dp collectives after the flush for a rank holding
    ``layers`` (ZeRO-3's are inside the schedule: ``zero3_seconds``)."""
    n = lay.dp * lay.cp  # every replica of the dense weights
    R = lay.dp_replicate if lay.zero else 1  # HSDP: ZeRO over n / R, a mean across R
    if n == 1 or lay.zero == 3 and R == 1:
        return DpSeconds(0.0)
    e = BYTES[precision]
    X = rank_expert_params(spec, layers, lay.tp, lay.ep)
    P = rank_params(spec, layers, lay.tp, lay.pp, lay.ep) - X
    link = cluster.link(lay.world)
    x, pen = P * e, cluster.sync_penalty_s
    nx = lay.dp // lay.ep * lay.cp  # the ranks holding the same experts (ep_dp x cp)
    if lay.zero == 0:
        return DpSeconds(link.all_reduce(n, x) + link.all_reduce(nx, X * e) + pen)
    # HSDP: the shard's mean across replicas on the links the whole grid spans (inter-node
    # once it spans nodes); the shard group's own collectives on a replica's links
    mean = link.all_reduce(R, x * R / n) + pen if R > 1 else 0.0
    if lay.zero == 3:  # its gathers and reduce-scatters are inside the schedule
        return DpSeconds(mean)
    n, inner = n // R, cluster.link(lay.world // R)
    return DpSeconds(mean + inner.reduce_scatter(n, x) + inner.all_gather(n, x)
                     + link.reduce_scatter(nx, X * e) + link.all_gather(nx, X * e) + 2 * pen)


def unit_forward_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster,
                         precision: str, memo: dict | None = None) -> dict:
    """Forward seconds of one micro-batch through one layer of each kind (its compute and
    tensor-parallel collectives, as ``chunk_costs`` prices them): ``embed``, ``block``,
    ``head``. ``memo``: ``chunk_costs``' dict for one search (one spec, cluster and
    precision), keyed here by what the answer depends on."""
    key = ("unit_forward", lay.tp, lay.micro_batch_size, lay.sp, lay.cp, lay.fp8)
    if memo is not None and key in memo:
        return memo[key]
    one = Layout(1, lay.tp, 1, lay.micro_batch_size, 1, sp=lay.sp, cp=lay.cp, fp8=lay.fp8)
    c = chunk_costs(replace(spec, n_layer=1), one, cluster, precision)[0]
    blk = chunk_costs(replace(spec, n_layer=2), one, cluster, precision)[0].forward - c.forward
    e = BYTES[precision]
    act = lay.micro_batch_size * spec.block_size // lay.cp * spec.n_embd * e
    emb = cluster.link(lay.tp).all_reduce(lay.tp, act) if lay.tp > 1 else 0.0
    out = {"embed": emb, "block": blk, "head": c.forward - blk - emb}
    if memo is not None:
        memo[key] = out
    return out


def zero3_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str,
                  layers: list[int], memo: dict | None = None) -> Zero3Seconds:
    """``Zero3Seconds(forward, backward)``: seconds ZeRO-3's collectives add to one
    micro-batch's forward and backward of a chunk holding ``layers`` (a pipeline stage, or
    with the interleaved schedule one of a rank's v chunks, each a ``ZeroStage3`` of its
    own, gathered and reduce-scattered around its own ops alone), over dp x cp ranks on the link ``lay.world`` ranks span (zero
    when ``lay.zero`` is not 3 or dp x cp = 1). ``parallel.zero.stage3`` gathers a rank's
    units for every micro-batch's forward and again for its backward and reduce-scatters
    every backward, pipeline or not, so this is charged per micro-batch per op
    (``chunk_costs`` adds it to the chunk's forward and backward: the walk delays the stages
    waiting on it, the pipeline's fill and drain included).

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

    Without overlap (``zero3_overlap=False``, or ranks sharing cores): the rank's
    parameters x all-gathered whole per pass and reduce-scattered per backward, and a sync
    penalty per unit and collective: forward g(x) + u pen, backward g(x) + r(x) + 2 u pen
    (u = ``len(layers)``). ``memo``: ``chunk_costs``' dict for one search (a search
    prices hundreds of thousands of ZeRO-3 layouts that share these answers).

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
    key = ("zero3", lay.dp, lay.cp, lay.tp, lay.pp, lay.ep, lay.micro_batch_size, lay.sp,
           lay.fp8, lay.recompute, emb, len(layers) - emb - head, head, lay.dp_replicate)
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
        d, x = parts(layers)
        units = len(layers) + (sum(1 for i in layers if 1 <= i <= L) if x else 0)
        pen = cluster.sync_penalty_s
        return Zero3Seconds(gather(d, x) + units * pen,
                            gather(d, x) + scatter(d, x) + 2 * units * pen)
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
    mult = 3 if lay.recompute is True else 2  # selective's recomputed ops: not counted
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
    return Zero3Seconds(forward, backward + r[0])  # the first unit's scatter, at the end


def tied_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str, r: int) -> float:
    """The all-reduce of a tied embedding's gradient between the first and last pipeline
    ranks (``r`` one of them, pp > 1), else 0."""
    if lay.pp > 1 and spec.tie_weights and (r in (0, lay.pp - 1)):
        return cluster.link(lay.tp * lay.cp * lay.pp).all_reduce(
            2, padded_vocab(spec.vocab_size, lay.tp) * spec.n_embd / lay.tp * BYTES[precision])
    return 0.0


def optimizer_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, layers: list[int]) -> float:
    """AdamW over this rank's masters: ~40 bytes of memory traffic per element."""
    P = rank_params(spec, layers, lay.tp, lay.pp, lay.ep)
    if lay.zero:
        X = rank_expert_params(spec, layers, lay.tp, lay.ep)
        P = ((P - X) / (lay.dp // lay.dp_replicate * lay.cp)
             + X / (lay.dp // lay.ep * lay.cp))  # as memory_of
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


def walk(sched, costs: list[ChunkCost], p2p: float) -> Walk:
    """Run the instruction lists; returns per rank (end of its last compute, busy compute
    seconds, tp seconds) and the timeline events, as a ``Walk``."""
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
                    end = start + f.forward
                    busy[r] += f.forward - f.tp_forward
                    tp_time[r] += f.tp_forward
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
                    end = start + f.backward
                    busy[r] += f.backward - f.tp_backward
                    tp_time[r] += f.tp_backward
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
    return Walk(free, busy, tp_time, events)


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


@lru_cache(maxsize=256)
def _walk_fast_memo(p: int, m: int, v: int, costs: tuple[ChunkCost, ...], p2p: float) -> Walk:
    """``walk_fast``, memoised by all it reads: a search simulates layouts that walk alike
    (ZeRO 0, 1 and 2 of one layout have the same chunk costs and transfers, and only their
    dp time after the walk differs). Its lists are shared: read them, never change them."""
    return walk_fast(p, m, v, list(costs), p2p)


def walk_fast(p: int, m: int, v: int, costs: list[ChunkCost], p2p: float) -> Walk:
    """``walk``'s ``Walk`` (end of each rank's last compute, busy compute seconds, tp
    seconds; no events) for the 1F1B and interleaved schedules, without walking instruction
    by instruction.

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
    cf = np.array([c.forward for c in costs])
    cb = np.array([c.backward for c in costs])
    cost = np.where(bwd, cb[O_c], cf[O_c])
    busy_v = np.where(bwd, np.array([c.backward - c.tp_backward for c in costs])[O_c],
                      np.array([c.forward - c.tp_forward for c in costs])[O_c])
    tp_v = np.where(bwd, np.array([c.tp_backward for c in costs])[O_c],
                    np.array([c.tp_forward for c in costs])[O_c])
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
    return Walk(end[n - 1:p * n:n].tolist(), busy, tp_time, [])


def walk_shared(sched, costs: list[ChunkCost], p2p: float, cores: int, replicas: int) -> Walk:
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
            work, tpw, wait = ((f.forward, f.tp_forward, f.wait_forward) if fwd
                               else (f.backward, f.tp_backward, f.wait_backward))
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
    return Walk(end_of, busy, tp_time, events)


def p2p_bytes(spec: ModelSpec, lay: Layout, e: int) -> float:
    """Bytes of one pipeline transfer: a micro-batch's activation (s / cp tokens; / t
    under sequence parallelism)."""
    return (lay.micro_batch_size * (spec.block_size // lay.cp) * spec.n_embd * e
            / (lay.tp if lay.sp else 1))


def _rank_comm(costs: list[ChunkCost], r: int, lay: Layout) -> RankComm:
    """``RankComm(cp, ep, pp, dp)``: the exposed ring, all-to-all, blocking-send and ZeRO-3
    seconds rank ``r`` spends in the walk, m passes of each of its chunks."""
    mine = [c for i, c in enumerate(costs) if i % lay.pp == r]
    if not any(c.cp or c.ep or c.pp or c.dp for c in mine):
        return RankComm(0.0, 0.0, 0.0, 0.0)
    m = lay.micro_batches
    return RankComm(m * sum(c.cp for c in mine), m * sum(c.ep for c in mine),
                    m * sum(c.pp for c in mine), m * sum(c.dp for c in mine))


def blocking_p2p(cluster: Cluster, lay: Layout) -> bool:
    """Whether pipeline transfers block the compute stream: Megatron-LM as Narayanan et al.
    2021 ran it (``Cluster.blocking_sends``, set by ``per_op(kernels="megatron-2021")``: its
    ``p2p_communication`` posts a batched isend/irecv and waits on it before the next
    micro-batch, 1F1B's send_forward_recv_backward included), so a send's time is the
    sender's and nothing travels on its own."""
    return lay.pp > 1 and cluster.blocking_sends


def megatron_send_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, e: int) -> float:
    """Seconds a blocking send takes (``blocking_p2p``; else 0): Megatron's scatter/gather
    (Narayanan et al. 2021, sec. 4.1): each of the t ranks sends 1 / t of the activation
    over the link between the stages, the receiving ranks all-gather it over NVLink."""
    if not blocking_p2p(cluster, lay):
        return 0.0
    msg = lay.micro_batch_size * (spec.block_size // lay.cp) * spec.n_embd * e
    return (cluster.link(lay.tp * lay.cp * lay.pp).p2p(msg / lay.tp)
            + cluster.link(lay.tp).all_gather(lay.tp, msg))


def simulate(spec: ModelSpec, layout: Layout, cluster: Cluster, precision: str | None = None,
             with_events: bool = False) -> dict:
    """Predicted seconds of one optimizer step and its split (see the module docstring)."""
    lay = layout
    precision = precision or cluster.precision
    kind = lay.schedule if lay.pp > 1 else "1f1b"
    shared = bool(cluster.cores)
    costs = chunk_costs(spec, lay, cluster, precision, dedicated=shared)
    e = BYTES[precision]
    msg = p2p_bytes(spec, lay, e)
    p2p = (cluster.link(lay.tp * lay.cp * lay.pp).p2p(msg) + cluster.sync_penalty_s
           ) if lay.pp > 1 and not blocking_p2p(cluster, lay) else 0.0
    fast = not shared and not with_events and kind in ("1f1b", "interleaved")
    p, m, v = lay.pp, lay.micro_batches, lay.chunks_per_rank
    if fast:  # the same numbers as walk(), without the instruction lists
        key = tuple(costs)
        run = lambda c: _walk_fast_memo(p, m, v, key, c)
    elif shared:
        sched = schedule(kind, p, m, v)
        run = lambda c: walk_shared(sched, costs, c, cluster.cores, lay.dp * lay.tp)
    else:
        sched = schedule(kind, p, m, v)
        run = lambda c: walk(sched, costs, c)
    end, busy, tp_time, events = run(p2p)
    ideal_end = run(0.0).end if lay.pp > 1 else end
    per_rank = stage_layers(spec, lay.pp, lay.chunks_per_rank, lay.partition)
    totals, parts = [], []
    for r in range(lay.pp):
        dp = dp_seconds(spec, lay, cluster, precision, per_rank[r])
        opt = optimizer_seconds(spec, lay, cluster, per_rank[r])
        tied = tied_seconds(spec, lay, cluster, precision, r)
        totals.append(end[r] + dp.after + tied + opt)
        comm = _rank_comm(costs, r, lay)
        parts.append({"compute": busy[r],
                      "tp": tp_time[r] - comm.cp - comm.ep - comm.pp - comm.dp,
                      "cp": comm.cp, "ep": comm.ep,
                      "pp": max(0.0, end[r] - ideal_end[r]) + comm.pp,
                      "dp": dp.after + comm.dp + tied, "optimizer": opt})
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
