"""Rank functions for the tensor-parallel tests (run inside ``shardwise.launch.spawn``).

Every rank can rebuild every other rank's inputs (they come from seeded generators), so
each check compares the sharded computation with the unsharded one on the same rank.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers import rel_err
from shardwise import comm
from shardwise.base.topology import Topology, init_process_groups
from shardwise.engine import Engine, EngineConfig
from shardwise.engine.model import build_local_model
from shardwise.models import gpt, llama
from shardwise.models.gpt import GPT, MLP, CausalSelfAttention, GPTConfig
from shardwise.models.llama import LlamaConfig
from shardwise.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ParallelRNG,
    RankGroup,
    RowParallelLinear,
    VocabParallelEmbedding,
    clip_grad_norm_,
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    gather_state_dict,
    gather_tensor,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
    scatter_to_sequence,
    sync_replicated_grads,
    vocab_parallel_cross_entropy,
)
from shardwise.parallel.tensor_parallel.plan import parallelize

B, T, C = 2, 8, 32  # layer tests: batch, sequence, hidden


def topology(dp: int, tp: int) -> Topology:
    return init_process_groups(Topology.build(dp=dp, tp=tp, rank=dist.get_rank(),
                                              world_size=dist.get_world_size()))


def _rand(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _seq(x: torch.Tensor, tp: RankGroup) -> torch.Tensor:
    """This rank's slice along the sequence dim (dim 1)."""
    n = x.shape[1] // tp.size
    return x[:, tp.rank * n:(tp.rank + 1) * n]


def _last(x: torch.Tensor, tp: RankGroup) -> torch.Tensor:
    n = x.shape[-1] // tp.size
    return x[..., tp.rank * n:(tp.rank + 1) * n]


# ------------------------------------------------------------------ conjugate operators

