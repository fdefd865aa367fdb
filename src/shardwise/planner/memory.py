"""The one memory model of ``shardwise plan`` and ``shardwise memory``: bytes per GPU.

Static bytes (parameters, gradients, optimizer states) per rank:

- for a model at sizes the meta device builds in milliseconds (any kind: the spec's
  ``ModelSpec.model()``, its own description or the registered kind of its family), exactly
  ``engine.memory.predict_rank`` (the rank's model built on the meta device, packed into
  the buckets or units the dp sync uses; ``tests/test_layouts.py`` holds it equal to the
  bytes real ranks hold), maximised over the pipeline and tensor-parallel ranks;
- for named sizes (GPT-2 ... 1T) the closed forms below, which count the same parameters
  (``tests/test_planner.py`` checks them against ``predict_rank`` on small configs):
  per block 12h^2/t + 6h/t (sharded Q, K, V, out, fc, proj and their column biases) +
  2h (out and proj biases) + 4h (LayerNorms); the embedding V_pad h / t + s h; the head
  2h + (V_pad h / t unless it is the embedding's own parameter), V_pad = V rounded up to a
  multiple of t. Stages get layers as ``pipeline.partition.balanced`` cuts them. A Llama
  (``specs.ModelSpec.family``) has per block (2h^2 + 2 h k + 3 h f)/t + 2h (k = key/value
  heads x head width, f the SwiGLU width; RMSNorm weights whole, no biases), no position
  table and an untied head; ``tests/test_llama_planner.py`` checks the counts against
  ``models.llama`` and the published totals.
- for a spec made from a description (``plan --model run.toml``: any kind) the elements of
  each layer as the engine shards it on meta (``specs.described_layers``), summed over the
  layers a rank holds: no closed form of a family is assumed.
- bytes per element from the parameter count P of the rank (Rajbhandari et al. 2020, sec. 3;
  b = 2 for bf16/fp16, 4 for fp32, K = 12 bytes of fp32 master + Adam moments, or 8 in fp32
  where the master is the parameter):  ZeRO-0 (2b + K) P;  ZeRO-1 2b P + K P/dp;
  ZeRO-2 b P + (b + K) P/dp;  ZeRO-3 (b + K) P/dp (+ b P/dp unless fp32), and at the
  peak its gathered units (``gathered_bytes``, not a static byte: ``memory_of`` adds it).
  With a pipeline the same hold for the rank's chunks (ZeRO-3: each chunk sharded apart,
  v per rank with the interleaved schedule).
- context parallelism (cp ranks per sequence) changes no parameter count; ZeRO shards over
  every replica of the weights, dp x cp (``engine.memory.predict_rank(cp=)``).
- HSDP (``dp_replicate`` = R replicas of dp / R ranks): ZeRO 1-3 shard the dense parameters
  over one replica, so read dp / R for dp in the formulas above (the state shrinks by
  dp_shard, not by dp); the experts' shards span the replicas as before.
- a mixture of experts (``specs.ModelSpec.n_experts``): per block the router E h (whole on
  every rank; so is a shared expert's gate, h), a shared expert's 3 h F_s / t, and the
  experts' 3 h F E / (t ep) on a rank of ep expert-parallel ranks
  (``parallel.experts.shard``: E / ep experts, their width F split over tp); ZeRO shards
  the dense parameters over dp x cp and the expert ones over the (dp / ep) x cp ranks that
  hold the same experts (``ep_dp_cp``, the group their gradients are reduced over).

Activation bytes per layer and micro-batch follow Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", sec. 4, Table 2): s b h (R + S/t) +
A a s^2 b / t, with R the bytes per token and width kept whole under tensor parallelism, S
those split over t, and A the attention-score term. Two implementations are described:

- ``MEGATRON``: the paper's fp16 numbers with dropout: R = 10, S = 24, A = 5; with sequence
  parallelism R moves into S (34/t); full recomputation keeps 2 s b h (the block input) of
  every block and recomputes one block at a time; selective recomputation drops A.
- ``SHARDWISE``: this repository's GPT, measured with the executor's activation meter: no
  dropout masks, flash-style attention on CPU (no s^2 scores, a log-sum-exp of 2 fp32 values
  per head and token), e values per byte: R = 4e (block input, its LayerNorm output, the
  second LayerNorm's input and output), S = 12e (Q, K, V, attention output, fc output, GELU
  output); under sequence parallelism the two all-gathered LayerNorm outputs stay whole.
  A mixture of experts (counted, not measured) keeps per token, for each of its k experts,
  the expert's gate, up, silu and product (4 F e, F split over tp) and the dispatched input
  and combined output (2 h e, whole), in place of the dense MLP's; under sequence
  parallelism those 2 k h e are the whole sequence's on every tp rank (the mixture runs on
  the all-gathered sequence, docs/moe.md), while its input and output outside are / t.
- compiled (``compiled_model``: blocks and loss under ``torch.compile``, what the GPU presets
  price, ``hardware.Cluster.compiled``): what AOTAutograd's partitioner saves, counted with
  ``saved_tensors_hooks`` on a GPT and a Llama (``tests/test_planner_compiled_memory.py``):
  the GPT's R and S as eager, the Llama's R = 4e with SwiGLU's gate, up and product (3 f e,
  the SiLU recomputed) and one copy of the RMSNorms' input (eager keeps an fp32 copy and the
  normalised output beside it); the norms' fp32 statistics, the log-sum-exp 4 bytes per
  head and token; the head keeps the bf16 logits (the compiled loss recomputes the fp32
  softmax from them), and at the peak their gradient beside them (``logits_grad_bytes``).

Context parallelism: every per-token term is over the ``s / cp`` tokens a rank holds
(Korthikanti's 34 s b h falls to 34 s b h / cp); expert parallelism moves no activation
(each rank runs k assignments per token it holds, balanced routing).

A pipeline rank holds the activations of ``in_flight`` micro-batches of its chunks (1F1B:
min(p - r, m); interleaved: Narayanan et al.'s warm-up count, GPipe: m); with recompute it
holds each chunk's input per micro-batch in flight, and at its peak one chunk recomputed in
full plus one held input. ZeRO-3 (any pp and v: each chunk a ZeRO-3 module of its own) also
holds, at its peak, the units it has gathered (``gathered_bytes``), counted apart from the
activations (the executor's meter counts the weights saved for backward of units whose
storage ZeRO-3 frees after forward, so its reading is not an activation figure;
``tests/test_planner.py`` leaves ZeRO-3 out of the activation comparison).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from shardwise.parallel.pipeline.partition import balanced
from shardwise.base.config import SPLIT_BACKWARD_KINDS, V_SHAPED_KINDS
from shardwise.parallel.pipeline.check import check
from shardwise.parallel.pipeline.schedules import placement_of, schedule as build_schedule
from shardwise.parallel.pipeline.schedules import warmup_forwards
from shardwise.planner.specs import (
    ModelSpec,
    block_matmul_params,
    block_params,
    described_layers,
)

MiB, GiB = 2 ** 20, 2 ** 30
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def unit_for(nbytes: float, decimal: bool = False) -> tuple[str, float]:
    """The unit a person reads ``nbytes`` in, and its size in bytes: binary, as every size
    in shardwise (``parallel.bucket_mb`` is MiB, device memory is GiB): ("GiB", 2**30) from
    1 GiB, else ("MiB", 2**20). ``decimal=True``: ("GB", 1e9) / ("MB", 1e6), only for
    reproducing a paper's table printed in decimal units (the ZeRO paper's, Rajbhandari et
    al. 2020, figure 1). Tables print every number of one table in one unit, named in the
    header."""
    if decimal:
        return ("GB", 1e9) if nbytes >= 1e9 else ("MB", 1e6)
    return ("GiB", GiB) if nbytes >= GiB else ("MiB", MiB)


def padded_vocab(V: int, tp: int) -> int:
    """Vocabulary ``V`` rounded up to a multiple of ``tp`` (each rank holds an equal slice)."""
    return -(-V // tp) * tp


def layer_weights(spec: ModelSpec, by: str = "layers") -> list[float]:
    """The weights ``pipeline.partition.partition_layers`` gives the GPT's layers: 1 each
    ("layers"), or each layer's parameter count ("params": the tied head counts the
    embedding matrix again, as its ``parameters()`` include it)."""
    L, h, V = spec.n_layer, spec.n_embd, spec.vocab_size
    if by == "layers":
        return [1.0] * (L + 2)
    if by != "params":
        raise ValueError(f"partition {by!r}: the planner models layers or params")
    if spec.description is not None:
        return [float(n) for n in described_layers(spec, 1).counts]
    ln = 2 * h if spec.bias else h
    blocks = [float(block_params(h, spec.bias, spec.part("moe" if spec.is_moe_block(i)
                                                          else "dense") if spec.mixed else spec))
              for i in range(L)]
    return [float(V * h + spec.pos_params)] + blocks + [float(ln + V * h)]


@lru_cache(maxsize=1024)
def cut(spec: ModelSpec, n_chunks: int, by: str = "layers"):
    """The ``Partition`` of the GPT's layers into ``n_chunks`` chunks, as the engine cuts
    (memoised: a search asks for the same few cuts thousands of times)."""
    return fast_balanced(layer_weights(spec, by), n_chunks)


def fast_balanced(weights: list[float], parts: int):
    """``pipeline.partition.balanced``'s cut, computed with one numpy step per part instead
    of a Python loop per (part, end, start): the same dynamic program (the smallest largest
    part; ties to the earliest cut), for whole-number weights (layer counts, parameter
    counts, all sums below 2**53: every cost exact, so the first minimum is the cut the
    Python loop keeps). Other weights go to ``balanced`` itself."""
    import numpy as np

    from shardwise.parallel.pipeline.partition import Partition

    n = len(weights)
    w = np.asarray(weights, dtype=np.float64)
    if (parts < 1 or parts > n or not np.all(w == np.round(w)) or np.any(w < 0)
            or w.sum() >= 2.0 ** 53):
        return balanced(weights, parts)
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    inf = np.inf
    best = np.full(n + 1, inf)
    best[0] = 0.0
    cuts = np.zeros((parts + 1, n + 1), dtype=np.int64)
    idx = np.arange(n + 1)
    for k in range(1, parts + 1):
        lo, hi = k, n - (parts - k)  # ends j in lo..hi, as balanced() visits them
        js = idx[lo:hi + 1]
        # cost[j, i] = max(best[i], prefix[j] - prefix[i]) for k-1 <= i < j, else inf
        cost = np.maximum(best[None, :], prefix[js, None] - prefix[None, :])
        cost[(idx[None, :] >= js[:, None]) | (idx[None, :] < k - 1)] = inf
        arg = np.argmin(cost, axis=1)
        nxt = np.full(n + 1, inf)
        nxt[js] = cost[np.arange(len(js)), arg]
        cuts[k, js] = arg
        best = nxt
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(int(cuts[k, bounds[-1]]))
    bounds.reverse()
    pf = prefix.tolist()
    costs = tuple(pf[bounds[i + 1]] - pf[bounds[i]] for i in range(parts))
    return Partition(tuple(bounds), costs)


def stage_layers(spec: ModelSpec, pp: int, v: int = 1, by: str = "layers",
                 schedule: str = "1f1b") -> list[list[int]]:
    """Per pipeline rank, the layer indices it holds (0: embedding, 1..L: blocks, L+1:
    head), chunk c on rank c % pp (zbv: its V, ``schedules.placement_of``), cut as the
    engine cuts (``cut``)."""
    part = cut(spec, pp * v, by)
    out: list[list[int]] = [[] for _ in range(pp)]
    for c, r in enumerate(placement_of(schedule, pp, v)):
        out[r] += list(part.layers(c))
    return out


def rank_params(spec: ModelSpec, layers: list[int], tp: int, pp: int, ep: int = 1) -> int:
    """Elements of the parameters a (pipeline, tensor, expert) rank holding ``layers`` keeps
    (memoised per layer set; for the closed forms per count of blocks and whether the
    embedding and the head are among them, all they read)."""
    if spec.description is None and spec.mixed:  # the dense blocks as a dense model's
        L = spec.n_layer
        dense = tuple(i for i in layers if 1 <= i <= L and not spec.is_moe_block(i - 1))
        rest = tuple(i for i in layers if i not in dense)
        return (_rank_params(spec.part("moe"), rest, tp, pp, ep)
                + _rank_params(spec.part("dense"), dense, tp, pp, ep))
    if spec.description is None:
        L = spec.n_layer
        emb, head = 0 in layers, L + 1 in layers
        return _closed_params(spec, len(layers) - emb - head, emb, head, tp, pp, ep)
    return _rank_params(spec, tuple(layers), tp, pp, ep)


@lru_cache(maxsize=65536)
def _closed_params(spec: ModelSpec, nb: int, emb: bool, head: bool, tp: int, pp: int,
                   ep: int) -> int:
    layers = ([0] if emb else []) + list(range(1, nb + 1)) + ([spec.n_layer + 1] if head else [])
    return _rank_params(spec, tuple(layers), tp, pp, ep)


def rank_expert_params(spec: ModelSpec, layers: list[int], tp: int, ep: int = 1) -> int:
    """Of ``rank_params``, the expert elements (E / ep experts of each block with the
    mixture, their width split over tp); 0 for a dense model."""
    if not spec.moe:
        return 0
    blocks = sum(1 for i in layers if 1 <= i <= spec.n_layer and spec.is_moe_block(i - 1))
    if spec.description is not None:
        t = described_layers(spec, tp)
        return sum(t.experts[i] for i in layers) // ep
    return blocks * spec.expert_params // (tp * ep)


@lru_cache(maxsize=65536)
def _rank_params(spec: ModelSpec, layers: tuple[int, ...], tp: int, pp: int,
                 ep: int = 1) -> int:
    L, h = spec.n_layer, spec.n_embd
    if spec.description is not None:  # counted on meta, as the engine shards it
        t = described_layers(spec, tp)
        both = 0 in layers and L + 1 in layers  # one rank, one tied matrix
        n = sum(t.counts[i] for i in layers) - (t.tied if both else 0)
        if ep > 1 and t.experts:
            n -= sum(t.experts[i] for i in layers) * (ep - 1) // ep
        return n
    Vp = padded_vocab(spec.vocab_size, tp)
    bias = spec.bias
    # column biases (Q, V, MLP in) split, row biases (out, MLP out) and norms whole
    col_bias = h + spec.kv_heads * (h // spec.n_head) + (2 if spec.gated else 1) * spec.ffn
    per_block = block_params(h, bias, spec) if tp == 1 else (
        block_matmul_params(spec) // tp + (col_bias // tp + 2 * h + 4 * h if bias else 2 * h))
    if spec.moe:  # attention (and a shared expert) / t, the router and a shared expert's
        # gate whole, E / ep experts of width F / t, norms
        whole = spec.n_experts * h + spec.shared_gate_params
        attn = block_matmul_params(spec) - spec.expert_params - whole
        per_block = (attn // tp + whole + spec.expert_params // (tp * ep)
                     + (col_bias // tp + 6 * h if bias else 2 * h))
    n, emb, head = 0, 0 in layers, L + 1 in layers
    n += sum(per_block for i in layers if 1 <= i <= L)
    if emb:
        n += Vp * h // tp + spec.pos_params
    if head:
        n += (2 * h if bias else h) + (0 if spec.tie_weights and emb else Vp * h // tp)
    return n


def zero_bytes(P: float, dp: int, zero: int, precision: str, state_bytes: int = 8,
               offload: str = "none") -> dict:
    """Bytes of params, grads and optimizer for P parameter elements on one rank (no
    padding: shards are ceil(P / dp)); ``state_bytes``: AdamW's two moments per element (8
    in fp32, 4 with ``optimizer.state_dtype = "bf16"``). ``offload`` (``training.offload``):
    ``host`` the bytes in host memory (the optimizer's, masters of their own even in fp32;
    with "optimizer+params", ZeRO-3 only, its parameter shards too), the device holding
    ``total - host``. Raises ValueError for "optimizer+params" without ZeRO-3."""
    if offload == "optimizer+params" and zero != 3:
        raise ValueError(f"training.offload=optimizer+params with parallel.zero={zero}: "
                         "ZeRO-3 only")
    b = BYTES[precision]
    S = -(-int(P) // dp)
    master = 0 if b == 4 and offload == "none" else 4
    if zero == 0:
        out = {"params": b * P, "grads": b * P, "optimizer": (state_bytes + master) * P}
    elif zero == 1:
        out = {"params": b * P, "grads": b * P, "optimizer": (state_bytes + master) * S}
    elif zero == 2:
        out = {"params": b * P, "grads": b * S, "optimizer": (state_bytes + master) * S}
    else:  # fp32: the master is what is gathered (on the host with "optimizer+params")
        out = {"params": 0 if b == 4 and offload != "optimizer" else b * S, "grads": b * S,
               "optimizer": (state_bytes + master) * S}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    out["host"] = (0 if offload == "none" else out["optimizer"]) + (
        out["params"] if offload == "optimizer+params" else 0)
    return out


# Below this many parameters the planner builds the model on the meta device (exact,
# with bucket padding); above, the per-layer counts (equal up to that padding).
EXACT_LIMIT = 50_000_000


@lru_cache(maxsize=256)
def _rank_model(spec: ModelSpec, pp: int, pp_rank: int, tp: int, tp_rank: int, v: int,
                sequence_parallel: bool, partition: str, ep: int, schedule: str, lora: bool):
    """``engine.memory.rank_model`` of ``spec`` at (pp_rank, tp_rank), memoised: the exact
    path below prices every dp, cp, ZeRO stage and HSDP split of a rank on the one model
    the engine builds there (a meta build is ~40 ms; the 4 x 128 GPT's search on 8 GPUs
    asked for 318 of them, 15 of its 17 s). ep rank 0, as ``static_bytes`` reads dp rank 0."""
    from shardwise.engine.memory import rank_model

    return rank_model(spec.model(), pp=pp, pp_rank=pp_rank, tp=tp, tp_rank=tp_rank,
                      chunks_per_rank=v, sequence_parallel=sequence_parallel,
                      partition_by=partition, ep=ep, schedule=schedule,
                      lora=_lora_section(spec) if lora else None)


@lru_cache(maxsize=4096)
def static_bytes(spec: ModelSpec, dp: int, tp: int, pp: int, v: int, zero: int,
                 precision: str, sequence_parallel: bool = False,
                 bucket_mb: float = 25.0, partition: str = "layers", cp: int = 1,
                 ep: int = 1, dp_replicate: int = 1, schedule: str = "1f1b") -> dict:
    """The largest rank's static bytes ``{"params", "grads", "optimizer", "total"}``
    (over pipeline ranks, and tp ranks in the exact path; dp rank 0). ``cp``: ZeRO shards
    over dp x cp; ``ep``: the experts split over ep, sharded by ZeRO over (dp / ep) x cp;
    ``dp_replicate``: HSDP's replicas, the dense shards over (dp / dp_replicate) x cp;
    ``schedule``: for its chunk placement (zbv's V). With ``spec.lora`` (LoRA): gradients,
    shards and optimizer state of the adapters only (``lora_static_bytes``)."""
    if spec.lora:
        return lora_static_bytes(spec, dp, tp, pp, v, zero, precision, sequence_parallel,
                                 bucket_mb, partition, cp, ep, dp_replicate, schedule)
    # ZeRO-0 has no padding: the per-layer counts; ZeRO 1-3 pad buckets: build the rank
    if spec.params <= EXACT_LIMIT and zero > 0:
        # the engine (and a model) only here: planning a named size imports neither
        from shardwise.engine.memory import predict_rank

        d = spec.model()  # the spec's description, or its family's model of these sizes
        best = None
        for pr in range(pp):
            for tr in sorted({0, tp - 1}):
                r = predict_rank(d, dp=dp, pp=pp, tp=tp, pp_rank=pr, tp_rank=tr,
                                 chunks_per_rank=v, zero=zero, precision=precision,
                                 bucket_mb=bucket_mb, sequence_parallel=sequence_parallel,
                                 partition_by=partition, cp=cp, ep=ep,
                                 dp_replicate=dp_replicate, schedule=schedule,
                                 local=_rank_model(spec, pp, pr, tp, tr, v, sequence_parallel,
                                                   partition, ep, schedule, False))
                if best is None or r["total"] > best["total"]:
                    best = r
        return {k: best[k] for k in ("params", "grads", "optimizer", "total")}
    best = None
    for P, X in _stage_params(spec, pp, v, partition, tp, ep, schedule in V_SHAPED_KINDS):
        d = zero_bytes(P - X, dp // dp_replicate * cp, zero, precision)
        d.pop("host")  # no offload here
        if X:
            x = zero_bytes(X, dp // ep * cp, zero, precision)  # ep_dp x cp hold them
            d = {k: d[k] + x[k] for k in d}
        if best is None or d["total"] > best["total"]:
            best = d
    return best


def _lora_section(spec: ModelSpec):
    from shardwise.base.config import LoRAConfig

    return LoRAConfig(rank=spec.lora[0], targets=list(spec.lora[1]))


def lora_rank_params(spec: ModelSpec, layers: list[int], tp: int) -> int:
    """Adapter elements of a rank holding ``layers`` (``adapter_params`` per block among
    them): what a LoRA run (``spec.lora``) syncs and steps."""
    return adapter_params(spec, tp) * sum(1 <= i <= spec.n_layer for i in layers)


@lru_cache(maxsize=64)
def adapter_params(spec: ModelSpec, tp: int) -> int:
    """Adapter elements of one block on tp rank 0 (``spec.lora``; the model built on meta
    with its adapters, ``parallel.lora``, blocks taken alike: a named size's as one block,
    a described model's whole, the total over ``n_layer``)."""
    import torch

    from shardwise.engine.model import build_local_model
    from shardwise.parallel.tensor_parallel.group import RankGroup

    one = spec if spec.description is not None else replace(spec, n_layer=1)
    with torch.device("meta"):
        local = build_local_model(one.model(), pp=1, pp_rank=0, chunk_ids=[0], n_chunks=1,
                                  tp=RankGroup(size=tp, rank=0), seed=0, dropout_seed=0,
                                  device=torch.device("meta"), lora=_lora_section(spec))
    return sum(q.numel() for _, q in local.named_parameters()) // one.n_layer


@lru_cache(maxsize=4096)
def lora_static_bytes(spec: ModelSpec, dp: int, tp: int, pp: int, v: int, zero: int,
                      precision: str, sequence_parallel: bool = False,
                      bucket_mb: float = 25.0, partition: str = "layers", cp: int = 1,
                      ep: int = 1, dp_replicate: int = 1, schedule: str = "1f1b") -> dict:
    """``static_bytes`` of a LoRA run (``spec.lora``): the frozen base is b bytes an element
    in ``params`` (no gradient, master, moments or shard), the adapters count as any
    trainable parameter under ``zero``. Small models exactly (``predict_rank(lora=)``),
    larger ones from the per-layer counts plus ``adapter_params`` per block."""
    if spec.params <= EXACT_LIMIT:
        from shardwise.engine.memory import predict_rank

        best = None
        for pr in range(pp):
            for tr in sorted({0, tp - 1}):
                r = predict_rank(spec.model(), dp=dp, pp=pp, tp=tp, pp_rank=pr, tp_rank=tr,
                                 chunks_per_rank=v, zero=zero, precision=precision,
                                 bucket_mb=bucket_mb, sequence_parallel=sequence_parallel,
                                 partition_by=partition, cp=cp, ep=ep,
                                 dp_replicate=dp_replicate, schedule=schedule,
                                 lora=_lora_section(spec),
                                 local=_rank_model(spec, pp, pr, tp, tr, v, sequence_parallel,
                                                   partition, ep, schedule, True))
                if best is None or r["total"] > best["total"]:
                    best = r
        return {k: best[k] for k in ("params", "grads", "optimizer", "total")}
    best, L = None, spec.n_layer
    for layers in stage_layers(spec, pp, v, partition, schedule):
        a = adapter_params(spec, tp) * sum(1 for i in layers if 0 < i <= L)
        d = zero_bytes(a, dp // dp_replicate * cp, zero, precision)
        d.pop("host")  # no offload here
        d["params"] += BYTES[precision] * rank_params(spec, layers, tp, pp, ep)  # the base
        d["total"] = d["params"] + d["grads"] + d["optimizer"]
        if best is None or d["total"] > best["total"]:
            best = d
    return best


@lru_cache(maxsize=4096)
def _stage_params(spec: ModelSpec, pp: int, v: int, partition: str, tp: int,
                  ep: int, v_shaped: bool = False) -> tuple[tuple[int, int], ...]:
    """Of the pipeline ranks' (``rank_params``, ``rank_expert_params``), each distinct pair
    once, in the order of the first rank holding it: all ``static_bytes`` reads of the
    cut (a rank with the same pair has the same bytes; its maximum keeps the first),
    memoised for the dp, ZeRO and cp sizes that share it."""
    pairs: dict = {}
    for layers in stage_layers(spec, pp, v, partition, "zbv" if v_shaped else "1f1b"):
        pairs.setdefault((rank_params(spec, layers, tp, pp, ep),
                          rank_expert_params(spec, layers, tp, ep)), None)
    return tuple(pairs)


@lru_cache(maxsize=4096)
def gathered_bytes(spec: ModelSpec, dp: int, tp: int, pp: int, zero: int, precision: str,
                   partition: str = "layers", cp: int = 1, ep: int = 1, v: int = 1,
                   dp_replicate: int = 1) -> int:
    """Bytes of ZeRO-3's gathered units at the busiest pipeline rank's peak (0 for ZeRO
    0-2, whose parameters are whole in ``static_bytes`` already), in the compute dtype (b
    per element), each unit padded to a multiple of dp x cp as ``ZeroStage3`` pads it.
    ``v``: chunks per pipeline rank (the interleaved schedule); ``dp_replicate``: HSDP's
    replicas (dense units padded to (dp / dp_replicate) x cp, one replica's shard group).
    Follows ``parallel.zero.stage3``'s units and prefetch (the comments below say how); not
    counted: a unit's full-size gradients in backward before they are reduce-scattered
    (transient)."""
    if zero != 3 or spec.lora:  # LoRA: the frozen base is whole, the adapters' units small
        return 0
    n, b, L = dp // dp_replicate * cp, BYTES[precision], spec.n_layer
    nx = dp // ep * cp  # the ranks holding the same experts (ep > 1)
    ends = (0, L + 1)
    # the elements embedding and head share (a tied matrix), by inclusion-exclusion
    tied = (rank_params(spec, [0], tp, pp) + rank_params(spec, [L + 1], tp, pp)
            - rank_params(spec, list(ends), tp, pp))

    def pad(x: int, k: int = n) -> int:
        return -(-x // k) * k

    # A unit is a layer's own parameters (embedding, a block, the head). Before a layer runs
    # its units are gathered and the next unit's gather is launched (forward; in backward the
    # unit before it), so two neighbouring layers are whole at once. A weight tied across
    # pipeline stages is a unit of its own, gathered with its layer; one tied within the rank
    # (embedding and head on one rank) is the root unit, whole for the step. So: b (root +
    # max over neighbouring layers i, i+1 of the rank of their units' padded elements), one
    # layer alone where a rank holds just one. Where a layer is two units (its tied weight
    # and the rest) this counts the first unit of the next layer as the whole layer: at most
    # a LayerNorm (or a position table) more than the engine holds. Each chunk is a
    # ZeroStage3 of its own, prefetching only within itself, and a rank runs one chunk's
    # forward or backward at a time, its other chunks sharded meanwhile: with v chunks per
    # rank the peak is the largest chunk's (root + pair), the maximum over the pp v chunks.
    worst = 0
    if spec.description is None:  # a named size's blocks are alike (rank_params' closed
        # form): a chunk's units depend on its shape alone, one chunk of each shape counts,
        # and two blocks stand for any number (the same neighbouring pairs)
        chunks = [[0] * emb + list(range(1, min(nb, 2) + 1)) + [L + 1] * head
                  for emb, nb, head in chunk_shapes(spec, pp * v, partition)]
    else:
        part = cut(spec, pp * v, partition)
        chunks = [part.layers(c) for c in range(pp * v)]
    for layers in chunks:
        root = tied if all(i in layers for i in ends) else 0
        dense, expert = [], []
        for i in layers:
            split = tied if i in ends else 0  # the tied matrix: a unit of its own, or root's
            x = rank_expert_params(spec, [i], tp, ep) if ep > 1 else 0
            dense.append(pad(rank_params(spec, [i], tp, pp, ep) - split - x)
                         + (0 if root else pad(split)))
            expert.append(pad(x, nx))
        # With expert parallelism (ep > 1, ZeroStage3(expert_group=)) a block is two units,
        # in this order: its dense parameters D_i (padded to dp x cp) and this rank's E / ep
        # experts X_i (padded to the (dp / ep) x cp ranks holding them); each unit prefetches
        # the next one, in forward the one after it (running block i: D_i, X_i and D_{i+1}
        # whole), in backward the one before it (D_{i+1}, X_{i+1} and X_i). So the pair i,
        # i+1 holds X_i + D_{i+1} + max(D_i, X_{i+1}) (embedding and head: X = 0), and one
        # layer alone D + X. With ep = 1 the experts are part of their block's one unit.
        pair = max((xa + db + max(da, xb) for da, xa, db, xb
                    in zip(dense, expert, dense[1:], expert[1:])),
                   default=dense[0] + expert[0] if dense else 0)
        worst = max(worst, b * (pad(root) + pair))
    return worst


@dataclass(frozen=True)
class ActivationModel:
    """Bytes per token per unit of width of one block: ``replicated`` (kept whole under tp),
    ``sharded`` (split over tp), ``gathered_sp`` (of ``replicated``, what sequence parallelism
    still keeps whole); ``scores``: bytes per head per token per key of the attention scores
    (0 for flash attention); ``lse``: bytes per head per token (flash's log-sum-exp)."""

    name: str
    replicated: float
    sharded: float
    gathered_sp: float
    scores: float
    lse: float
    recompute_keep: float  # bytes per token per width kept per block under full recompute
    per_layer: bool = False  # recompute layer by layer (Megatron) rather than chunk by chunk
    stats: float = 0.0  # bytes per token of the norms' statistics (whole under tp, SP splits)


MEGATRON = ActivationModel("korthikanti2022-fp16-dropout", 10, 24, 0, 5, 0, 2, per_layer=True)


@lru_cache(maxsize=256)
def shardwise_model(precision: str, spec: ModelSpec | None = None,
                    ring: bool = False) -> ActivationModel:
    """The GPT's measured model (module docstring). For a Llama spec (not measured yet: a
    count of what autograd saves) S = e (2 w + 2 r w + 4 f / h): Q and the attention
    output, K and V, H D = w h wide (w = 1 but with a head_dim of its own; QK-norm's saved
    inputs not counted) (r = 1: the one-process path repeats them to all heads before the
    kernel; under ``ring`` attention, cp > 1, they are kept with their ``n_kv_heads``, r =
    kv_heads / n_head); gate, up, silu(gate) and their product, f wide each. Mixed dense
    and mixture blocks (``ModelSpec.mixed``): each coefficient the larger of the two
    kinds' (an upper bound on every block). A model whose attention writes its scores out
    (``ModelSpec.written_scores`` n > 0) at cp = 1 keeps, per head, token and key,
    ``written_score_bytes``. Gemma's sandwich norms (``ModelSpec.sandwich_norm``): each
    of the two more RMSNorms keeps its input and an fp32 copy, (e + 4) bytes a token and
    unit of width, whole under tp, split under SP (measured on a Llama block:
    ``tests/test_llama_planner.py``)."""
    e = BYTES[precision]
    if spec is not None and spec.sandwich_norm:
        plain = shardwise_model(precision, replace(spec, sandwich_norm=False), ring)
        return replace(plain, name=f"{plain.name}-sandwich",
                       replicated=plain.replicated + 2 * (e + 4))
    if spec is not None and spec.written_scores and not ring:
        fused = shardwise_model(precision, replace(spec, written_scores=0), ring)
        return replace(fused, name=f"{fused.name}-scores",
                       scores=written_score_bytes(spec.written_scores, e))
    if spec is not None and spec.mixed:  # every block counted at the larger of its kinds'
        a, b = (shardwise_model(precision, spec.part(k), ring) for k in ("moe", "dense"))
        keys = ("replicated", "sharded", "gathered_sp", "scores", "lse", "recompute_keep")
        return ActivationModel(f"shardwise-mixed-{precision}",
                               **{k: max(getattr(a, k), getattr(b, k)) for k in keys})
    r = spec.kv_heads / spec.n_head if ring and spec is not None else 1.0
    w = spec.attn_width / spec.n_embd if spec is not None else 1.0  # H D / h
    if spec is not None and spec.moe:  # a shared expert: 4 F_s / h more, as a SwiGLU's;
        # its gate: the whole-width output it scales (the (T, 1) sigmoid not counted)
        k, F, h = spec.top_k, spec.expert_ffn, spec.n_embd
        fs = k * F + spec.moe_shared_ffn
        return ActivationModel(f"shardwise-moe-{precision}",
                               e * (4 + 2 * k + (1 if spec.moe_shared_gate else 0)),
                               e * (2 * w + 2 * r * w + 4 * fs / h), e * (2 + 2 * k), 0,
                               8, e)
    if spec is not None and spec.gated:
        return ActivationModel(f"shardwise-llama-{precision}", 4 * e,
                               e * (2 * w + 2 * r * w + 4 * spec.ffn / spec.n_embd),
                               2 * e, 0, 8, e)
    return ActivationModel(f"shardwise-{precision}", 4 * e, 12 * e, 2 * e, 0, 8, e)


@lru_cache(maxsize=256)
def compiled_model(precision: str, spec: ModelSpec | None = None,
                   ring: bool = False) -> ActivationModel:
    """What a block saves for backward under ``torch.compile`` (the engine's
    ``training.compile``: each layer compiled, SDPA's flash kernel), counted with autograd's
    saved-tensor hooks (``tests/test_planner_compiled_memory.py``). The GPT: as eager (R =
    4e: block input, LayerNorm output, mid residual, second LayerNorm output; S = 12e: Q, K,
    V, attention output, fc and GELU outputs). The Llama: R = 4e (one copy of each RMSNorm's
    input and output, where eager keeps an fp32 copy as well), S = e (2 w + 2 r w + 3 f / h):
    Q, K, V (repeated to every head, r = 1; ring: kept with their ``n_kv_heads``), the
    attention output, SwiGLU's gate, up and their product (the SiLU recomputed). Both: the
    log-sum-exp, fp32 per head and token (4 bytes), and the norms' fp32 statistics (mean and
    rstd per LayerNorm, rstd per RMSNorm), per token. A model of another shape (experts,
    sandwich norms, written-out scores) is not counted compiled: its eager model."""
    e = BYTES[precision]
    if spec is not None and (spec.moe or spec.mixed or spec.sandwich_norm
                             or spec.written_scores):
        return shardwise_model(precision, spec, ring)
    if spec is not None and spec.gated:
        r = spec.kv_heads / spec.n_head if ring else 1.0
        w, f = spec.attn_width / spec.n_embd, spec.ffn / spec.n_embd
        return ActivationModel(f"shardwise-llama-compiled-{precision}", 4 * e,
                               e * (2 * w + 2 * r * w + 3 * f), 2 * e, 0, 4, e, stats=8)
    w, f = (spec.attn_width / spec.n_embd, spec.ffn / spec.n_embd) if spec else (1.0, 4.0)
    return ActivationModel(f"shardwise-compiled-{precision}", 4 * e, e * (4 * w + 2 * f),
                           2 * e, 0, 4, e, stats=16)


def block_model(precision: str, spec: ModelSpec, ring: bool = False,
                compiled: bool = False) -> ActivationModel:
    """The activation model of ``spec``'s blocks: ``compiled_model`` or the eager
    ``shardwise_model``."""
    return (compiled_model if compiled else shardwise_model)(precision, spec, ring)


def written_score_bytes(n: int, e: int) -> float:
    """Bytes per score element (one head, query and key) an attention that writes its
    scores out keeps for backward (``models.description.ModelDescription.written_scores``
    n > 0; e bytes a value): the fp32 softmax (4), the probabilities cast back (e, a tensor
    of their own only below fp32) and n - 1 more of the compute dtype. Counted with autograd's
    saved tensors on the Llama's block: 4 / 6 (fp32 / bf16) on the math path, 8 / 8 with
    Gemma 2's soft cap (``tests/test_llama_planner.py``)."""
    return 4 + (e if e < 4 else 0) + e * (n - 1)


def block_activation_bytes(am: ActivationModel, mb: int, s: int, h: int, a: int, tp: int,
                           sp: bool, keys: int | None = None) -> float:
    """Bytes one block saves for backward on one micro-batch of ``mb`` sequences of ``s``
    tokens each, their queries reading ``keys`` keys (default ``s``; a context-parallel
    rank's ``s`` tokens read the whole sequence's)."""
    keys = s if keys is None else keys
    sbh = s * mb * h
    rep = am.replicated
    if sp:
        rep = am.gathered_sp + (am.replicated - am.gathered_sp) / tp
    stats = am.stats * s * mb / (tp if sp else 1)
    return (sbh * (rep + am.sharded / tp) + stats
            + (am.scores * a * s * keys * mb + am.lse * a * s * mb) / tp)


def head_activation_bytes(spec: ModelSpec, mb: int, tp: int, precision: str,
                          cp: int = 1, compiled: bool = False) -> float:
    """Final LayerNorm input and output, logits and their log-softmax (vocab-split over tp),
    targets, for the ``block_size / cp`` tokens of each sequence a rank holds. ``compiled``
    (at tp = 1: the compiled loss, ``lm_loss_fp32``): the norm's input, output and fp32
    statistics, the logits in the compute dtype, two fp32 values per token (the loss's max
    and log-sum-exp) and the targets, counted with saved-tensor hooks; under tp the
    vocabulary-parallel loss's own function, counted as eager."""
    e, s, h = BYTES[precision], spec.block_size // cp, spec.n_embd
    V = padded_vocab(spec.vocab_size, tp) / tp
    if compiled and tp == 1:
        norm = 4 if spec.gated else 8  # RMSNorm: rstd; LayerNorm: mean and rstd (fp32)
        return mb * s * (2 * e * h + norm + e * V + 8 + 8)
    return mb * s * (2 * e * h + 2 * 4 * V + 8)


def logits_grad_bytes(spec: ModelSpec, mb: int, tp: int, precision: str, cp: int = 1,
                      compiled: bool = False) -> float:
    """Bytes the rank holding the head adds at its peak beyond what is saved: under
    ``compiled`` (tp = 1) the logits' gradient, in the compute dtype, which the compiled
    loss's backward writes while the logits it read are still held (the step's peak on the
    measured Llama-1B: benchmarks/planner_measured.py); 0 otherwise (the eager head's count
    already holds a vocabulary-wide fp32 gradient, ``head_activation_bytes``)."""
    if not compiled or tp > 1:
        return 0.0
    s = spec.block_size // cp
    return mb * s * BYTES[precision] * padded_vocab(spec.vocab_size, tp)


def in_flight(schedule: str, p: int, m: int, v: int, rank: int) -> int:
    """Micro-batches whose activations rank ``rank`` holds at once (per chunk it runs); for
    the zero-bubble schedules the checker's peak over their lists (F to W), per chunk."""
    if p == 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule in SPLIT_BACKWARD_KINDS:
        return -(-_split_peaks(schedule, p, m, v)[rank] // v)
    if v == 1:
        return min(p - rank, m)
    return -(-(warmup_forwards(p, m, v, rank) + 1) // v)


@lru_cache(maxsize=256)
def _split_peaks(schedule: str, p: int, m: int, v: int) -> tuple[int, ...]:
    return check(build_schedule(schedule, p, m, v)).peak_in_flight


@lru_cache(maxsize=256)
def chunk_blocks(spec: ModelSpec, n_chunks: int, partition: str) -> tuple[tuple[int, bool], ...]:
    """Per chunk of ``cut``: (blocks it holds, whether it holds the head)."""
    part, L = cut(spec, n_chunks, partition), spec.n_layer
    return tuple((sum(1 for i in part.layers(c) if 1 <= i <= L), L + 1 in part.layers(c))
                 for c in range(n_chunks))


@lru_cache(maxsize=256)
def chunk_shapes(spec: ModelSpec, n_chunks: int, partition: str) -> tuple[tuple[bool, int, bool], ...]:
    """The distinct (holds the embedding, blocks, holds the head) of ``cut``'s chunks, in
    the order of the first chunk of each."""
    return tuple(dict.fromkeys((c == 0, nb, head) for c, (nb, head)
                               in enumerate(chunk_blocks(spec, n_chunks, partition))))


@lru_cache(maxsize=65536)
def _repeated(x: float, n: int) -> float:
    """``x`` added ``n`` times one by one (``sum`` over a chunk's blocks: the exact float the
    recorded predictions hold), memoised across calls."""
    return sum(x for _ in range(n))


@lru_cache(maxsize=4096)
def rank_groups(spec: ModelSpec, pp: int, v: int, partition: str, schedule: str,
                micro_batches: int) -> tuple:
    """The pipeline ranks of ``activation_bytes``' maximum, one per distinct set of chunks
    (their ``chunk_blocks``, in order), each with the most micro-batches any rank of that
    set holds in flight: every peak grows with that count, so the others cannot be the
    largest (the search asks for thousands of layouts of one cut)."""
    chunks_of = chunk_blocks(spec, pp * v, partition)
    place = placement_of(schedule, pp, v)
    most: dict = {}
    for r in range(pp):
        key = tuple(chunks_of[c] for c in range(pp * v) if place[c] == r)
        most[key] = max(most.get(key, 0), in_flight(schedule, pp, micro_batches, v, r))
    return tuple((k, key) for key, k in most.items())


@lru_cache(maxsize=65536)
def activation_bytes(spec: ModelSpec, *, mb: int, tp: int, pp: int, micro_batches: int,
                     v: int = 1, schedule: str = "1f1b", sp: bool = False,
                     recompute: bool | str = False,
                     precision: str = "fp32", am: ActivationModel | None = None,
                     partition: str = "layers", selective: bool = False,
                     cp: int = 1, recompute_every: int = 1, a2a: int = 1,
                     offload: bool = False, compiled: bool = False) -> float:
    """Peak activation bytes of the busiest pipeline rank (``mb`` sequences per micro-batch,
    ``micro_batches`` micro-batches per step, ``v`` chunks per pipeline rank). Memoised (a
    search asks again for every ZeRO stage). ``selective``: the attention core is recomputed
    in backward (Korthikanti et al. 2022, sec. 5), so its s x s scores are not kept (the
    ``scores`` term; flash attention keeps none anyway). ``cp``: context-parallel ranks, each
    holding ``block_size / cp`` tokens of every sequence: every term is per token and cut by
    cp (ring attention keeps this rank's Q, K, V, output and log-sum-exp; measured 0.240 of
    cp = 1 at cp = 4, ``benchmarks/context_parallel.py``), except written-out scores, which
    are this rank's queries against all ``block_size`` keys, and K and V, which the ring
    keeps with their ``n_kv_heads`` where one process repeats them to all heads.
    ``recompute``: True (or ``"stage"``), the pipeline executor's stage-level recomputation;
    ``"full"``, the engine's per-block checkpointing of every ``recompute_every``-th block
    (``full_activation_bytes``); ``"selective"``, the engine's
    ``parallel.recompute = "selective"`` (``selective_activation_bytes``; the planner's
    ``selective``, Korthikanti's attention core, is another thing); False or ``"none"``:
    none. With the engine's model (``am`` None) the attention masks are added (``mask_bytes``; ``a2a``: the
    all-to-all degree, ``Layout.cp_a2a``): each micro-batch's in flight, or under
    recomputation one micro-batch's (built again for its backward). ``offload``
    (``parallel.activation_offload``, with recompute none or "full"): the device's part,
    ``full_activation_bytes(offload=True)``; the host's: ``offloaded_activation_bytes``.
    ``compiled``: the engine's ``training.compile`` (blocks and loss compiled:
    ``compiled_model``, ``head_activation_bytes(compiled=)`` and, on the rank with the head,
    ``logits_grad_bytes``), for no recomputation, "full" and the stage's; with ``am`` given
    it is that model's. Raises ValueError for offload with another recompute mode."""
    recompute = {"none": False, "stage": True}.get(recompute, recompute)
    if offload:
        if recompute not in (False, "full"):
            raise ValueError(f"activation offload with recompute={recompute!r}: not priced")
        return full_activation_bytes(spec, mb=mb, tp=tp, pp=pp, micro_batches=micro_batches,
                                     v=v, schedule=schedule, sp=sp, precision=precision,
                                     partition=partition, cp=cp, a2a=a2a, offload=True,
                                     every=recompute_every if recompute else spec.n_layer + 1)
    compiled = compiled and am is None
    if recompute == "full":
        return full_activation_bytes(spec, mb=mb, tp=tp, pp=pp, micro_batches=micro_batches,
                                     v=v, schedule=schedule, sp=sp, precision=precision,
                                     partition=partition, cp=cp, every=recompute_every,
                                     a2a=a2a, compiled=compiled)
    if recompute == "selective":
        return selective_activation_bytes(spec, mb=mb, tp=tp, pp=pp,
                                          micro_batches=micro_batches, v=v, schedule=schedule,
                                          sp=sp, precision=precision, partition=partition,
                                          cp=cp, a2a=a2a)
    per_mb, once = mask_bytes(spec, mb, precision, cp, a2a) if am is None else (0.0, 0.0)
    am = am or block_model(precision, spec, cp > 1, compiled)
    if selective and not recompute:
        am = replace(am, scores=0.0)
    s, h = spec.block_size // cp, spec.n_embd
    e = BYTES[precision]
    blk, groups = _rank_chunks(spec, am, mb, tp, pp, micro_batches, v, schedule, sp,
                               precision, partition, cp, compiled)
    keep = mb * s * h * e / (tp if sp else 1)
    grad = logits_grad_bytes(spec, mb, tp, precision, cp, compiled)
    worst = 0.0
    for k, nbs, largest, total_full, has_head in groups:
        if recompute and am.per_layer:  # Megatron: every block's input (2 s b h) kept for
            # each micro-batch in flight, one block recomputed in full at a time
            layer_keep = mb * s * h * am.recompute_keep / (tp if sp else 1)
            total = k * nbs * layer_keep + blk
        elif recompute:  # inputs of the micro-batches in flight; at the peak, one chunk is
            # recomputed in full while (measured) about one other input is still held
            total = max(largest + keep, k * v * keep)
        else:
            total = k * total_full
        worst = max(worst, total + (1 if recompute else k) * per_mb + once
                    + (grad if has_head else 0.0))
    return worst


def mask_bytes(spec: ModelSpec, mb: int, precision: str, cp: int = 1,
               a2a: int = 1) -> tuple[float, float]:
    """Bytes of the attention masks a rank keeps at cp = 1 (``planner.attention``): (per
    micro-batch: its ``mb`` sequences' document masks, ``block_causal``; once for all of
    them: the window bands without documents, the written-out causal triangle), SDPA's
    additive masks in ``precision``'s bytes, the written-out scores' bool. (0, 0) under
    a ring (it keeps no mask); under the all-to-all alone (``a2a`` = cp) the same as at
    cp = 1: each rank attends over whole sequences, its masks whole."""
    if cp > 1 and a2a < cp:
        return 0.0, 0.0
    calls = spec.attention_calls
    e = calls.mask_bytes or BYTES[precision]
    return mb * calls.document_mask * e, calls.shared_mask * e


def selective_block_bytes(spec: ModelSpec, mb: int, s: int, tp: int, sp: bool,
                          precision: str) -> float:
    """Bytes one block keeps for backward under the engine's selective recomputation
    (``parallel.activation_checkpoint``), per micro-batch of ``mb`` sequences of ``s``
    tokens, width h, e bytes a value; a count of what it keeps (``tests/test_recompute.py``
    holds it to malloc's count), in units of ``mb s h e``:

    - its input (the checkpoint's), 1 (1 / tp under SP);
    - the matmuls' and attention's outputs (torch's selective policy): Q, K, V and the
      attention output, w (2 + 2 r) with w = H D / h and r = kv_heads / n_head (the Llama;
      the GPT's Q K V is one 3-wide output, the same with r = 1), the MLP's first
      matrices, 4 (GPT) or 2 f / h (SwiGLU's gate and up), all split over tp; plus the
      attention's log-sum-exp, fp32 per head and token;
    - the two row-parallel outputs: at tp = 1 the matmuls' (1 each); at tp > 1 the
      reduced outputs the recomputation replays (``comm.replay``; the partial sums are not
      kept: ``tensor_parallel.mappings.linear_reduce``), 1 each, or 1 / tp each
      reduce-scattered under SP;
    - under SP, the two all-gathered inputs of the attention and the MLP, 1 each, whole.

    So 11 per block for the GPT at tp = 1 (16 without recomputation), 3 + 8 / tp at tp > 1,
    2 + 11 / tp with SP. Raises ``ValueError`` for a mixture of experts (not modelled)."""
    if spec.moe:
        raise ValueError("selective recomputation's activations: a mixture of experts is not "
                         "modelled (its grouped matmuls are recomputed, its all-to-alls kept)")
    e, h = BYTES[precision], spec.n_embd
    w = spec.attn_width / h
    if spec.gated:
        r = spec.kv_heads / spec.n_head
        sharded = w * (2 + 2 * r) + 2 * spec.ffn / h
    else:
        sharded = 4 * w + 4
    whole = (2 if sp else 0) + (1 + 2) / (tp if sp else 1)
    lse = 4 * spec.n_head / tp / (h * e)  # fp32 per head and token, in units of h e
    return mb * s * h * e * (whole + sharded / tp + lse)


def selective_activation_bytes(spec: ModelSpec, *, mb: int, tp: int, pp: int,
                               micro_batches: int, v: int = 1, schedule: str = "1f1b",
                               sp: bool = False, precision: str = "fp32",
                               partition: str = "layers", cp: int = 1,
                               a2a: int = 1) -> float:
    """``activation_bytes`` under the engine's selective recomputation: the busiest pipeline
    rank's micro-batches in flight times its chunks' bytes, a chunk's being its blocks'
    (``selective_block_bytes``, over the ``block_size / cp`` tokens a rank holds), the
    embedding's kept reduction at tp > 1 (its all-reduced output, ``mb s h e``, or
    reduce-scattered, / tp, under SP; at tp = 1 it keeps nothing of size), and the head's:
    its input (1, / tp under SP), under SP its all-gathered normalised input (1), the
    logits and their log-softmax, as without recomputation, and the logits once more (the
    projection's output, a matmul's, kept by the policy though the loss keeps only its
    softmax). The attention masks as ``activation_bytes`` adds them. Under cp the ring
    attention's
    per-block outputs are kept, one per ring step, so a block keeps about
    ``(cp + 1) / 2`` attention outputs instead of one (not counted here)."""
    e, h, s = BYTES[precision], spec.n_embd, spec.block_size // cp
    blk = selective_block_bytes(spec, mb, s, tp, sp, precision)
    emb = mb * s * h * e / (tp if sp else 1) if tp > 1 else 0.0
    head = (head_activation_bytes(spec, mb, tp, precision, cp)
            - mb * s * h * e * (2 - (1 / tp + 1 if sp else 1))
            + mb * s * e * padded_vocab(spec.vocab_size, tp) / tp)  # its logits, a matmul's
    per_mb, once = mask_bytes(spec, mb, precision, cp, a2a)
    chunks = chunk_blocks(spec, pp * v, partition)
    worst = 0.0
    for r in range(pp):
        mine = [r + i * pp for i in range(v)]
        total = sum(chunks[c][0] * blk + (head if chunks[c][1] else 0.0)
                    + (emb if c == 0 else 0.0) for c in mine)
        worst = max(worst, in_flight(schedule, pp, micro_batches, v, r) * total
                    + per_mb + once)  # masks: recomputed, one micro-batch's
    return worst


def full_block_bytes(spec: ModelSpec, mb: int, s: int, tp: int, sp: bool,
                     precision: str) -> float:
    """Bytes one block keeps for backward under the engine's full recomputation per block
    (``parallel.recompute = "full"``), per micro-batch of ``mb`` sequences of ``s`` tokens,
    width h, e bytes a value, in units of ``mb s h e``: its input, 1 (1 / tp under SP); at
    tp > 1 the outputs of its collectives, kept for the recomputation to replay
    (``comm.replay``): the two reduced row-parallel outputs, 1 each, or under SP 1 / tp each
    reduce-scattered plus the two all-gathered inputs of attention and MLP, 1 each. The cp
    ring's shifts run again (nothing kept); a mixture's all-to-all outputs are not
    counted."""
    e, h = BYTES[precision], spec.n_embd
    if tp == 1:
        units = 1.0
    else:
        units = 2 + 3 / tp if sp else 3.0
    return mb * s * h * e * units


def full_activation_bytes(spec: ModelSpec, *, mb: int, tp: int, pp: int,
                          micro_batches: int, v: int = 1, schedule: str = "1f1b",
                          sp: bool = False, precision: str = "fp32",
                          partition: str = "layers", cp: int = 1, every: int = 1,
                          a2a: int = 1, offload: bool = False,
                          compiled: bool = False) -> float:
    """``activation_bytes`` under the engine's full recomputation per block: on the busiest
    pipeline rank, per micro-batch in flight, each checkpointed block (its number among the
    model's blocks, from 1, divisible by ``every``) keeps ``full_block_bytes``, every other
    block what it keeps without recomputation (``block_activation_bytes``), the head as
    without recomputation; at the peak one checkpointed block recomputed whole (one
    micro-batch's ``block_activation_bytes``). Masks as ``activation_bytes`` adds them
    without recomputation (each micro-batch's in flight). ``offload``
    (``parallel.activation_offload``): a block not checkpointed keeps nothing on the device
    (its saved tensors wait on the host, ``offloaded_activation_bytes``), and at the peak one
    such block's are back (one micro-batch's ``block_activation_bytes``); ``every`` above
    ``n_layer``: no block checkpointed. ``compiled``: as ``activation_bytes``'."""
    am = block_model(precision, spec, cp > 1, compiled)
    s, h, a = spec.block_size // cp, spec.n_embd, spec.n_head
    keys = spec.attention_calls.written_keys if cp == 1 else spec.block_size
    blk = block_activation_bytes(am, mb, s, h, a, tp, sp, keys=keys)
    keep = full_block_bytes(spec, mb, s, tp, sp, precision)
    head = head_activation_bytes(spec, mb, tp, precision, cp, compiled)
    grad = logits_grad_bytes(spec, mb, tp, precision, cp, compiled)
    per_mb, once = mask_bytes(spec, mb, precision, cp, a2a)
    part, L = cut(spec, pp * v, partition), spec.n_layer
    worst = 0.0
    for r in range(pp):
        total, redo, peak = 0.0, 0.0, 0.0
        for c in (r + i * pp for i in range(v)):
            blocks = [i for i in part.layers(c) if 1 <= i <= L]
            ckpt = sum(1 for i in blocks if i % every == 0)
            total += ckpt * keep + (0.0 if offload else (len(blocks) - ckpt) * blk)
            total += head if L + 1 in part.layers(c) else 0.0
            peak = grad if L + 1 in part.layers(c) else peak
            redo = max(redo, blk if ckpt or (offload and blocks) else 0.0)
        k = in_flight(schedule, pp, micro_batches, v, r)
        worst = max(worst, k * (total + per_mb) + max(redo, peak) + once)
    return worst


def offloaded_activation_bytes(spec: ModelSpec, *, mb: int, tp: int, pp: int,
                               micro_batches: int, v: int = 1, schedule: str = "1f1b",
                               sp: bool = False, precision: str = "fp32",
                               partition: str = "layers", cp: int = 1,
                               recompute: str = "none", recompute_every: int = 1) -> float:
    """Host bytes of ``parallel.activation_offload`` on the busiest pipeline rank: per
    micro-batch in flight, each block not checkpointed (``recompute = "full"``: those whose
    number is not divisible by ``recompute_every``) its ``block_activation_bytes``. Counted
    once per tensor: ``save_on_cpu`` copies a tensor once per op saving it, the parameters
    too (measured on the tiny GPT of 2 blocks: 18% more, parameters 4% of that)."""
    am = shardwise_model(precision, spec, ring=cp > 1)
    s, h, a = spec.block_size // cp, spec.n_embd, spec.n_head
    keys = spec.attention_calls.written_keys if cp == 1 else spec.block_size
    blk = block_activation_bytes(am, mb, s, h, a, tp, sp, keys=keys)
    every = recompute_every if recompute == "full" else spec.n_layer + 1
    part, L = cut(spec, pp * v, partition), spec.n_layer
    worst = 0.0
    for r in range(pp):
        blocks = [i for c in (r + j * pp for j in range(v)) for i in part.layers(c)
                  if 1 <= i <= L and i % every]
        worst = max(worst, in_flight(schedule, pp, micro_batches, v, r) * len(blocks) * blk)
    return worst


@lru_cache(maxsize=4096)
def _rank_chunks(spec: ModelSpec, am: ActivationModel, mb: int, tp: int, pp: int,
                 micro_batches: int, v: int, schedule: str, sp: bool, precision: str,
                 partition: str, cp: int, compiled: bool = False) -> tuple[float, tuple]:
    """``activation_bytes``' pieces that recomputation does not change (memoised: the
    search asks with and without it): a block's bytes, and per ``rank_groups`` group (k
    micro-batches in flight, its blocks, its largest chunk's bytes, the sum of its
    chunks' bytes, whether it holds the head), a chunk's bytes being its blocks' added one
    by one (as a sum over the chunk's layers) and the head's."""
    s, h, a = spec.block_size // cp, spec.n_embd, spec.n_head
    # a rank's queries read all the sequence's keys; written scores: the engine's calls'
    keys = spec.attention_calls.written_keys if cp == 1 else spec.block_size
    blk = block_activation_bytes(am, mb, s, h, a, tp, sp, keys=keys)
    head = head_activation_bytes(spec, mb, tp, precision, cp, compiled)
    sums: dict = {}
    groups = []
    for k, chunks in rank_groups(spec, pp, v, partition, schedule, micro_batches):
        fulls = []
        for nb, has_head in chunks:
            x = sums.get((nb, has_head))
            if x is None:
                x = sums[(nb, has_head)] = _repeated(blk, nb) + (head if has_head else 0.0)
            fulls.append(x)
        groups.append((k, sum(c[0] for c in chunks), max(fulls), sum(fulls),
                       any(c[1] for c in chunks)))
    return blk, tuple(groups)
