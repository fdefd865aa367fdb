"""How far bf16 rounding alone moves a short run: selective recomputation and torch.compile
against the eager plain run, on this machine's CPU.

    python benchmarks/recompute_numerics.py

A 2-layer Llama (64 wide, 4 heads, 2 kv heads, vocabulary 96), 4 optimizer steps of 4 x 32
tokens in 2 micro-batches, AdamW at lr 1e-2 with clipping, in bf16 (fp32 masters) and in
fp32; eager or every block compiled; ``parallel.recompute`` off or "selective". Prints each
pair's last loss and worst per-tensor relative parameter difference. It is the yardstick for
the GPU test ``tests/test_recompute.py::test_selective_checkpointing_on_cuda_gives_the_plain_
gradients``: on the CPU the selective run differs from the plain one by rounding only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shardwise.base.topology import Topology  # noqa: E402
from shardwise.engine import Engine, EngineConfig  # noqa: E402
from shardwise.models.llama import LlamaConfig  # noqa: E402

CFG = LlamaConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_kv_heads=2, n_embd=64,
                  ffn_hidden=128)


def train(recompute, compile_: bool, precision: str):
    torch.manual_seed(0)
    s = EngineConfig(
        seq_len=32, parallel={"micro_batches": 2, "recompute": recompute},
        optimizer={"lr": 1e-2, "grad_clip": 1.0, "fused": True},
        training={"seed": 3, "global_batch_size": 4, "compile": compile_, "precision": precision})
    e = Engine(CFG, Topology.build(1, 1, 1), s)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        x = torch.randint(0, 96, (4, 33), generator=g)
        losses.append(e.train_step(x[:, :-1], x[:, 1:])["loss"])
    return losses, {n: p.detach().clone() for n, p in e.named_parameters()}


def rel(a: dict, b: dict) -> float:
    return max(((a[n].double() - b[n].double()).norm() / a[n].double().norm()).item() for n in a)


def main() -> int:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU", flush=True)
    for precision in ("bf16", "fp32"):
        plain = train(False, False, precision)
        for label, run in (("compiled", (False, True)), ("selective, compiled", ("selective", True)),
                           ("selective, eager", ("selective", False))):
            other = train(*run, precision)
            print(f"{precision}: {label:20s} vs eager plain: last loss {other[0][-1]:.6f} vs "
                  f"{plain[0][-1]:.6f}, worst parameter rel. difference {rel(plain[1], other[1]):.2e}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