def operator_checks(tp: RankGroup) -> dict[str, float]:
    """Forward and backward of each operator against the values built from all ranks'
    inputs. Rank r's input is ``_rand(seed=100 + r)``, its output gradient ``seed=200 + r``."""
    N, r, out = tp.size, tp.rank, {}
    xs = [_rand(B, T, C, seed=100 + s) for s in range(N)]
    gs_full = [_rand(B, T, C, seed=200 + s) for s in range(N)]
    gs_part = [_rand(B, T, C // N, seed=300 + s) for s in range(N)]
    gs_seq = [_rand(B, T // N, C, seed=400 + s) for s in range(N)]

    def run(op, x, g):
        x = x.clone().requires_grad_(True)
        y = op(x, tp)
        y.backward(g)
        return y.detach(), x.grad

    y, gx = run(copy_to_region, xs[r], gs_full[r])
    out["copy.fwd"], out["copy.bwd"] = rel_err(y, xs[r]), rel_err(gx, sum(gs_full))
    y, gx = run(reduce_from_region, xs[r], gs_full[r])
    out["reduce.fwd"], out["reduce.bwd"] = rel_err(y, sum(xs)), rel_err(gx, gs_full[r])
    y, gx = run(scatter_to_region, xs[r], gs_part[r])
    out["scatter.fwd"] = rel_err(y, _last(xs[r], tp))
    out["scatter.bwd"] = rel_err(gx, torch.cat(gs_part, -1))
    y, gx = run(gather_from_region, _last(xs[r], tp), gs_full[r])
    out["gather.fwd"] = rel_err(y, torch.cat([_last(xs[s], RankGroup(size=N, rank=s))
                                              for s in range(N)], -1))
    out["gather.bwd"] = rel_err(gx, _last(gs_full[r], tp))
    y, gx = run(scatter_to_sequence, xs[r], gs_seq[r])
    out["seq_scatter.fwd"] = rel_err(y, _seq(xs[r], tp))
    out["seq_scatter.bwd"] = rel_err(gx, torch.cat(gs_seq, 1))
    y, gx = run(gather_from_sequence, _seq(xs[r], tp), gs_full[r])
    out["seq_gather.fwd"] = rel_err(y, torch.cat([_seq(xs[s], RankGroup(size=N, rank=s))
                                                  for s in range(N)], 1))
    out["seq_gather.bwd"] = rel_err(gx, _seq(sum(gs_full), tp))
    y, gx = run(reduce_scatter_to_sequence, xs[r], gs_seq[r])
    out["seq_reduce_scatter.fwd"] = rel_err(y, _seq(sum(xs), tp))
    out["seq_reduce_scatter.bwd"] = rel_err(gx, torch.cat(gs_seq, 1))
    return out


# ------------------------------------------------------------------ layers

def _compare(name: str, ref_mod: nn.Module, tp_mod: nn.Module, tp: RankGroup, seq_in: bool,
             seq_out: bool, in_last_split: bool = False, out_last_split: bool = False,
             in_dim: int = C, vocab: int | None = None, ids: bool = False) -> dict[str, float]:
    """Run both modules on the same input; loss = sum(y * u) with u fixed; compare the
    output, the input gradient and every parameter gradient (gathered)."""
    x = (torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(7)) if ids
         else _rand(B, T, in_dim, seed=7).requires_grad_(True))
    y_ref = ref_mod(x)
    u = _rand(*y_ref.shape, seed=8)
    (y_ref * u).sum().backward()
    x_tp = x.detach()
    if seq_in:
        x_tp = _seq(x_tp, tp)
    if in_last_split:
        x_tp = _last(x_tp, tp)
    x_tp = x_tp if ids else x_tp.clone().requires_grad_(True)
    y_tp = tp_mod(x_tp)
    want, u_tp = y_ref.detach(), u
    if seq_out:
        want, u_tp = _seq(want, tp), _seq(u_tp, tp)
    if out_last_split:
        want, u_tp = _last(want, tp), _last(u_tp, tp)
    (y_tp * u_tp).sum().backward()
    out = {f"{name}.out": rel_err(y_tp.detach(), want)}
    if not ids:
        gx = x.grad
        if seq_in:
            gx = _seq(gx, tp)
        if in_last_split:
            gx = _last(gx, tp)
        out[f"{name}.grad_in"] = rel_err(x_tp.grad, gx)
    sync_replicated_grads(tp_mod.parameters(), tp) if tp.sequence_parallel else None
    ref_params = dict(ref_mod.named_parameters())
    for pname, p in tp_mod.named_parameters():
        g = p.grad if getattr(p, "tp_dim", None) is None else gather_tensor(p.grad, p.tp_dim, tp)
        if vocab is not None:
            g = g[:vocab]
        out[f"{name}.grad.{pname}"] = rel_err(g, ref_params[pname].grad)
    return out


def _planned(module: nn.Module, plan: dict, name: str, tp: RankGroup, rng) -> nn.Module:
    """A copy of ``module`` (named ``name`` in its model) split by the model's tp plan."""
    return parallelize(copy.deepcopy(module), plan, tp, rng, name=name)


def layer_checks(tp: RankGroup) -> dict[str, float]:
    sp, out = tp.sequence_parallel, {}
    torch.manual_seed(11)
    lin = nn.Linear(C, 2 * C)
    for gather in (True, False):
        col = ColumnParallelLinear(C, 2 * C, tp, gather_output=gather, master=lin)
        lin.zero_grad()
        out |= _compare(f"column(gather={gather})", lin, col, tp, seq_in=sp, seq_out=False,
                        out_last_split=not gather)
    torch.manual_seed(12)
    lin = nn.Linear(2 * C, C)
    for parallel_in in (False, True):
        row = RowParallelLinear(2 * C, C, tp, input_is_parallel=parallel_in, master=lin)
        lin.zero_grad()
        out |= _compare(f"row(input_is_parallel={parallel_in})", lin, row, tp, seq_in=False,
                        seq_out=sp, in_last_split=parallel_in, in_dim=2 * C)
    cfg = GPTConfig(vocab_size=16, block_size=T, n_layer=1, n_head=4, n_embd=C)
    rng = ParallelRNG(0, tp.rank)
    torch.manual_seed(13)
    mlp = MLP(cfg)
    out |= _compare("mlp", mlp, _planned(mlp, gpt.TP_PLAN, "blocks.0.mlp", tp, rng), tp,
                    seq_in=sp, seq_out=sp)
    torch.manual_seed(14)
    attn = CausalSelfAttention(cfg)
    out |= _compare("attention", attn, _planned(attn, gpt.TP_PLAN, "blocks.0.attn", tp, rng), tp,
                    seq_in=sp, seq_out=sp)
    # Llama: grouped-query attention with one kv head per tp rank, and SwiGLU
    lcfg = LlamaConfig(vocab_size=16, block_size=T, n_layer=1, n_head=2 * tp.size,
                       n_kv_heads=tp.size, n_embd=C, ffn_hidden=4 * tp.size)
    torch.manual_seed(16)
    for what, m in (("llama_attention", "self_attn"), ("swiglu", "mlp")):
        block = llama.Block(lcfg)
        ref = getattr(block, m)
        out |= _compare(what, ref, _planned(ref, llama.TP_PLAN, f"blocks.0.{m}", tp, rng), tp,
                        seq_in=sp, seq_out=sp)
    for vocab in (4 * tp.size * 3, 4 * tp.size * 3 - 1):  # divisible, and padded
        torch.manual_seed(15)
        emb = nn.Embedding(vocab, C)
        out |= _compare(f"vocab_embedding(V={vocab})", emb,
                        VocabParallelEmbedding(vocab, C, tp, master=emb), tp, seq_in=False,
                        seq_out=sp, vocab=vocab, ids=True)
    return out


def loss_checks(tp: RankGroup) -> dict[str, float]:
    """Vocab-parallel cross-entropy against F.cross_entropy on the gathered logits; the
    padded columns hold large garbage to show they never enter the softmax."""
    out = {}
    for vocab in (8 * tp.size, 8 * tp.size - 3):
        padded = -(-vocab // tp.size) * tp.size
        full = _rand(40, padded, seed=21) * 3
        full[:, vocab:] = 50.0  # padding garbage
        targets = torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(22))
        ref_logits = full[:, :vocab].clone().requires_grad_(True)
        ref = F.cross_entropy(ref_logits, targets)
        ref.backward()
        local = _last(full, tp).clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(local, targets, tp, vocab_size=vocab)
        loss.backward()
        gathered = gather_tensor(local.detach(), -1, tp)[:, :vocab]
        grad = gather_tensor(local.grad, -1, tp)
        out[f"ce(V={vocab}).loss"] = rel_err(loss.detach(), ref.detach())
        out[f"ce(V={vocab}).loss_vs_gathered"] = rel_err(loss.detach(),
                                                         F.cross_entropy(gathered, targets))
        out[f"ce(V={vocab}).grad"] = rel_err(grad[:, :vocab], ref_logits.grad)
        out[f"ce(V={vocab}).pad_grad_abs"] = float(grad[:, vocab:].abs().sum())
    return out


def error_messages(tp: RankGroup) -> list[str]:
    msgs = []
    for make in (lambda: ColumnParallelLinear(C, 3 * tp.size + 1, tp),
                 lambda: RowParallelLinear(3 * tp.size + 1, C, tp),
                 lambda: ShardedGPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1,
                                              n_head=tp.size + 1, n_embd=4 * (tp.size + 1)),
                                    tp, 0),
                 lambda: ShardedGPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1,
                                              n_head=tp.size, n_embd=tp.size * 2 + 1),
                                    tp, 0)):
        try:
            make()
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def layers_worker() -> dict:
    """All operator, layer, loss and error checks at tp = world size, with and without
    sequence parallelism, through the backend's collectives and through ours ("ring")."""
    topo = topology(1, dist.get_world_size())
    out: dict = {}
    for sp, algo in ((False, "native"), (True, "ring"), (False, "ring")):
        tp = RankGroup.from_topology(topo, sequence_parallel=sp, all_reduce=algo, gather=algo)
        tag = f"sp={sp},{algo}:"
        out |= {tag + k: v for k, v in operator_checks(tp).items()} if not sp else {}
        out |= {tag + k: v for k, v in layer_checks(tp).items()}
        out |= {tag + k: v for k, v in loss_checks(tp).items()}
    return {"errors": out, "messages": error_messages(RankGroup.from_topology(topo))}


