"""Rank functions for the pipeline tests (run inside ``shardwise.launch.spawn``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.func import functional_call

from shardwise.base.topology import Topology, init_process_groups
from shardwise.engine import Engine, EngineConfig
from shardwise.models import GPT, GPTConfig
from shardwise.parallel.pipeline.partition import gpt_layers, partition_layers
from shardwise.parallel.pipeline.schedules import Backward, Forward
from shardwise.parallel.pipeline.stage import gpt_chunks, lm_loss
from shardwise.parallel.pipeline.stream import cut

MODEL = dict(vocab_size=65, block_size=16, n_layer=6, n_head=4, n_embd=32, tie_weights=False)
BATCH, LR, SEED = 8, 3e-3, 1234


def batches(steps: int, batch: int = BATCH, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable toy data: the next token is the current one plus one (mod V)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, MODEL["vocab_size"], (batch, MODEL["block_size"]), generator=g)
        out.append((idx, (idx + 1) % MODEL["vocab_size"]))
    return out


def _model() -> GPT:
    torch.manual_seed(SEED)
    return GPT(GPTConfig(**MODEL))


def _adamw(named):
    """AdamW as the engine builds it: weight decay on matrices only."""
    params = [p for _, p in named]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=LR)


def make_engine(topo, cfg: dict, batch: int = BATCH) -> Engine:
    """The engine for a pipeline test layout: ``cfg`` holds schedule, micro_batches,
    chunks_per_rank, partition, recompute, bucket sizes (``batch``: the global batch)."""
    cfg = dict(cfg)
    measure, clip = cfg.pop("measure_memory", False), cfg.pop("clip", 0.0)
    settings = EngineConfig( seq_len=MODEL["block_size"], parallel={"allreduce": "auto", **cfg},
                            optimizer={"lr": LR, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.01,
                                       "grad_clip": clip}, training={"seed": SEED,
                                                                     "global_batch_size": batch})
    return Engine(GPTConfig(**MODEL), topo, settings, measure_memory=measure)


def reference(steps: int = 5) -> dict:
    """One process, whole global batch, plain GPT + AdamW."""
    model = _model()
    opt = _adamw(list(model.named_parameters()))
    losses = []
    for idx, tgt in batches(steps):
        _, loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _topology(dp: int, pp: int):
    return init_process_groups(Topology.build(dp, pp, 1, rank=dist.get_rank(),
                                              world_size=dist.get_world_size()))


def run_pipeline(dp: int, pp: int, cfg: dict, steps: int = 5, run_dir: str | None = None) -> dict:
    """Train ``steps`` global batches with the pipeline; report losses, this rank's params
    (GPT names), peak activation bytes and, for PipeDream, the weight versions seen."""
    topo = _topology(dp, pp)
    engine = make_engine(topo, dict(cfg, measure_memory=True))
    versions: list[dict] = []  # PipeDream: the weights each forward / backward saw
    engine.executor.watch = _record_versions(versions)
    losses, in_flight = [], []
    share = BATCH // dp
    for idx, tgt in batches(steps):
        rows = slice(topo.dp_rank * share, (topo.dp_rank + 1) * share)
        losses.append(engine.train_step(idx[rows], tgt[rows])["loss"])
        in_flight.append(engine.executor.in_flight)
    ex = engine.executor
    if run_dir is not None:
        engine.save_timeline(run_dir)
    engine.drain()  # PipeDream: the backwards still in flight (flush schedules: nothing)
    sync = getattr(engine.sync, "sync", None)  # ZeRO-1/2: its own buckets
    return {"losses": losses, "dp_rank": topo.dp_rank, "pp_rank": topo.pp_rank,
            "in_flight": in_flight,
            "buckets": None if sync is None else (len(sync.buckets), sync.launched_early),
            "params": {n: p.detach().clone() for n, p in engine.named_parameters()},
            "peak_activation_bytes": ex.meter.peak, "versions": versions,
            "bounds": list(engine.partition.bounds)}


def _checksum(params) -> float:
    """A fingerprint of a set of weights (float64 sum of squares and sum)."""
    return float(sum((p.detach().double() ** 2).sum() + p.detach().double().sum()
                     for p in params))


def _record_versions(out: list[dict]):
    """An ``Executor.watch`` hook: each stashing forward's and each backward's weight version
    and the checksum of the stashed weights (and, in backward, of the live ones) into
    ``out``."""
    def watch(kind: str, op, version: int, stash: dict, chunk) -> None:
        row = {"mb": op.mb, "chunk": op.chunk, "pass": kind, "version": version,
               "checksum": _checksum(stash.values())}
        if kind == "backward":
            row["live_checksum"] = _checksum(chunk.parameters())
        out.append(row)
    return watch


def run_many(dp: int, pp: int, cfgs: list[dict], steps: int = 5,
             run_dir: str | None = None) -> list[dict]:
    """``run_pipeline`` for several configurations in one process group (fewer spawns);
    with ``run_dir``, configuration i saves its last step's timeline under ``run_dir/i``."""
    return [run_pipeline(dp, pp, cfg, steps, None if run_dir is None else f"{run_dir}/{i}")
            for i, cfg in enumerate(cfgs)]


