"""The planner's public functions refuse what they cannot price (issue 44): each given a
layout the engine cannot run raises ``ValueError`` naming the reason, one table of
layouts for every function (no processes, no timing). What the search prunes as the same
as another layout is priced as that one, as documented (``feasible.check``): ZeRO at
dp x cp = 1 as ZeRO-0, FP8 on a GPU without FP8 as bf16."""

import pytest

from shardwise.planner.hardware import PRESETS
from shardwise.planner.search import memory_of, plan, quick_estimate
from shardwise.planner.simulate import Layout, simulate
from shardwise.planner.specs import NAMED

GPT = NAMED["gpt2-124m"]
A100 = PRESETS["dgx-a100-80gb"]

BAD = [  # (layout, words the reason names)
    (Layout(0, 1, 1, 1, 1), "dp=0"),
    (Layout(1, 1, 1, 0, 1), "micro_batch_size=0"),
    (Layout(1, 1, 1, 1, -2), "micro_batches=-2"),
    (Layout(2, 1, 1, 1, 1, zero=4), "zero=4"),
    (Layout(1, 1, 2, 1, 2, schedule="zigzag"), "schedule 'zigzag'"),
    (Layout(1, 1, 2, 1, 2, partition="bytes"), "partition 'bytes'"),
    (Layout(1, 1, 2, 1, 4, "interleaved", 1), "interleaved with chunks_per_rank=1"),
    (Layout(1, 1, 2, 1, 4, "1f1b", 2), "chunks_per_rank=2 with parallel.schedule=1f1b"),
    (Layout(1, 1, 1, 1, 1, cp=4, cp_a2a=3), "cp_a2a=3 does not divide cp=4"),
    (Layout(1, 1, 1, 1, 1, recompute="sometimes"), "recompute='sometimes'"),
    (Layout(1, 5, 1, 1, 1), "tp=5 does not divide the 12 heads"),
    (Layout(1, 1, 20, 1, 20), "= 20 chunks, more than the 14 layers"),
    (Layout(1, 1, 3, 1, 4, "interleaved", 2), "multiple of parallel.pp=3"),
    (Layout(1, 1, 1, 1, 1, cp=3), "not divisible by 2 x parallel.cp = 6"),
    (Layout(2, 1, 1, 1, 1, ep=2), "parallel.ep=2 with model.n_experts=0"),
    (Layout(2, 1, 1, 1, 1, zero=1, dp_replicate=3), "dp_replicate=3 must divide dp=2"),
]

FUNCTIONS = {  # every public function that prices a layout
    "simulate": lambda lay: simulate(GPT, lay, A100, "bf16"),
    "memory_of": lambda lay: memory_of(GPT, lay, "bf16"),
    "quick_estimate": lambda lay: quick_estimate(GPT, lay, A100, "bf16"),
}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_every_function_refuses_every_infeasible_layout(name):
    for lay, why in BAD:
        with pytest.raises(ValueError) as err:
            FUNCTIONS[name](lay)
        assert why in str(err.value), (name, lay, str(err.value))


def test_feasible_layouts_are_still_priced():
    for lay in (Layout(1, 1, 1, 1, 1), Layout(2, 2, 2, 1, 4, "interleaved", 2, zero=1),
                Layout(1, 1, 1, 1, 1, zero=3),  # ZeRO at dp 1: priced as ZeRO-0
                Layout(1, 1, 1, 1, 1, fp8=True)):  # FP8 on the A100: priced as bf16
        assert simulate(GPT, lay, A100, "bf16")["step"] > 0
        assert memory_of(GPT, lay, "bf16")["total"] > 0
        assert quick_estimate(GPT, lay, A100, "bf16") > 0


@pytest.mark.parametrize("world,batch,why", [(0, 8, "world=0"), (8, 0, "global_batch=0"),
                                             (2.5, 8, "world=2.5")])
def test_plan_refuses_sizes_it_cannot_search(world, batch, why):
    with pytest.raises(ValueError, match=why.replace(".", r"\.")):
        plan(GPT, A100, world, batch)
