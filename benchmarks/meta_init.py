"""Peak resident memory per rank while building this rank's part of a GPT or a Llama.

One spawn of 4 local gloo ranks (dp 1 x pp 2 x tp 2, 1 torch thread each) per mode; each
rank reports its peak rise over the measured call (``VmHWM`` after minus ``VmRSS`` before,
bytes, the peak reset to the current size just before the call by writing 5 to
``/proc/self/clear_refs``; where the kernel refuses, ``ru_maxrss``, which can only overstate
the rise), the bytes of parameters it holds and the time taken:

- ``full``: ``torch.manual_seed(seed); Model(cfg)``, what every rank did first before meta
  construction (a lower bound of the old path's peak: the whole model on every rank);
- ``local``: ``engine.model.build_local_model`` (the model on meta, this rank's layers
  sharded, materialised and given the single-process values by replaying the init stream);
- ``engine``: the whole ``Engine`` (the above, then the dp sync's buckets and the
  optimizer; in fp32 its peak measured the same as ``local``'s).

Before the measured call each rank builds a tiny model on meta once: the first meta
construction imports torch's meta kernels and decompositions (a fixed ~75 MiB whatever the
model, reported apart as ``imports``; code, not model).

``--model gpt`` (default; modes full, local, engine) writes ``OUT/meta_init.json`` and
``OUT/meta_init.txt``; ``--model llama`` (default sizes TinyLlama 1.1B's, Zhang et al. 2024:
22 layers x 2048, 32 heads, 4 key/value heads, SwiGLU 5632, vocabulary 32000: 4.1 GiB of
fp32 parameters; mode local only by default, since ``full`` holds the whole model on each
of the 4 ranks) writes ``OUT/meta_init_llama.json`` and ``OUT/meta_init_llama.txt``. The
issue's target: the rise at most 1.3x the bytes the rank holds, and never the whole model.

    python benchmarks/meta_init.py --n-layer 8 --n-embd 1024 --vocab 8192
    python benchmarks/meta_init.py --model llama          # ~7 GiB of RAM in all, minutes
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time
from pathlib import Path

import torch

MODES = ("full", "local", "engine")
TINYLLAMA = {"vocab_size": 32000, "n_layer": 22, "n_head": 32, "n_kv_heads": 4,
             "n_embd": 2048, "ffn_hidden": 5632, "block_size": 2048}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_peak() -> bool:
    """Reset ``VmHWM`` to ``VmRSS`` (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _now() -> int:
    return _status("VmRSS")


def _config(kind: str, sizes: dict):
    from shardwise.models import GPTConfig, LlamaConfig

    return (LlamaConfig if kind == "llama" else GPTConfig)(**sizes)


def _tiny(kind: str):
    from shardwise.models import GPT, GPTConfig, Llama, LlamaConfig

    if kind == "llama":
        return lambda: Llama(LlamaConfig(vocab_size=8, n_layer=1, n_head=1, n_embd=8))
    return lambda: GPT(GPTConfig(vocab_size=8, n_layer=1, n_head=1, n_embd=8))


def rank_worker(mode: str, kind: str, sizes: dict, pp: int, tp: int, seed: int) -> dict:
    import torch.distributed as dist

    from shardwise.base.topology import Topology, init_process_groups
    from shardwise.engine.engine import Engine, EngineConfig
    from shardwise.engine.model import build_local_model
    from shardwise.models import describe
    from shardwise.models.meta_init import record_init
    from shardwise.parallel.tensor_parallel.group import RankGroup

    torch.set_num_threads(1)
    cfg = _config(kind, sizes)
    topo = init_process_groups(Topology.build(1, pp, tp, rank=dist.get_rank(),
                                              world_size=dist.get_world_size()))
    # the first meta construction imports ~800 torch modules (meta kernels, decompositions),
    # a fixed cost whatever the model; measured apart so the rise is the model's own
    warm = _now()
    record_init(_tiny(kind))
    imports = _now() - warm
    reset = _reset_peak()
    before, t0 = _now(), time.perf_counter()
    if mode == "full":
        torch.manual_seed(seed)
        params = list(describe(cfg).build().parameters())
    elif mode == "local":
        group = RankGroup.from_topology(topo) if tp > 1 else RankGroup()
        local = build_local_model(cfg, pp=pp, pp_rank=topo.pp_rank, chunk_ids=[topo.pp_rank],
                                  n_chunks=pp, tp=group, seed=seed, dropout_seed=0,
                                  device=torch.device("cpu"))
        params = [p for _, p in local.named_parameters()]
    else:
        s = EngineConfig(
            seq_len=cfg.block_size, parallel={"micro_batches": 2}, optimizer={"grad_clip": 0.0},
            training={"seed": seed, "global_batch_size": 8})
        engine = Engine(cfg, topo, s, torch.device("cpu"))
        params = [p for _, p in engine.local.named_parameters()]
    secs = time.perf_counter() - t0
    peak = _status("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"rise": peak - before, "held": sum(p.numel() * p.element_size() for p in params),
            "seconds": secs, "imports": imports, "peak_reset": reset,
            "coords": {"pp": topo.pp_rank, "tp": topo.tp_rank}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    ap.add_argument("--n-layer", type=int, default=None)
    ap.add_argument("--n-embd", type=int, default=None)
    ap.add_argument("--n-head", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--modes", default=None, help="comma-separated, of full, local, engine "
                    "(default: all three for the GPT, local for the Llama)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "meta_init_results")
    a = ap.parse_args()
    from shardwise.launch import spawn
    from shardwise.models import describe

    if a.model == "llama":
        sizes = dict(TINYLLAMA)
        modes = ["local"]
    else:
        sizes = {"vocab_size": 8192, "n_layer": 8, "n_head": 16, "n_embd": 1024, "block_size": 64}
        modes = list(MODES)
    for key, value in (("n_layer", a.n_layer), ("n_embd", a.n_embd), ("n_head", a.n_head),
                       ("vocab_size", a.vocab)):
        if value is not None:
            sizes[key] = value
    if a.modes:
        modes = a.modes.split(",")
    with torch.device("meta"):
        model = describe(_config(a.model, sizes)).build()
    model_bytes = 4 * sum(p.numel() for p in model.parameters())
    largest = 4 * max(p.numel() for p in model.parameters())
    mib = lambda b: b / 2**20
    name = "GPT" if a.model == "gpt" else "Llama"
    head = (f"{name} {sizes}: {mib(model_bytes):.1f} MiB of fp32 parameters, largest tensor "
            f"{mib(largest):.1f} MiB; 4 ranks, pp 2 x tp 2; torch {torch.__version__}, "
            f"{platform.machine()}")
    columns = (f"{'mode':<7} {'rank':>4} {'held MiB':>9} {'peak rise MiB':>14} "
               f"{'rise/held':>9} {'rise/model':>10} {'rise-held MiB':>13} {'seconds':>8} "
               f"{'imports MiB':>11}")
    lines = [head, columns]
    results = {"model": a.model, "sizes": sizes, "model_bytes": model_bytes,
               "largest_tensor_bytes": largest}
    for mode in modes:
        rows = spawn(rank_worker, 4, (mode, a.model, sizes, 2, 2, 1337))
        results[mode] = rows
        for r, row in enumerate(rows):
            lines.append(f"{mode:<7} {r:>4} {mib(row['held']):>9.1f} {mib(row['rise']):>14.1f} "
                         f"{row['rise'] / row['held']:>9.3f} {row['rise'] / model_bytes:>10.3f} "
                         f"{mib(row['rise'] - row['held']):>13.1f} {row['seconds']:>8.2f} "
                         f"{mib(row['imports']):>11.1f}")
    stem = "meta_init" if a.model == "gpt" else "meta_init_llama"
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    (a.out / f"{stem}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
