"""Communication prices of the planner: bytes and seconds of the collectives and transfers
one rank makes, each on the link its group crosses (``Cluster.link``).

- Tensor parallelism, per block: two all-reduces of b s h e bytes forward and two backward
  (Shoeybi et al. 2019), or with sequence parallelism an all-gather and a reduce-scatter in
  place of each (Korthikanti et al. 2022): priced in ``costs.block_costs``.
- Context parallelism (Liu et al. 2023, ring attention; the engine's ``parallel.context``):
  per block, forward, the K and V blocks go cp - 1 steps round the ring, 2 (cp - 1) / cp of
  the sequence's K/V bytes received per rank; backward K and V again and their fp32
  gradient accumulators dK, dV cp steps (``ring_bytes``, ``ring_seconds``). A sliding
  window that leaves some ranks' blocks unseen by others moves only the blocks seen
  (``parallel.context.ring_attention.kv_transfers``, ``_ring_counts``).
- All-to-all context parallelism (Jacobs et al. 2023, DeepSpeed-Ulysses; the engine's
  ``parallel.context.ulysses``), per block and pass: two all-to-alls over the A ranks of a
  head group (q, k, v in one, the output in the other; backward their gradients), each
  sending (A - 1) / A of
  the rank's tensor, on the critical path (``ulysses_bytes``, ``ulysses_seconds``); the
  hybrid's ring then passes K/V across the cp / A head groups as above.
- Expert parallelism (Lepikhin et al. 2020, GShard; the engine's ``parallel.experts``): per
  MoE block and micro-batch, dispatch and combine all-to-alls of the rank's T k token
  copies, (ep - 1) / ep of them leaving the rank (``all_to_all_bytes``).
- Data parallelism after the flush: ZeRO-0 all-reduce, ZeRO-1/2 reduce-scatter + parameter
  all-gather, over dp x cp (the dense weights) and (dp / ep) x cp (the experts)
  (``dp_seconds``); a tied embedding's all-reduce between the first and last pipeline ranks
  (``tied_seconds``). ZeRO-3's collectives are inside every micro-batch
  (``costs.zero3_seconds``).
- Pipeline transfers: a micro-batch's activation (``p2p_bytes``); Megatron-LM's blocking
  sends with their scatter/gather (Narayanan et al. 2021, sec. 4.1: ``blocking_p2p``,
  ``megatron_send_seconds``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from shardwise.base.config import V_SHAPED_KINDS
from shardwise.planner.hardware import Cluster, Link
from shardwise.planner.layout import Layout
from shardwise.planner.memory import (
    BYTES,
    lora_rank_params,
    padded_vocab,
    rank_expert_params,
    rank_params,
)
from shardwise.planner.specs import ModelSpec


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


class DpSeconds(NamedTuple):
    """A rank's data-parallel seconds (``dp_seconds``)."""

    after: float
    """Seconds of dp collectives after the flush (ZeRO-0 all-reduce, ZeRO-1/2 reduce-scatter
    and all-gather; 0 for ZeRO-3, whose collectives are inside every micro-batch's forward
    and backward: ``zero3_seconds``, ``ChunkCost.dp``)."""


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
    2 mb (s / cp) k e / t (k = ``ring_kv_width``); in the hybrid those of its head group's
    share of the heads over the tokens it gathered, the same bytes with the key/value
    heads repeated up to the all-to-all degree (``_heads``)."""
    if lay.cp_a2a > 1:
        _, kv = _heads(spec, lay)
        d = spec.attn_width // spec.n_head
        return 2 * lay.micro_batch_size * (spec.block_size // lay.cp) * kv * d * e
    kw = ring_kv_width(spec)
    return 2 * lay.micro_batch_size * (spec.block_size // lay.cp) * kw * e / lay.tp


def _heads(spec: ModelSpec, lay: Layout) -> tuple[int, int]:
    """Query and key/value heads of a tensor-parallel rank going into the all-to-all, the
    key/value ones repeated up to its degree where fewer (``parallel.context.ulysses``)."""
    return spec.n_head // lay.tp, max(spec.kv_heads // lay.tp, lay.cp_a2a, 1)


def ulysses_bytes(spec: ModelSpec, lay: Layout, e: int) -> float:
    """Bytes one rank's all-to-alls send per block and pass (forward; backward the same):
    (A - 1) / A of its q, k, v and output, mb (s / cp) d (2 H + 2 Hkv) e / t-rank heads
    (``_heads``), A = ``Layout.cp_a2a``; 0 under the ring alone."""
    A = lay.cp_a2a
    if A == 1:
        return 0.0
    h, kv = _heads(spec, lay)
    d = spec.attn_width // spec.n_head
    tok = lay.micro_batch_size * (spec.block_size // lay.cp)
    return (A - 1) / A * tok * d * (2 * h + 2 * kv) * e


def ulysses_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, e: int) -> float:
    """Seconds of one block's two all-to-alls in one pass on one rank (``ulysses_bytes``:
    q, k and v to heads in one call, the output back to the sequence in another, as
    ``parallel.context.ulysses`` sends them; ``Link.all_to_all`` each), on the link its head
    group crosses (A x tp consecutive ranks), not overlapped: attention waits for them."""
    A = lay.cp_a2a
    if A == 1:
        return 0.0
    h, kv = _heads(spec, lay)
    one = lay.micro_batch_size * (spec.block_size // lay.cp) * (spec.attn_width // spec.n_head) * e
    link = cluster.link(lay.tp * A)
    return link.all_to_all(A, one * (h + 2 * kv)) + link.all_to_all(A, one * h)


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
    if lay.cp_ring == 1:
        return RingBytes(0.0, 0.0)
    kv = ring_block_bytes(spec, lay, e)
    counts = _ring_counts(spec.attention_windows, spec.block_size, lay.cp_ring)
    return RingBytes(max(n * kv for n, _, _, _ in counts),
                     max(n * kv + m * kv * 4 / e for n, _, m, _ in counts))


def ring_messages(spec: ModelSpec, lay: Layout) -> tuple[float, float]:
    """Messages one rank sends round the cp ring per block, ``(forward, backward)``
    (``_ring_counts``: the K/V messages, and backward those again and the dK/dV ones), for
    the slowest rank; (0, 0) without a ring."""
    if lay.cp_ring == 1:
        return 0.0, 0.0
    counts = _ring_counts(spec.attention_windows, spec.block_size, lay.cp_ring)
    return (max(n for _, n, _, _ in counts), max(n + m for _, n, _, m in counts))


def ring_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, e: int) -> RingSeconds:
    """Seconds of one block's ring traffic on one rank, ``RingSeconds(forward, backward)``,
    before any overlap (``ring_bytes``): each step one message to the next rank of the ring
    (``Link.p2p``), on the link the cp group crosses (cp x tp consecutive ranks); under a
    sliding window one message per hop distance the rank sends or receives over
    (``_ring_counts``), for the slowest rank."""
    if lay.cp_ring == 1:
        return RingSeconds(0.0, 0.0)
    link = cluster.link(lay.tp * lay.cp)
    blk = ring_block_bytes(spec, lay, e)
    kv, dkv = link.p2p(blk), link.p2p(blk * 4 / e)
    counts = _ring_counts(spec.attention_windows, spec.block_size, lay.cp_ring)
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
    if spec.lora:  # the base frozen: only the adapters' gradients are synced
        X, P = 0, lora_rank_params(spec, layers, lay.tp)
    link = cluster.link(lay.world)
    x = P * e
    nx = lay.dp // lay.ep * lay.cp  # the ranks holding the same experts (ep_dp x cp)
    if lay.zero == 0:  # ranks sharing cores: CPU work shared with them (comm_stretch)
        return DpSeconds(cluster.comm_stretch(n, lay.world) * link.all_reduce(n, x)
                         + cluster.comm_stretch(nx, lay.world) * link.all_reduce(nx, X * e))
    # HSDP: the shard's mean across replicas on the links the whole grid spans (inter-node
    # once it spans nodes); the shard group's own collectives on a replica's links
    mean = link.all_reduce(R, x * R / n) if R > 1 else 0.0
    if lay.zero == 3:  # its gathers and reduce-scatters are inside the schedule
        return DpSeconds(mean)
    n, inner = n // R, cluster.link(lay.world // R)
    return DpSeconds(mean + sharded_seconds(cluster, inner, n, x, lay.world)
                     + sharded_seconds(cluster, link, nx, X * e, lay.world))


def sharded_seconds(cluster: Cluster, link: Link, n: int, nbytes: float, world: int) -> float:
    """ZeRO-1/2's gradient reduce-scatter and parameter all-gather of ``nbytes`` (the whole
    vector) over ``n`` ranks on ``link``: the engine's ring (``comm.sharded``, "auto" off
    NCCL) of 2 (n - 1) steps, each a send to the next rank and a receive from the previous
    one. Where ranks share cores, the bytes' price is stretched as CPU work
    (``Cluster.comm_stretch``), and a step waits at least what the probe measured a cp
    ring message to take with the world on the cores (``Cluster.ring_message_s``: dedicated-
    core seconds, times ``Cluster.sharing``) in place of the profile's latency, which timed
    the ranks alone: at 8 ranks on 2 cores ``dp4 pp2 mb4 m1 1f1b`` measured 98-103 ms with
    ZeRO-1/2 against 86 ms with ZeRO-0's shared-memory all-reduce, which the profile's
    latency priced 3 ms the other way (``benchmarks/local_probe.py``)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    st = cluster.comm_stretch(n, world)
    both = link.reduce_scatter(n, nbytes) + link.all_gather(n, nbytes)
    steps = 2 * (n - 1)
    alpha = link.params(n).a(n)
    step = max(st * alpha, cluster.ring_message_s * cluster.sharing(world))
    return st * (both - steps * alpha) + steps * step