def run_groups(groups: list[tuple]) -> list[list[dict]]:
    """``run_many(*group)`` for each group in turn: several (dp, pp) shapes and step counts
    in one spawn of ranks (each group builds its own process groups)."""
    return [run_many(*group) for group in groups]


def pipedream_reference(pp: int, m: int, steps: int) -> dict:
    """One process running PipeDream's stream (``steps`` steps, then the drain) exactly: one
    AdamW per stage, stepped after each of that stage's backwards; each forward on a copy of
    the stage's weights as they are then, its backward through that copy (weight stashing).
    Stages take turns in any order their lists and data dependencies allow: each stage's
    state depends only on its own list, so the result is the one every order gives."""
    model = _model()
    part = partition_layers([layer for _, layer in gpt_layers(model)], pp, by="layers")
    chunks = gpt_chunks(model, part, range(pp))
    opts = [_adamw(list(chunks[c].model_parameters())) for c in range(pp)]
    segments, drain = cut(pp, m, steps)
    orders = [[op for lists in segments + [drain] for op in lists[r]
               if isinstance(op, (Forward, Backward))] for r in range(pp)]
    data = [(x.chunk(m), y.chunk(m)) for x, y in batches(steps)]
    acts, grads, saved = {}, {}, {}
    losses: list[list[float]] = [[] for _ in range(steps)]
    pc = [0] * pp
    while any(pc[r] < len(orders[r]) for r in range(pp)):
        for r in range(pp):
            while pc[r] < len(orders[r]):
                op, last = orders[r][pc[r]], r == pp - 1
                step, i = divmod(op.mb, m)
                if isinstance(op, Forward):
                    if r > 0 and (op.mb, r - 1) not in acts:
                        break
                    x = data[step][0][i] if r == 0 else acts.pop((op.mb, r - 1)).requires_grad_()
                    stash = {n: p.detach().clone().requires_grad_()
                             for n, p in chunks[r].named_parameters()}
                    out = functional_call(chunks[r], stash, (x,))
                    if last:
                        loss = lm_loss(out, data[step][1][i])
                        losses[step].append(loss.item())
                        out = loss / m
                    else:
                        acts[(op.mb, r)] = out.detach()
                    saved[(op.mb, r)] = (x, out, stash)
                else:
                    if not last and (op.mb, r) not in grads:
                        break
                    x, out, stash = saved.pop((op.mb, r))
                    out.backward(None if last else grads.pop((op.mb, r)))
                    for p, s in zip(chunks[r].parameters(), stash.values()):
                        p.grad = s.grad
                    opts[r].step()
                    opts[r].zero_grad(set_to_none=True)
                    if r > 0:
                        grads[(op.mb, r - 1)] = x.grad
                pc[r] += 1
    return {"losses": [sum(ls) / m for ls in losses],
            "params": {n: p.detach().clone() for c in chunks.values()
                       for n, p in c.model_parameters()}}


def run_evaluations(cfgs: list[dict], steps: int = 3) -> list[dict]:
    """pp = the world size, for each layout of ``cfgs``: the loss of batch 0 before training
    (``Engine.loss``: the forward-only pass through the stages), then ``steps`` steps twice
    from the same start, the second time with an evaluation after every step (PipeDream:
    mid-stream, micro-batches in flight). -> per layout {"loss0", "plain", "evaluated"}, the
    last two [(loss, micro-batches in flight after the step)]."""
    topo = _topology(1, dist.get_world_size())
    out = []
    for cfg in cfgs:
        data = batches(steps)
        row = {}
        for key in ("plain", "evaluated"):
            engine = make_engine(topo, cfg)
            row.setdefault("loss0", engine.loss(*data[0]))
            row[key] = []
            for idx, tgt in data:
                loss = engine.train_step(idx, tgt)["loss"]
                if key == "evaluated":
                    engine.loss(*data[0])
                row[key].append((loss, engine.executor.in_flight))
            engine.drain()
        out.append(row)
    return out
