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


def test_sliding_window_attention_on_cuda_equals_the_cpu():
    """A Llama with a window of 8 on its first layer (none on its second), fed 64 tokens:
    on CUDA, SDPA gets the band mask (FlashAttention cannot take one; another kernel
    runs), and its logits and gradients in fp32 (TF32 off) equal the CPU's."""
    from shardwise.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_kv_heads=2,
                      n_embd=64, sliding_window=8,
                      layer_types=("sliding_attention", "full_attention"))
    torch.manual_seed(0)
    cpu = Llama(cfg)
    gpu = Llama(cfg).cuda()
    gpu.load_state_dict(cpu.state_dict())
    idx = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        logits, loss = cpu(idx, idx)
        loss.backward()
        g_logits, g_loss = gpu(idx.cuda(), idx.cuda())
        g_loss.backward()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.testing.assert_close(g_logits.cpu(), logits, rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(cpu.named_parameters(), gpu.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-3, atol=1e-5, msg=name)