def tied_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str, r: int) -> float:
    """The all-reduce of a tied embedding's gradient between the first and last pipeline
    ranks (``r`` one of them, pp > 1; a V holds both on rank 0: none), else 0; where ranks
    share cores stretched as CPU work shared with the others (``Cluster.comm_stretch``),
    as every other collective."""
    if lay.pp > 1 and spec.tie_weights and r in (0, lay.pp - 1) \
            and lay.schedule not in V_SHAPED_KINDS:
        return cluster.comm_stretch(2, lay.world) * cluster.link(
            lay.tp * lay.cp * lay.pp).all_reduce(
            2, padded_vocab(spec.vocab_size, lay.tp) * spec.n_embd / lay.tp * BYTES[precision])
    return 0.0


def p2p_bytes(spec: ModelSpec, lay: Layout, e: int) -> float:
    """Bytes of one pipeline transfer: a micro-batch's activation (s / cp tokens; / t
    under sequence parallelism)."""
    return (lay.micro_batch_size * (spec.block_size // lay.cp) * spec.n_embd * e
            / (lay.tp if lay.sp else 1))


def p2p_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, e: int) -> float:
    """Seconds of one pipeline transfer that does not block compute (``p2p_bytes`` on the
    link the stages cross, ``Link.p2p``), where ranks share cores stretched as CPU work
    shared with the others (``Cluster.comm_stretch``); 0 at pp = 1 or with blocking sends
    (``megatron_send_seconds`` prices those)."""
    if lay.pp == 1 or blocking_p2p(cluster, lay):
        return 0.0
    return (cluster.comm_stretch(2, lay.world)  # CPU work shared with the other ranks
            * cluster.link(lay.tp * lay.cp * lay.pp).p2p(p2p_bytes(spec, lay, e)))


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
