"""Record what the planner predicts (memory per GPU, simulated step time and its split) for a
fixed sample of layouts, so that a faster search can be held to the same numbers
(``tests/test_planner_search.py``). Recorded from commit 2164532 (before the fast search;
the presets then had one fixed efficiency, now ``FIXED_PRESETS``, and ZeRO-3 no overlap):

    PYTHONPATH=src python tests/data/make_planner_baseline.py
"""

import json
import random
from dataclasses import asdict, replace
from pathlib import Path

from shardwise.planner.hardware import FIXED_PRESETS
from shardwise.planner.search import enumerate_layouts, memory_of, prune_reason
from shardwise.planner.simulate import Layout, simulate
from shardwise.planner.specs import NAMED

CASES = [  # model, cluster, GPUs, global batch, micro-batch sizes, layouts kept (None: all)
    ("gpt2-350m", "dgx-a100-80gb", 8, 64, [1, 2, 4, 8], 300),
    ("llama3-8b", "dgx-h100", 16, 32, [1, 2], 120),
    ("megatron-39b", "dgx-a100-80gb", 64, 128, [1, 2], 120),
    ("gpt3-13b", "dgx-a100-40gb", 32, 64, [1, 2], 80),
    ("megatron-146b", "dgx-a100-80gb", 192, 96, [1], 24),
]
# and two of the published layouts of Megatron-LM's Table 1 (model, cluster, Layout fields)
EXTRA = [("megatron-1t", "dgx-a100-80gb", (6, 8, 64, 1, 512, "interleaved", 2, 0, True, False, "params")),
         ("megatron-530b", "dgx-a100-80gb", (9, 8, 35, 1, 280, "1f1b", 1, 0, True, False, "params"))]


def main() -> None:
    rng = random.Random(0)
    rows = []
    for name, cl, world, batch, mbs, keep in CASES:
        spec, cluster = NAMED[name], replace(FIXED_PRESETS[cl], zero3_overlap=False)
        lays = [lay for lay, why in enumerate_layouts(spec, world, batch, micro_batches=mbs)
                if why is None and prune_reason(spec, lay, cluster, False) is None]
        if keep is not None and len(lays) > keep:
            lays = rng.sample(lays, keep)
        for lay in lays:
            mem = memory_of(spec, lay, cluster.precision)
            t = simulate(spec, lay, cluster)
            rows.append({"model": name, "cluster": cl, "layout": asdict(lay),
                         "memory": mem, "time": t})
        print(name, len(lays), flush=True)
    for name, cl, fields in EXTRA:
        spec, cluster, lay = NAMED[name], replace(FIXED_PRESETS[cl], zero3_overlap=False), Layout(*fields)
        rows.append({"model": name, "cluster": cl, "layout": asdict(lay),
                     "memory": memory_of(spec, lay, cluster.precision),
                     "time": simulate(spec, lay, cluster)})
    out = Path(__file__).with_name("planner_baseline.json")
    out.write_text("[\n" + ",\n".join(json.dumps(r, sort_keys=True) for r in rows) + "\n]\n")
    print(len(rows), "layouts ->", out)


if __name__ == "__main__":
    main()