# ------------------------------------------------------------------ whole GPT, 5 steps

class ShardedGPT(nn.Module):
    """This rank's tp shard of ``GPT(cfg)`` built after ``torch.manual_seed(seed)``, exactly
    as the engine builds it (``engine.model.build_local_model`` with pp = 1: the GPT's
    layers through its tp plan (``tensor_parallel.plan.parallelize``), the head tied to the embedding), laid out as the
    GPT (``embed``, ``blocks``, ``head``: parameters under the GPT's names) so the tp state
    functions and a plain optimizer loop can drive it. ``forward(idx (B, T), targets)``
    -> (logits (B, T, V_pad / tp), mean cross-entropy | None)."""

    def __init__(self, cfg: GPTConfig, tp: RankGroup, seed: int):
        super().__init__()
        local = build_local_model(cfg, pp=1, pp_rank=0, chunk_ids=[0], n_chunks=1, tp=tp,
                                  seed=seed, dropout_seed=seed, device=torch.device("cpu"))
        layers = dict(zip(local.chunks[0].names, local.chunks[0].layers))
        self.cfg, self.rng, self.loss_fn = cfg, local.rng, local.loss_fn
        self.embed = layers["embed"]
        self.blocks = nn.ModuleList(layers[f"blocks.{i}"] for i in range(cfg.n_layer))
        self.head = layers["head"]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return logits, None if targets is None else self.loss_fn(logits, targets)


