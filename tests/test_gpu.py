"""Several ranks on one GPU (``training.device = "cuda"``, ``parallel.backend = "gloo"``):
every collective on CUDA tensors through host staging, and a layout trained against one
process. Marked ``gpu``: skipped without CUDA. The whole parity suites run in this mode with
``SHARDWISE_TEST_DEVICE=cuda pytest tests/test_layouts.py ...`` (tests/conftest.py)."""

import pytest
import torch

import gpu_workers
from ddp_workers import tiny_config, train
from layout_workers import layouts_worker
from shardwise.launch import spawn

pytestmark = pytest.mark.gpu


def test_every_collective_on_cuda_tensors_over_gloo_equals_the_cpu():
    for rank, res in enumerate(spawn(gpu_workers.staged_collectives, 4, device="cuda",
                                     backend="gloo")):
        assert res["bad"] == [], f"rank {rank}: {res['bad'][:5]}"
        assert res["count"] > 100


def test_a_2x2x2_layout_on_one_gpu_equals_one_process(corpus, tmp_path):
    def cfg(**sections):
        c = tiny_config(str(corpus), str(tmp_path), **sections)
        c["training"].update(device="cuda", tf32=False)
        c["parallel"]["backend"] = "gloo"
        return c

    ref = train(cfg(training={"seed": 2}))
    layout = cfg(parallel={"dp": 2, "tp": 2, "pp": 2, "zero": 1, "micro_batches": 2},
                 training={"seed": 2})
    ranks = spawn(layouts_worker, 8, ([layout],), device="cuda", backend="gloo")
    for rank in ranks:
        got = rank[0]
        assert torch.allclose(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                              rtol=1e-5, atol=0)
        for name, t in got["params"].items():
            want = ref["params"][name].float().cpu()
            err = (t.float().cpu() - want).norm() / want.norm().clamp_min(1e-12)
            assert err <= 1e-5, (name, float(err))
