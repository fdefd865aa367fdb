"""Ring attention: exact softmax attention over a sequence split across cp ranks.

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context" (arXiv:2310.01889), as torchtitan's context parallel and Megatron-LM's
``AttnFuncWithCPAndKVP2P`` run it: each rank keeps its queries; the key/value blocks (with
their Hkv heads) travel around the ring of cp ranks (``ring_comm.Ring``), each transfer
posted before the block held is computed; each block's partial result is merged into the
running one by its log-sum-exp (the online softmax of Milakov & Gimelshein 2018 and
FlashAttention, Dao et al. 2022):

    lse = log(exp(lse_a) + exp(lse_b)),   out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)

The backward passes the blocks again with their fp32 dK, dV accumulators; the per-block
gradients are FlashAttention's (Dao 2023, algorithm 2) from the global ``out`` and ``lse``:
``P = exp(S - lse)``, ``dV = P^T dO``, ``dS = P (dO V^T - rowsum(dO * out))``,
``dQ = dS K / sqrt(D)``, ``dK = dS^T Q / sqrt(D)``. Which block pairs are computed under the
load-balanced layout (``sharding``: rank i holds chunks i and 2cp-1-i), sliding windows
(``_pair``, ``_band``), the direct transfers a window allows (``kv_transfers``, ``_routes``,
``Ring.hop``), documents, the block kernels (``impl``) and the bytes moved:
docs/context_parallel.md, "Ring attention". No attention dropout (``ValueError``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from shardwise.models.sequence import document_mask, window_band
from shardwise.parallel.context.ring_comm import Ring
from shardwise.parallel.context.sharding import chunks_of, local_positions

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward",
                         None)


def _fused(q: torch.Tensor, impl: str) -> bool:
    if impl not in ("sdpa", "math"):
        raise ValueError(f"ring attention: impl={impl!r}: expected 'sdpa' or 'math'")
    return impl == "sdpa" and q.device.type == "cpu" and _FLASH_CPU is not None


@functools.lru_cache(maxsize=64)
def _band(nq: int, nk: int, offset: int, window: int, device: torch.device,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    """(nq, nk): where query row r sees key column s, ``0 <= offset + r - s < window``
    (``offset``: the position of row 0 less that of column 0); bool (True: attends), or,
    with ``dtype``, additive (0 and -inf in that dtype: what the fused CPU kernel takes).
    Kept per argument tuple: the same few boxes recur in every layer and step."""
    sees = window_band(nq, nk, offset, window, device)  # the engine's band, one definition
    if dtype is None:
        return sees
    return torch.zeros(nq, nk, dtype=dtype, device=device).masked_fill_(~sees, float("-inf"))


def _sees(Tq: int, Tk: int, causal: bool, band: tuple | None, docs: tuple,
          device: torch.device) -> torch.Tensor:
    """(B, 1, Tq, Tk) bool: where a query row sees a key column, same document (``docs``:
    the rows' and the columns' document ids, (B, Tq) and (B, Tk)) AND the causal diagonal
    (``causal``) AND the band (``band``)."""
    sees = document_mask(*docs)
    if causal:
        sees = sees & torch.ones(Tq, Tk, dtype=torch.bool, device=device).tril()
    if band is not None:
        sees = sees & _band(Tq, Tk, *band, device)
    return sees


def _block_forward(q, k, v, causal: bool, band: tuple | None, scale: float, impl: str,
                   docs: tuple | None = None):
    """Attention of queries ``q`` (B, H, Tq, D) on one key/value block (B, H, Tk, D):
    ``(out (B, H, Tq, D) fp32, lse (B, H, Tq) fp32)``; ``causal`` needs Tq == Tk; ``band``:
    ``(offset, window)`` of a band mask (``_band``) over the (Tq, Tk) scores, or None.
    Without ``docs`` every row must see at least one key. ``docs``: the rows' and columns'
    document ids ((B, Tq), (B, Tk)), ANDed with the masks above (``_sees``); a row that
    sees no key of the block then gets ``out`` 0 and ``lse`` -inf (nothing to merge)."""
    Tq, Tk = q.shape[2], k.shape[2]
    if docs is not None:
        sees = _sees(Tq, Tk, causal, band, docs, q.device)  # (B, 1, Tq, Tk)
        seen = sees.any(-1)  # (B, 1, Tq): rows that see a key of this block
        if _fused(q, impl):
            mask = torch.zeros(sees.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~sees, float("-inf"))
            out, lse = _FLASH_CPU(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, False,
                                  attn_mask=mask, scale=scale)
            out, lse = out.float(), lse.float()
        else:
            s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
            s = s.masked_fill(~sees, float("-inf"))
            lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - lse.masked_fill(~seen, 0.0).unsqueeze(-1))
            out = torch.matmul(p, v.float())
        return (out.masked_fill(~seen.unsqueeze(-1), 0.0),
                lse.masked_fill(~seen, float("-inf")))
    if _fused(q, impl):
        mask = None if band is None else _band(Tq, Tk, *band, q.device, q.dtype)
        out, lse = _FLASH_CPU(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal,
                              attn_mask=mask, scale=scale)
        return out.float(), lse.float()
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    if causal:
        s.masked_fill_(torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).triu(1),
                       float("-inf"))
    if band is not None:
        s.masked_fill_(~_band(Tq, Tk, *band, s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()), lse


def _block_backward(dout, q, k, v, out, lse, delta, causal: bool, band: tuple | None,
                    scale: float, impl: str, docs: tuple | None = None):
    """Gradients ``(dq, dk, dv)`` of one block pair given the final ``out`` and ``lse`` of
    the rows (and ``delta = rowsum(dout * out)``, fp32, (B, H, Tq)); masks as
    ``_block_forward``'s (the final ``lse`` is finite: every query sees itself)."""
    Tq, Tk = q.shape[2], k.shape[2]
    sees = None if docs is None else _sees(Tq, Tk, causal, band, docs, q.device)
    if _fused(q, impl):
        if sees is not None:
            mask = torch.zeros(sees.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~sees, float("-inf"))
            causal = False
        else:
            mask = None if band is None else _band(Tq, Tk, *band, q.device, q.dtype)
        dq, dk, dv = _FLASH_CPU_BWD(dout.contiguous(), q.contiguous(), k.contiguous(),
                                    v.contiguous(), out.contiguous(), lse.contiguous(), 0.0,
                                    causal, attn_mask=mask, scale=scale)
        return dq.float(), dk.float(), dv.float()
    qf, kf, vf, df = q.float(), k.float(), v.float(), dout.float()
    s = torch.matmul(qf, kf.transpose(-2, -1)) * scale
    if sees is not None:
        s.masked_fill_(~sees, float("-inf"))
    elif causal:
        s.masked_fill_(torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).triu(1),
                       float("-inf"))
    if sees is None and band is not None:
        s.masked_fill_(~_band(Tq, Tk, *band, s.device), float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))  # (B, H, Tq, Tk): the softmax of the whole row
    dv = torch.matmul(p.transpose(-2, -1), df)
    ds = p * (torch.matmul(df, vf.transpose(-2, -1)) - delta.unsqueeze(-1))
    return torch.matmul(ds, kf) * scale, torch.matmul(ds.transpose(-2, -1), qf) * scale, dv