LR, WEIGHT_DECAY, MAX_NORM = 3e-3, 0.1, 0.5  # MAX_NORM small enough that clipping acts
WARMUP = 2  # linear warm-up as the trainer does: (s + 1) / (WARMUP + 1), then LR


def _lr(step: int) -> float:
    return LR * min(1.0, (step + 1) / (WARMUP + 1))


def make_batches(corpus: str, steps: int, batch: int, block: int) -> tuple[int, list]:
    """Character ids of the corpus; ``steps`` batches of (x, y), each (batch, block)."""
    text = open(corpus, encoding="utf-8").read()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text[:20_000]], dtype=torch.long)
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - block - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + block] for s in starts])
        y = torch.stack([data[s + 1:s + block + 1] for s in starts])
        out.append((x, y))
    return len(chars), out


def train_reference(cfg: GPTConfig, seed: int, batches: list) -> dict:
    """One process, the unsharded GPT: AdamW, clipping at MAX_NORM."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for step, (x, y) in enumerate(batches):
        opt.param_groups[0]["lr"] = _lr(step)
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _train_tp(topo: Topology, cfg: GPTConfig, seed: int, batches: list, sp: bool,
              resume: dict | None = None, start: int = 0) -> dict:
    """Train on ``batches``; ``resume`` ({"params", "optim"} in the full layout, from any
    layout) replaces the seeded initial state. Returns losses, norms and the full state."""
    from shardwise.parallel.data_parallel import DistributedDataParallel
    from shardwise.parallel.tensor_parallel import (
        gather_optimizer_state,
        load_full_state_dict,
        load_optimizer_state,
    )

    tp = RankGroup.from_topology(topo, sequence_parallel=sp)
    model = ShardedGPT(cfg, tp, seed)
    if resume is not None:
        load_full_state_dict(model, resume["params"], tp)
    ddp = (DistributedDataParallel(model, topo.groups.dp, allreduce="native")
           if topo.dp > 1 else None)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    if resume is not None:
        load_optimizer_state(model, opt, resume["optim"], tp)
    losses, norms = [], []
    for step, (x, y) in enumerate(batches, start=start):
        opt.param_groups[0]["lr"] = _lr(step)
        n = x.shape[0] // topo.dp  # this dp rank's share of the global batch
        x, y = (t[topo.dp_rank * n:(topo.dp_rank + 1) * n] for t in (x, y))
        (ddp or opt).zero_grad()
        _, loss = (ddp or model)(x, y)
        loss.backward()
        if sp:
            sync_replicated_grads(model.parameters(), tp)
        norms.append(float(clip_grad_norm_(model.parameters(), MAX_NORM, tp)))
        opt.step()
        if topo.dp > 1:  # the global batch's mean loss
            loss = loss.detach().clone()
            comm.all_reduce(loss, op="mean", group=topo.groups.dp)
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "params": gather_state_dict(model, tp),
            "optim": gather_optimizer_state(model, opt, tp)}


def gpt_worker(cfg: GPTConfig, seed: int, batches: list, layouts: list) -> dict:
    """Train from the same seed once per (dp, tp, sequence_parallel) layout; on this rank,
    return each run's losses, grad norms and gathered parameters."""
    out = {}
    for dp, tp, sp in layouts:
        r = _train_tp(topology(dp, tp), cfg, seed, batches, sp)
        out[f"dp={dp},tp={tp},sp={sp}"] = {k: r[k] for k in ("losses", "norms", "params")}
    return out


def resume_worker(cfg: GPTConfig, seed: int, batches: list, first: tuple, second: tuple,
                  stop_at: int, root: str) -> dict:
    """Train ``stop_at`` steps in layout ``first`` (dp, tp, sp), save the full-layout state
    with ``shardwise.checkpoint`` (DCP) under ``root``, load it into layout ``second`` and
    finish; return the finished run."""
    from shardwise import checkpoint

    dp, tp, sp = first
    part = _train_tp(topology(dp, tp), cfg, seed, batches[:stop_at], sp)
    saved = checkpoint.save(root, stop_at, {"params": part["params"], "optim": part["optim"]},
                            {"step": stop_at, "layout": list(first)})
    # a fresh process would know only the shapes: preallocate them and let DCP fill them
    state = {"params": {k: torch.zeros_like(v) for k, v in part["params"].items()},
             "optim": {k: {n: torch.zeros_like(t) for n, t in v.items()}
                       for k, v in part["optim"].items()}}
    meta = checkpoint.load(saved, state)
    assert meta["step"] == stop_at
    dp, tp, sp = second
    rest = _train_tp(topology(dp, tp), cfg, seed, batches[stop_at:], sp, resume=state,
                     start=stop_at)
    return {"losses": part["losses"] + rest["losses"], "params": rest["params"]}


