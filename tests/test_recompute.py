"""Selective activation recomputation (``parallel.recompute = "selective"``): the same
losses and parameters as without it, bit for bit, and the ops it keeps for backward are the
matmuls and attention only. (Its memory saving is measured on a GPU: benchmarks/gpu_llama.py,
row "ours bf16 + selective recompute".)"""

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from conftest import REPO
from shardwise.base.config import Config, ConfigError
from shardwise.base.topology import Topology
from shardwise.engine import Engine, EngineSettings
from shardwise.models.llama import Block, LlamaConfig
from shardwise.parallel import activation_checkpoint as ac

CFG = LlamaConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_kv_heads=2, n_embd=32,
                  ffn_hidden=64)


def _train(recompute, steps=3):
    torch.manual_seed(0)
    s = EngineSettings(micro_batches=2, lr=1e-2, grad_clip=1.0, seed=3, batch_size=4,
                       seq_len=16, recompute=recompute)
    e = Engine(CFG, Topology.build(1, 1, 1), s)
    wrapped = [hasattr(layer.forward, "__wrapped__") for c in e.local.chunks.values()
               for layer in c.layers]
    assert all(wrapped) if recompute == "selective" else not any(wrapped)  # not a no-op
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 96, (4, 17), generator=g)
        losses.append(e.train_step(x[:, :-1], x[:, 1:])["loss"])
    return losses, {n: p.detach().clone() for n, p in e.named_parameters()}


def test_selective_recomputation_changes_nothing_but_memory():
    base_losses, base = _train(False)
    sel_losses, sel = _train("selective")
    assert sel_losses == base_losses
    assert base.keys() == sel.keys()
    for name in base:
        assert torch.equal(base[name], sel[name]), name


def test_the_policy_saves_matmuls_and_attention_and_recomputes_the_rest():
    decided = []

    def policy(ctx, op, *args, **kwargs):
        choice = ac._policy(ctx, op, *args, **kwargs)
        if not ctx.is_recompute:
            decided.append((str(op.overloadpacket).split(".")[-1], choice))
        return choice

    block = Block(CFG)
    x = torch.randn(2, 16, 32, requires_grad=True)
    y = checkpoint(block, x, use_reentrant=False,
                   context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    y.sum().backward()
    saved = {op for op, c in decided if c == ac.CheckpointPolicy.MUST_SAVE}
    recomputed = {op for op, c in decided if c != ac.CheckpointPolicy.MUST_SAVE}
    assert "mm" in saved or "addmm" in saved
    assert any("scaled_dot_product" in op for op in saved), saved
    assert {"mul", "silu"} <= recomputed, recomputed
    assert not any(op in recomputed for op in ("mm", "addmm", "bmm")), recomputed


def test_selective_is_accepted_with_every_layout_and_its_mode_is_checked():
    """tp, ZeRO-3, cp and experts no longer refuse selective recomputation (their forwards'
    collectives are replayed: ``comm.replay``); a mode outside the list is one line."""
    moe = {"kind": "llama", "n_experts": 4}
    for parallel, model in (({"tp": 2}, {}), ({"dp": 2, "zero": 3}, {}), ({"cp": 2}, {}),
                            ({"dp": 2, "ep": 2}, moe)):
        cfg = Config.from_dict({"parallel": {"recompute": "selective", **parallel},
                                "model": model})
        assert cfg.parallel.recompute == "selective"
    with pytest.raises(ConfigError, match=r"expected true, false, \"full\""):
        Config.from_dict({"parallel": {"recompute": "some"}})
    assert Config.from_dict({"parallel": {"recompute": "full"}}).parallel.recompute is True


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION",
                                     "MATH"])
def test_selective_checkpointing_on_cuda_gives_the_plain_gradients(backend):
    """What the engine's CUDA refusal waits for: a compiled bf16 Llama's gradients with and
    without ``checkpoint_selectively`` on every block, on the GPU (on an H100 the engine's
    selective row trained to another loss; docs/gpu.md), once per SDPA kernel, so that a
    failure names the kernel (torch picked cuDNN's on the H100; NeMo-RL saw cuDNN attention
    break activation checkpointing, NVIDIA-NeMo/RL#1676). On the CPU the same comparison in
    bf16 differs by rounding only (compiling alone moves a 4-step run's parameters more)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from shardwise.models.llama import Llama

    cfg = LlamaConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_heads=2,
                      n_embd=64, ffn_hidden=128)
    x = torch.randint(0, 256, (2, 65), device="cuda")
    grads = []
    for selective in (False, True):
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = Llama(cfg).cuda().bfloat16()
        for block in model.blocks:
            if selective:
                ac.checkpoint_selectively(block)
            block.compile()
        with sdpa_kernel(getattr(SDPBackend, backend)):
            _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
        grads.append({n: p.grad.float() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        err = (grads[1][name] - g).norm() / g.norm().clamp_min(1e-12)
        assert err < 2e-2, (backend, name, float(err))


def test_selective_on_cuda_is_refused_at_the_door_before_any_rank(monkeypatch, capsys, tmp_path):
    """Until the GPU check above has run, one line and exit 2, before any rank starts."""
    from shardwise import launch
    from shardwise.cli.main import main

    monkeypatch.setattr(launch, "pick_device", lambda *a, **k: ("cuda", None))
    code = main(["train", "--config", str(REPO / "configs/tiny.toml"), "--parallel.recompute", "selective",
                 "--training.out_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "parallel.recompute=selective on CUDA" in err and "\n" not in err
    assert not (tmp_path / "run").exists()