class Task(NamedTuple):
    """One kernel call of a ring step: local query ``rows`` against the held block's key
    ``cols`` (slices), with the causal diagonal mask (``causal``) or a band mask
    (``band``: ``(offset, window)``, ``_band``) or neither."""

    rows: slice
    cols: slice
    causal: bool = False
    band: tuple[int, int] | None = None


SKIP, FULL, DIAGONAL, BAND = "skip", "full", "diagonal", "band"


def _pair(qa: int, kb: int, c: int, window: int | None) -> str:
    """How query chunk ``qa`` sees key chunk ``kb`` (indices in the whole sequence, ``c``
    tokens each) under the causal mask and a window of ``window`` tokens (None: none): from
    the range of query position less key position, ``(qa - kb) c +- (c - 1)``, which must lie in
    [0, window). SKIP (none of it), FULL (all of it), DIAGONAL (the causal triangle of a
    chunk against itself) or BAND (a band mask)."""
    lo, hi = (qa - kb) * c - (c - 1), (qa - kb) * c + (c - 1)
    w = math.inf if window is None else window
    if hi < 0 or lo >= w:
        return SKIP
    if lo >= 0 and hi < w:
        return FULL
    return DIAGONAL if qa == kb and hi < w else BAND


def _chunk(a: int, c: int) -> slice:
    return slice(a * c, (a + 1) * c)