# ------------------------------------------------------------------ communication

def comm_table_worker(batch: int, c_in: int, c_out: int) -> list[dict]:
    """Seed 000's y = Wx, measured per strategy with our ring collectives (counted)."""
    from shardwise.parallel.tensor_parallel.comm_table import measure_linear

    dp_topo = topology(dist.get_world_size(), 1)
    tp = RankGroup.from_topology(topology(1, dist.get_world_size()), all_reduce="ring",
                                 gather="ring")
    return measure_linear(batch, c_in, c_out, dp_topo.groups.dp, tp)


def gpt_comm_worker(cfg: GPTConfig, seed: int, batch: tuple) -> dict:
    """Per-layer communication of one forward + backward of the TP GPT, with and without
    sequence parallelism (ring collectives, so bytes are counted)."""
    from shardwise.parallel.tensor_parallel.comm_table import measure_gpt_layers

    topo = topology(1, dist.get_world_size())
    out = {}
    for sp in (False, True):
        tp = RankGroup.from_topology(topo, sequence_parallel=sp, all_reduce="ring",
                                     gather="ring")
        out[f"sp={sp}"] = measure_gpt_layers(
            lambda x, y, model=ShardedGPT(cfg, tp, seed): model(x, y)[1], *batch)
    return out


def dropout_worker(cfg: GPTConfig, seed: int, batch: tuple) -> dict:
    """With dropout on, in train mode: the residual stream (a replicated region) must be
    bitwise equal on every tp rank, while masks drawn in parallel regions must differ
    between tp ranks; the default generator stays in step across ranks."""
    from dataclasses import replace

    topo = topology(1, dist.get_world_size())
    tp = RankGroup.from_topology(topo)
    model = ShardedGPT(replace(cfg, dropout=0.1), tp, seed).train()
    seen = []
    model.blocks[-1].register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    x, y = batch
    _, loss = model(x, y)
    loss.backward()
    resid = gather_tensor(seen[0].unsqueeze(0), 0, tp)          # (tp, B, T, C)
    with model.rng.fork():
        parallel = gather_tensor(torch.rand(1, 64), 0, tp)      # a parallel-region draw
    default = gather_tensor(torch.rand(1, 64), 0, tp)           # the default generator
    return {"resid_equal": all(torch.equal(resid[0], r) for r in resid),
            "parallel_distinct": len({tuple(r.tolist()) for r in parallel}) == tp.size,
            "default_equal": all(torch.equal(default[0], r) for r in default),
            "loss_finite": bool(torch.isfinite(loss))}


def generate_worker(cfg: GPTConfig, seed: int) -> dict:
    """``Engine.generate`` at tp = world size against ``GPT.generate`` from the same seed
    and sampler."""
    topo = topology(1, dist.get_world_size())
    torch.manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (2, 3), generator=torch.Generator().manual_seed(9))
    ref = GPT(cfg).generate(prompt, 6, generator=torch.Generator().manual_seed(0))
    out = {}
    for sp in (False, True):
        engine = Engine(cfg, topo, EngineConfig(
            seq_len=cfg.block_size, parallel={"sequence_parallel": sp},
            optimizer={"grad_clip": 0.0}, training={"seed": seed}))
        got = engine.generate(prompt, 6, generator=torch.Generator().manual_seed(0))
        out[f"sp={sp}"] = bool(torch.equal(got, ref))
    return out


def suite_worker(cfg: GPTConfig, seed: int, batches: list, layouts: list,
                 resume: tuple | None, comm_table: tuple | None, root: str) -> dict:
    """Everything one world size checks, in one spawn (process start-up dominates)."""
    out = {"layers": layers_worker(), "gpt": gpt_worker(cfg, seed, batches, layouts),
           "dropout": dropout_worker(cfg, seed, batches[0]),
           "generate": generate_worker(cfg, seed)}
    if resume is not None:
        out["resume"] = resume_worker(cfg, seed, batches, *resume, root)
    if comm_table is not None:
        out["comm_table"] = comm_table_worker(*comm_table)
        out["gpt_comm"] = gpt_comm_worker(cfg, seed, batches[0])
    return out
