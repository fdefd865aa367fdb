"""Stage balance of the GPT cut by layer count, parameter count and profiled time.

Profiles every layer's forward+backward (median of repeats, one thread) and activation size,
cuts the ``n_layer + 2`` layers into ``--parts`` stages three ways, and reports each stage's
measured time and the imbalance (slowest / mean) of each cut.

    .venv/bin/python benchmarks/pipeline_partition.py --parts 4 --vocab 4096
"""

from __future__ import annotations

import argparse

import torch

from shardwise.models import GPT, GPTConfig
from shardwise.parallel.pipeline.partition import (
    Partition,
    balanced,
    gpt_layers,
    partition_layers,
    profile_layers,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=9)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=a.vocab, block_size=a.seq, n_layer=a.layers,
                          n_embd=a.embd, tie_weights=False))
    names, layers = zip(*gpt_layers(model))
    sample = torch.randint(0, a.vocab, (a.batch, a.seq))
    prof = profile_layers(layers, sample, repeats=a.repeats)
    print(f"GPT n_layer={a.layers} n_embd={a.embd} vocab={a.vocab}, micro-batch {a.batch} x {a.seq}")
    for n, s, b, p in zip(names, prof.seconds, prof.activation_bytes, prof.params):
        print(f"  {n:10} fwd+bwd {s * 1e3:7.2f} ms  output {b / 1024:7.0f} KiB  params {p:8d}")
    for by in ("layers", "params", "time"):
        # "time" reuses the profile above instead of profiling again
        part = balanced(prof.seconds, a.parts) if by == "time" else partition_layers(layers, a.parts, by=by)
        # judge every cut by the measured times
        timed = Partition(part.bounds, tuple(sum(prof.seconds[i] for i in part.layers(k))
                                             for k in range(part.parts)))
        stages = "  ".join(f"{timed.costs[k] * 1e3:6.2f}" for k in range(part.parts))
        print(f"by {by:6}: bounds {list(part.bounds)}  stage ms {stages}  "
              f"imbalance {timed.imbalance:.3f}")


if __name__ == "__main__":
    main()