def _span(chunks: set[int], c: int) -> slice:
    """The rows (or columns) of local chunks ``chunks``, {0}, {1} or both."""
    return slice(None) if len(chunks) == 2 else _chunk(min(chunks), c)


def _band_task(qa: int, kb: int, a: int, b: int, c: int, window: int) -> Task:
    """The BAND pair (local chunk ``a`` = sequence chunk ``qa``, block chunk ``b`` = ``kb``)
    on the rows and columns that see anything: row r (of the chunk) sees a key iff
    ``d + r >= 0`` and ``d + r - (c - 1) < W``, column s is seen iff ``s <= d + c - 1`` and
    ``s > d - W``, with ``d = (qa - kb) c`` (both ranges contiguous); so every row kept sees
    at least one kept column."""
    d = (qa - kb) * c
    r0, r1 = max(0, -d), min(c, window + c - 1 - d)
    s0, s1 = max(0, d - window + 1), min(c, d + c)
    return Task(slice(a * c + r0, a * c + r1), slice(b * c + s0, b * c + s1),
                band=(d + r0 - s0, window))


def _plan(rank: int, source: int, cp: int, causal: bool, c: int,
          window: int | None = None) -> list[Task]:
    """What ring index ``rank`` computes on the block of ring index ``source`` (module
    docstring): the kernel calls, none when the block is masked out whole. ``c``: the chunk
    length (local tokens / 2)."""
    everything = slice(None)
    if not causal:
        return [Task(everything, everything)]
    mine, held = chunks_of(rank, cp), chunks_of(source, cp)
    kinds = {(a, b): _pair(mine[a], held[b], c, window) for a in (0, 1) for b in (0, 1)}
    live = [ab for ab, kind in kinds.items() if kind != SKIP]
    if kinds == {(0, 0): DIAGONAL, (0, 1): SKIP, (1, 0): FULL, (1, 1): DIAGONAL}:
        return [Task(everything, everything, causal=True)]  # the local sequence, causal
    rows, cols = {a for a, _ in live}, {b for _, b in live}
    if live and all(kinds[a, b] == FULL for a in rows for b in cols):  # one rectangle
        return [Task(_span(rows, c), _span(cols, c))]
    tasks = []
    for a, b in live:
        kind = kinds[a, b]
        if kind == BAND:
            tasks.append(_band_task(mine[a], held[b], a, b, c, window))
        else:
            tasks.append(Task(_chunk(a, c), _chunk(b, c), causal=kind == DIAGONAL))
    return tasks


def kv_transfers(cp: int, c: int, window: int | None) -> frozenset[tuple[int, int]]:
    """The K/V block transfers causal ring attention needs on a ring of ``cp`` ranks with
    chunks of ``c`` tokens and a sliding window of ``window`` tokens (None: none), as
    ``(source, destination)`` ring indices: rank d needs rank s's block when its queries
    see any of that block's keys, i.e. when ``_plan`` computes anything on it (the same
    classification, ``_pair``). Every ordered pair without a window; under the zigzag
    layout a pair is needed iff ``(|s - d| - 1) c + 1 < W``."""
    return frozenset((src, dst) for dst in range(cp) for src in range(cp)
                     if src != dst and _plan(dst, src, cp, True, c, window))


@functools.lru_cache(maxsize=256)
def scored_pairs(cp: int, c: int, window: int | None) -> tuple[int, ...]:
    """Per ring index, the query-key pairs its kernels score in one causal ring attention
    (chunks of ``c`` tokens, a sliding window of ``window`` or None): the boxes of its
    ``_plan``s, a causal task half its box (the causal kernel skips the masked half, about),
    a band box whole (its mask is applied to scores computed whole). Equal on every rank
    without a window; with one, the middle ranks score more (the planner's slowest rank)."""
    def area(t: Task) -> int:
        n = len(range(2 * c)[t.rows]) * len(range(2 * c)[t.cols])
        return n // 2 if t.causal else n

    return tuple(sum(area(t) for src in range(cp) for t in _plan(i, src, cp, True, c, window))
                 for i in range(cp))


