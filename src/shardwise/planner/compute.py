"""Compute prices of the planner: FLOPs and seconds of a block's forward, of the attention
core, the LM head and the optimizer, on one rank.

Forward FLOPs per block and micro-batch of b sequences 24 b s h^2 + 4 b s^2 h (Narayanan et
al. 2021, sec. 5.1), generalised to any width, grouped-query and latent attention, gated
MLPs and mixtures of experts (``block_flops``, ``block_ops``); the LM head 2 b s h V;
backward twice the forward; all divided by tp. Seconds: FLOPs / (peak x efficiency) + a fixed
overhead per block pass, or under the per-operation model (``hardware.OpModel``) each GEMM
at the efficiency of its size and each memory-bound kernel by the bytes it moves
(``op_seconds``).

Context parallelism: a rank holds s / cp tokens of each sequence, so every per-token GEMM
and kernel runs on s / cp tokens and its attention on its queries against the keys it sees
(``attention_keys``: all s, causal chunks load-balanced; under a sliding window the slowest
rank's scored pairs).

FP8 (``Layout.fp8``): the block's linear-layer GEMMs at the FP8 tensor-core peak (twice the
bf16 one: the H100 datasheet's 1,979 dense TFLOP/s) on a cluster that has one
(``Cluster.fp8_flops``), the attention core, the head and every memory-bound kernel as
before (Transformer Engine's recipe: FP8 for the linear layers only; Micikevicius et al.
2022, "FP8 formats for deep learning"). Memory is priced as bf16.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from shardwise.planner.attention import FUSED_PAIR
from shardwise.planner.hardware import Cluster
from shardwise.planner.layout import Layout
from shardwise.planner.memory import (
    lora_rank_params,
    padded_vocab,
    rank_expert_params,
    rank_params,
    written_score_bytes,
)
from shardwise.planner.specs import ModelSpec, active_matmul_params


class Ops(NamedTuple):
    """One block's forward as operations (``block_ops``; ``op_seconds`` prices them)."""

    gemms: list[float]
    """FLOPs of each GEMM, in the block's order (``gemms[1:3]``: the attention core's)."""
    moves: list[float]
    """Bytes each memory-bound operation reads and writes."""


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


def head_seconds(spec: ModelSpec, mb: int, tp: int, cluster: Cluster, e: int,
                 cp: int = 1) -> float:
    """The LM head's forward under the per-operation model: its GEMM 2 T h V / t, the final
    norm, and the vocabulary-parallel cross entropy reading the logits three times (max,
    exp-sum, loss) in fp32."""
    T, h = mb * spec.block_size // cp, spec.n_embd
    V = padded_vocab(spec.vocab_size, tp) / tp
    return (cluster.ops.gemm(2 * T * h * V) + cluster.ops.memory(2 * T * h * e)
            + cluster.ops.memory(3 * T * V * 4))


def optimizer_seconds(spec: ModelSpec, lay: Layout, cluster: Cluster, layers: list[int]) -> float:
    """AdamW over this rank's masters: ~40 bytes of memory traffic per element, or where it
    was measured (``Cluster.optimizer_param_s``, local: the engine's host step on the
    planned model's block, ``hardware.optimizer_step_seconds``) its seconds per element on
    one core, slowed as compute is where ranks share the cores; and the host's seconds per
    step (``Cluster.step_s``: on a GPU ``hardware.STEP_S``, on local
    ``hardware.host_seconds``'s, shared like the rest), measured.""" 
    P = rank_params(spec, layers, lay.tp, lay.pp, lay.ep)
    if spec.lora:  # LoRA: the adapters' masters only, sharded over dp x cp under ZeRO
        P = lora_rank_params(spec, layers, lay.tp) / (
            lay.dp // lay.dp_replicate * lay.cp if lay.zero else 1)
    elif lay.zero:
        X = rank_expert_params(spec, layers, lay.tp, lay.ep)
        P = ((P - X) / (lay.dp // lay.dp_replicate * lay.cp)
             + X / (lay.dp // lay.ep * lay.cp))  # as memory_of
    share = cluster.sharing(lay.world)
    if cluster.optimizer_param_s:  # local: measured, and its host seconds a step
        # (hardware.host_seconds) on the shared cores too
        return (cluster.optimizer_param_s * P + cluster.step_s) * share
    return 40 * P / cluster.mem_bw * share + cluster.step_s
