"""Rank functions for ``test_meta_init.py``: build this rank's part of the GPT (meta
construction + replayed initialisation) and report its parameters or its memory."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.base.topology import Topology, init_process_groups
from shardwise.engine.model import build_local_model
from shardwise.models.gpt import GPTConfig
from shardwise.models.llama import LlamaConfig
from shardwise.parallel.tensor_parallel.group import RankGroup


def _topology(dp: int, pp: int, tp: int):
    topo = init_process_groups(Topology.build(dp, pp, tp, rank=dist.get_rank(),
                                              world_size=dist.get_world_size()))
    return topo, (RankGroup.from_topology(topo) if tp > 1 else RankGroup())


def _local(cfg, dp: int, pp: int, tp: int, v: int, seed: int, made=None):
    topo, group = made or _topology(dp, pp, tp)
    chunk_ids = [c for c in range(pp * v) if c % pp == topo.pp_rank]
    return build_local_model(cfg, pp=pp, pp_rank=topo.pp_rank, chunk_ids=chunk_ids,
                             n_chunks=pp * v, tp=group, seed=seed, dropout_seed=0,
                             device=torch.device("cpu"))


def local_params_worker(layouts: list[dict], seed: int) -> list[dict]:
    """Per layout: this rank's parameters (full GPT names) with their ``tp_dim`` (-1 when
    replicated) and this rank's tp coordinates."""
    out = []
    for lay in layouts:
        cfg = GPTConfig(**lay["gpt"])
        local = _local(cfg, lay["dp"], lay["pp"], lay["tp"], lay.get("v", 1), seed)
        seen, params = set(), {}
        for c in sorted(local.chunks):
            for name, p in local.chunks[c].model_parameters():
                key = name if id(p) not in seen else name + "#shared"
                seen.add(id(p))
                params[key] = (p.detach().clone(), getattr(p, "tp_dim", -1))
        out.append({"params": params, "tp_rank": local.tp.rank, "tp_size": local.tp.size})
    return out


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def current_rss() -> int:
    """Resident bytes now (``VmRSS``), after resetting the peak (``VmHWM``) to it where the
    kernel allows (``/proc/self/clear_refs`` = 5), so ``peak_rss`` measures from here."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status("VmRSS")


def peak_rss() -> int:
    """Peak resident bytes (``VmHWM``) since the last ``current_rss`` (since start-up where
    the peak cannot be reset, which only overstates the rise)."""
    return _status("VmHWM")


def memory_worker(sizes: dict, dp: int, pp: int, tp: int, seed: int, kind: str = "gpt") -> dict:
    """Peak resident memory gained (``VmHWM`` after minus ``VmRSS`` before, bytes) while
    this rank builds its part of the GPT (``kind`` "gpt") or the Llama ("llama") of
    ``sizes``, the bytes of parameters it holds, and what the one-time imports of meta
    construction took (bytes)."""
    torch.set_num_threads(1)
    made = _topology(dp, pp, tp)  # process groups are not the model's memory
    # the first build imports torch's meta kernels and decompositions and the build's own
    # modules, whatever the model's size: 10 MiB in the development checkout, 31 MiB in a
    # fresh clone, where a warm-up with the GPT alone left the Llama's share inside the rise
    # (76.6 MiB of a 74.0 MiB bound); warm them with a tiny model of the same kind, built
    # the same way, so the rise is the model's own
    warm = current_rss()
    tiny = {"vocab_size": 64, "n_layer": pp, "n_head": 2 * tp, "n_embd": 8 * tp, "block_size": 8}
    if kind == "llama":
        tiny.update(n_kv_heads=tp, ffn_hidden=16 * tp)
    _local(LlamaConfig(**tiny) if kind == "llama" else GPTConfig(**tiny), dp, pp, tp, 1, seed,
           made)
    imports = current_rss() - warm
    before = current_rss()
    cfg = LlamaConfig(**sizes) if kind == "llama" else GPTConfig(**sizes)
    local = _local(cfg, dp, pp, tp, 1, seed, made)
    after = peak_rss()
    held = sum(p.numel() * p.element_size() for _, p in local.named_parameters())
    return {"rise": after - before, "held": held, "imports": imports}