class _Routes(NamedTuple):
    """The direct transfers of a windowed ring (``_routes``): ``hops``, the ring distances
    ``h`` some rank sends its own block over (to ring index ``rank + h``), increasing, the
    same schedule on every rank; ``needs``, the ``(source, destination)`` pairs of
    ``kv_transfers``."""

    cp: int
    hops: tuple[int, ...]
    needs: frozenset[tuple[int, int]]

    def sends(self, rank: int, hop: int) -> bool:
        """Whether ``rank`` sends its block ``hop`` places on."""
        return (rank, (rank + hop) % self.cp) in self.needs

    def receives(self, rank: int, hop: int) -> bool:
        """Whether ``rank`` receives the block of the rank ``hop`` places back."""
        return ((rank - hop) % self.cp, rank) in self.needs


@functools.lru_cache(maxsize=64)
def _routes(cp: int, c: int, window: int | None) -> _Routes | None:
    """None when every rank needs every other rank's block (no window, or a long one): the
    blocks then go round the ring (``Ring.shift``, cp - 1 relays). Else the direct
    transfers of ``kv_transfers``, one hop distance at a time."""
    needs = kv_transfers(cp, c, window)
    if len(needs) == cp * (cp - 1):
        return None
    return _Routes(cp, tuple(sorted({(d - s) % cp for s, d in needs})), needs)


def _arrivals(ring: Ring, routes: _Routes | None, kv: tuple):
    """Yield ``(step, block)`` for each step of this rank: its own ``kv`` at step 0, then
    the block of ``ring.source(step)`` (``step`` places back round the ring) or None where
    it receives nothing at that step; the next step's transfer is posted before a block is
    yielded, so it travels while the caller computes. ``routes`` None: cp - 1 shifts round
    the ring; else one ``Ring.hop`` per distance of ``routes.hops`` (the caller may post
    other transfers between yields: every rank posts them in the same order of steps)."""
    steps = list(range(1, ring.size)) if routes is None else list(routes.hops)
    held = kv
    for n, step in enumerate([0] + steps):
        if n == len(steps):
            nxt = None
        elif routes is None:
            nxt = ring.shift(held)
        else:
            nxt = ring.hop(kv, steps[n], routes.sends(ring.rank, steps[n]),
                           routes.receives(ring.rank, steps[n]))
        yield step, held
        held = None
        if nxt is not None:
            held, handle = nxt
            if handle is not None:
                handle.wait()


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, o: torch.Tensor,
           l: torch.Tensor) -> None:
    """Fold one block's ``(o, l)`` into the running ``(out, lse)`` of ``rows``, in place.
    A row that has seen no key yet and sees none here (document masks) keeps -inf and 0."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, l)
    ref = new.masked_fill(new == float("-inf"), 0.0)  # exp(-inf - 0) = 0, not exp(nan)
    out[:, :, rows] = (out[:, :, rows] * torch.exp(old - ref).unsqueeze(-1)
                       + o * torch.exp(l - ref).unsqueeze(-1))
    lse[:, :, rows] = new


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    return t[:, :, rows]


def _heads(t: torch.Tensor, rep: int) -> torch.Tensor:
    """(B, Hkv, T, D) -> (B, Hkv rep, T, D): each key/value head serves ``rep`` consecutive
    query heads (HF ``repeat_kv``), repeated here, per block, after the ring moved it."""
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _head_sum(t: torch.Tensor, rep: int) -> torch.Tensor:
    """The gradient of ``_heads``: (B, Hkv rep, T, D) -> (B, Hkv, T, D), summing each key/
    value head's ``rep`` query heads."""
    if rep == 1:
        return t
    B, H, T, D = t.shape
    return t.view(B, H // rep, rep, T, D).sum(2)


def _add(acc: tuple, grads: list) -> tuple:
    """Add each kernel call's ``(cols, dK, dV)`` into the accumulators ``acc``; returns
    ``acc``."""
    for cols, dk_b, dv_b in grads:
        acc[0][:, :, cols] += dk_b
        acc[1][:, :, cols] += dv_b
    return acc


def _fold(acc: tuple, pending) -> None:
    """Wait for a contribution on its way (``Ring.hop``'s ``(received, handle)``, or None)
    and add what arrived, if anything, into ``acc``."""
    if pending is None:
        return
    got, handle = pending
    if handle is not None:
        handle.wait()
    if got is not None:
        acc[0].add_(got[0])
        acc[1].add_(got[1])


class _DocumentsOf:
    """The document ids of each kernel call's rows and columns (``pair``), from those of the
    whole sequences (``documents`` (B, T), the same on every rank of the ring: no bytes
    travel for them); ``pair`` is None when there are none (plain causal)."""

    def __init__(self, documents: torch.Tensor | None, cp: int, c: int):
        self.of = None
        if documents is not None:  # ring index -> (B, 2c): its chunks' ids, local order
            T = 2 * cp * c
            if documents.shape[-1] != T:
                raise ValueError(f"ring attention: document ids of {documents.shape[-1]} "
                                 f"tokens per sequence; the ring holds {T}")
            self.of = [documents[:, local_positions(T, cp, r, documents.device)]
                       for r in range(cp)]

    def pair(self, rank: int, source: int, t: "Task") -> tuple | None:
        if self.of is None:
            return None
        return self.of[rank][:, t.rows], self.of[source][:, t.cols]


class _RingAttention(torch.autograd.Function):
    """Forward: ring attention's output; backward: dQ here, dK/dV around the ring (or,
    with ``_routes``, straight back to their owners)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, causal: bool, impl: str, scale: float,
                window: int | None, documents: torch.Tensor | None = None):
        c = q.shape[2] // 2
        docs = _DocumentsOf(documents, ring.size, c)
        # (B, H, T, D) laid out as (B, T, H, D), as the fused kernels return it: the caller's
        # ``transpose(1, 2).reshape(B, T, H * D)`` is then a view, not one more saved copy
        B, H, T, D = q.shape
        out = torch.zeros(B, T, H, D, dtype=torch.float32, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        rep = H // k.shape[1]  # query heads per key/value head (grouped-query attention)
        routes = _routes(ring.size, c, window) if causal else None
        for step, kv in _arrivals(ring, routes, (k, v)):  # the next travels while we compute
            if kv is None:
                continue
            for t in _plan(ring.rank, ring.source(step), ring.size, causal, c, window):
                o, l = _block_forward(_rows(q, t.rows), _heads(_rows(kv[0], t.cols), rep),
                                      _heads(_rows(kv[1], t.cols), rep), t.causal, t.band,
                                      scale, impl, docs.pair(ring.rank, ring.source(step), t))
                _merge(out, lse, t.rows, o, l)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.impl, ctx.scale, ctx.window = ring, causal, impl, scale, window
        ctx.docs = docs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, impl, scale, window = ctx.ring, ctx.causal, ctx.impl, ctx.scale, ctx.window
        docs = ctx.docs
        c = q.shape[2] // 2
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)  # (B, H, T): rowsum(dO * O)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        rep = q.shape[1] // k.shape[1]
        routes = _routes(ring.size, c, window) if causal else None

        def zeros():  # fp32 accumulators (dK, dV) of one block
            return (torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                    torch.zeros(v.shape, dtype=torch.float32, device=v.device))

        dkv = None  # round the ring: the accumulators (dK, dV) fp32 of the block held;
        # direct: this rank's own block's, to which every user's contribution is added
        pending = None  # accumulators (or a contribution) on their way, and their handle
        for step, kv in _arrivals(ring, routes, (k, v)):
            grads = []  # (cols, dK, dV) of the block held, per kernel call
            tasks = [] if kv is None else _plan(ring.rank, ring.source(step), ring.size,
                                                causal, c, window)
            for t in tasks:
                dq_b, dk_b, dv_b = _block_backward(
                    _rows(dout, t.rows), _rows(q, t.rows), _heads(_rows(kv[0], t.cols), rep),
                    _heads(_rows(kv[1], t.cols), rep), _rows(out, t.rows), _rows(lse, t.rows),
                    _rows(delta, t.rows), t.causal, t.band, scale, impl,
                    docs.pair(ring.rank, ring.source(step), t))
                dq[:, :, t.rows] += dq_b
                grads.append((t.cols, _head_sum(dk_b, rep), _head_sum(dv_b, rep)))
            if routes is None:  # the accumulators travel with their block round the ring
                if pending is None:  # step 0: this rank's own block starts its accumulators
                    dkv = zeros()
                else:
                    dkv, handle = pending
                    handle.wait()
                _add(dkv, grads)
                # pass them on with their block; after the last step they are back home
                pending = ring.shift(dkv) if ring.size > 1 else (dkv, None)
                continue
            if step == 0:  # direct: the own block's accumulators stay here
                dkv = _add(zeros(), grads)
                continue
            _fold(dkv, pending)
            # this block's contribution back to its owner, the contribution to ours from
            # the rank we sent it to at this step: only between ranks that used a block
            mine = _add(zeros(), grads) if kv is not None else dkv
            pending = ring.hop(mine, -step, kv is not None, routes.sends(ring.rank, step))
        if routes is None:
            dkv, handle = pending
            if handle is not None:
                handle.wait()
        else:
            _fold(dkv, pending)
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None,
                None, None)


@torch.compiler.disable  # its sends and receives run eagerly: a compiled block breaks here
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, *,
                   causal: bool = True, dropout_p: float = 0.0, impl: str = "sdpa",
                   scale: float | None = None, window: int | None = None,
                   documents: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(Q K^T / sqrt(D)) V over the whole sequence, from this rank's shard of it.

    ``q``: (B, H, T_local, D) and ``k``, ``v``: (B, Hkv, T_local, D), this rank's tokens in
    the layout of ``sharding.shard_sequence`` (chunks ``i`` and ``2cp-1-i``; any layout
    without a causal mask). Grouped-query attention (Ainslie et al. 2023): Hkv divides H and
    each key/value head serves H / Hkv consecutive query heads; the ring passes the Hkv heads
    and each rank repeats a block for its kernel, so the ring's bytes are Hkv / H of
    repeating first. ``window``: a sliding window of W tokens (with ``causal``: the query at
    position p sees keys p - W < p' <= p, positions in the whole sequence), or None; only
    the blocks some rank's queries see are then sent (``kv_transfers``). ``documents``:
    (B, T) int64 document ids of the whole sequences (``models.sequence.document_ids``; the
    same on every rank, so none of it travels), or None; with them a query sees only keys
    of its own document, the mask ANDed into every block pair's (a block pair may then hide
    a whole row: its ``lse`` is -inf and nothing is merged). Returns
    (B, H, T_local, D) in ``q``'s dtype: this rank's rows of full attention, equal to them
    up to rounding. Collective over ``ring`` (every rank calls it, in the same order);
    autograd flows to the keys and values of every rank. Raises ``ValueError`` (one line)
    for ``dropout_p > 0``, an odd T_local with ``causal``, a window without ``causal`` or
    under 1, or an unknown ``impl``.
    """
    if dropout_p > 0.0:
        raise ValueError(f"ring attention: dropout_p={dropout_p}: attention dropout is not "
                         "supported under context parallelism; set model.dropout = 0")
    if (q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0]
            or k.shape[2:] != q.shape[2:] or k.shape[1] < 1 or q.shape[1] % k.shape[1]):
        raise ValueError(f"ring attention: expected q (B, H, T, D) and k, v (B, Hkv, T, D) "
                         f"with Hkv dividing H; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if causal and q.shape[2] % 2:
        raise ValueError(f"ring attention: {q.shape[2]} local tokens cannot be the two "
                         "chunks of the load-balanced layout (odd length)")
    if window is not None and (not causal or isinstance(window, bool)
                               or not isinstance(window, int) or window < 1):
        raise ValueError(f"ring attention: window={window!r}: expected a whole number >= 1 "
                         "with causal=True, or None")
    _fused(q, impl)  # checks impl
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if documents is not None and not causal:
        raise ValueError("ring attention: document ids need causal=True (the "
                         "load-balanced layout)")
    return _RingAttention.apply(q, k, v, ring, causal, impl, scale, window, documents)
