"""Every tensor the library creates is on the run's device, in a dtype of the run, at scale.

The layouts of the parity suite (dp with ZeRO 0-3, tp x dp with sequence parallelism,
dp x tp x pp with 1F1B / interleaved / GPipe / PipeDream, cp, MoE with ep, bf16 and fp16),
for the GPT and the Llama, at world sizes 8 to 64: the first and the last rank of each
(pipeline stages differ) build their engine and train two steps in this process under
torch's fake process group, every aten op watched by ``placement.PlacementCheck``
(construction, forward, backward, gradient sync, ZeRO's shards and sharded step, pipeline
send/recv, the all-to-all of the experts). Values are garbage; placement is the check.

On the CPU the run's device is ``meta``, where a tensor created without ``device=`` shows
up on the CPU. On meta the engine keeps its parameters there (``build_local_model`` skips
materialising), so materialisation and the initialisation replay are checked on CUDA only:
with a GPU (``pytest -m gpu tests/test_placement.py``) the device is ``cuda``, with computed
values (host reads, routing; collectives still deliver nothing) and the library's CUDA
branches (fused AdamW, the foreach norm). The app's ``Trainer`` (its batches, step, evaluation, sampling) runs in four
of the layouts. The ``test_a_*_is_caught`` tests plant a stray tensor (a CPU gradient-norm
accumulator, a CPU pipeline receive buffer, an fp16 loss in an fp32 run) and require the
check to name it, on both devices. Under ``training.offload = "optimizer"`` (ZeRO 0-3 and a
3D layout) the fp32 masters and AdamW's moments are on the host and nothing else leaves the
device (``placement_run._state_placement``); under ``"optimizer+params"`` (ZeRO-3 fp32 and
bf16, and a 3D layout) ZeRO-3's parameter shards too, its gradient shards staying on the
device.
"""

from __future__ import annotations

import pytest
import torch

from placement_run import run_rank

UNTIED = {"tie_weights": False}
SP = {"sequence_parallel": True}
BF16 = {"precision": "bf16"}
MOE = {"kind": "llama", "n_experts": 8, "top_k": 2}
OFFLOAD = {"offload": "optimizer"}
PARAMS = {"offload": "optimizer+params"}

# name -> (world size, config sections); model.kind is added per test
LAYOUTS: dict[str, tuple[int, dict]] = {
    **{f"dp8-z{z}": (8, {"parallel": {"dp": 8, "zero": z}}) for z in (0, 1, 2, 3)},
    "dp8-z3-bf16": (8, {"parallel": {"dp": 8, "zero": 3}, "training": BF16}),
    "dp4xtp4-sp-recompute-z1": (16, {"parallel": {"dp": 4, "tp": 4, "zero": 1, "recompute": True,
                                                  **SP}}),
    "dp2xtp2xpp4-1f1b-z1": (16, {"parallel": {"dp": 2, "tp": 2, "pp": 4, "zero": 1,
                                              "micro_batches": 4}}),
    "dp2xpp4-1f1b-partition-by-time": (8, {"parallel": {"dp": 2, "pp": 4, "micro_batches": 2,
                                                        "partition": "time"}}),
    "dp2xtp2xpp2-interleaved-z2-bf16": (8, {"parallel": {
        "dp": 2, "tp": 2, "pp": 2, "zero": 2, "micro_batches": 2, "schedule": "interleaved",
        "chunks_per_rank": 2}, "model": UNTIED, "training": BF16}),
    "dp2xtp2xpp2-gpipe-z0": (8, {"parallel": {"dp": 2, "tp": 2, "pp": 2, "micro_batches": 2,
                                              "schedule": "gpipe"}, "model": UNTIED}),
    "dp2xpp4-pipedream": (8, {"parallel": {"dp": 2, "pp": 4, "micro_batches": 4,
                                           "schedule": "pipedream"}, "model": UNTIED,
                              "optimizer": {"grad_clip": 0.0}}),
    "dp2xtp2xpp2-fp16-z1": (8, {"parallel": {"dp": 2, "tp": 2, "pp": 2, "zero": 1,
                                             "micro_batches": 2}, "training": {"precision": "fp16"}}),
    "dp4xpp4xtp4-sp-bf16-z1": (64, {"parallel": {"dp": 4, "pp": 4, "tp": 4, "zero": 1,
                                                 "micro_batches": 2, **SP}, "training": BF16}),
    "dp2xcp4-z1": (8, {"parallel": {"dp": 2, "cp": 4, "zero": 1}}),
    "dp2xpp2xcp2xtp2-sp-bf16": (16, {"parallel": {"dp": 2, "pp": 2, "cp": 2, "tp": 2,
                                                  "micro_batches": 2, **SP}, "training": BF16}),
    # packed documents: each micro-batch's (B, 1, T, T) document mask, built on every stage
    # from its tokens (the end-of-text id 0 of these random batches), and in the ring's pairs
    "dp2xtp2xpp2-sp-1f1b-doc": (8, {"parallel": {"dp": 2, "tp": 2, "pp": 2,
                                                 "micro_batches": 2, **SP},
                                    "model": {"attention_mask": "block_causal"}}),
    "dp2xcp2-doc": (4, {"parallel": {"dp": 2, "cp": 2},
                        "model": {"attention_mask": "block_causal"}}),
    "moe-dp8-ep4-z1": (8, {"parallel": {"dp": 8, "ep": 4, "zero": 1}, "model": MOE}),
    "moe-dp8xtp2-ep8-bf16": (16, {"parallel": {"dp": 8, "tp": 2, "ep": 8, "zero": 2},
                                  "model": {**MOE, "n_embd": 64}, "training": BF16}),
    # training.offload = "optimizer": masters and moments on the host (_state_placement),
    # the parameters, gradients and everything else on the device
    **{f"dp8-z{z}-offload": (8, {"parallel": {"dp": 8, "zero": z}, "training": OFFLOAD})
       for z in (0, 1, 2)},
    "dp8-z3-bf16-offload": (8, {"parallel": {"dp": 8, "zero": 3},
                                "training": {**BF16, **OFFLOAD}}),
    # and the blocks' saved activations on the host (parallel.activation_offload: copies)
    "dp2xtp2xpp2-sp-bf16-z1-offload": (8, {"parallel": {"dp": 2, "tp": 2, "pp": 2, "zero": 1,
                                                        "micro_batches": 2, **SP,
                                                        "activation_offload": True},
                                           "model": UNTIED, "training": {**BF16, **OFFLOAD}}),
    # training.offload = "optimizer+params": ZeRO-3's parameter shards on the host too (in
    # fp32 the masters are them), its gradient shards and the gathered units on the device
    "dp8-z3-offload-params": (8, {"parallel": {"dp": 8, "zero": 3}, "training": PARAMS}),
    "dp8-z3-bf16-offload-params": (8, {"parallel": {"dp": 8, "zero": 3},
                                       "training": {**BF16, **PARAMS}}),
    "dp2xtp2xpp2-sp-bf16-z3-offload-params": (8, {"parallel": {"dp": 2, "tp": 2, "pp": 2,
                                                               "zero": 3, "micro_batches": 2,
                                                               **SP},
                                                  "model": UNTIED,
                                                  "training": {**BF16, **PARAMS}}),
}
KINDS = ("gpt", "llama")
CASES = [pytest.param(name, kind, id=f"{name}-{kind}") for name in LAYOUTS for kind in KINDS
         if kind == "llama" or "kind" not in LAYOUTS[name][1].get("model", {})]


def _sections(name: str, kind: str) -> tuple[int, dict]:
    ws, sections = LAYOUTS[name]
    sections = {k: dict(v) for k, v in sections.items()}
    sections.setdefault("model", {}).setdefault("kind", kind)
    return ws, sections


def _ran(res, name: str, rank: int) -> None:
    """It ran: forward and backward, collectives (fake), the optimizer's update, every step."""
    assert res.backward_ops > 0, (name, rank)
    assert any(op.startswith("c10d.") for op in res.seen), (name, rank)
    assert {"aten.lerp_", "aten._fused_adamw_", "aten._foreach_lerp_"} & res.seen, (name, rank)
    assert len(res.losses) == 2, (name, rank, res.losses)


def _check(name: str, kind: str, device: str) -> None:
    ws, sections = _sections(name, kind)
    for rank in (0, ws - 1):
        res = run_rank(sections, rank, ws, torch.device(device))
        _ran(res, name, rank)
        seen = list(dict.fromkeys(str(v) for v in res.violations))
        assert not seen, f"{name} {kind} rank {rank} of {ws}: " + "; ".join(seen[:5])
        assert not res.structure, f"{name} {kind} rank {rank}: " + "; ".join(res.structure[:5])


@pytest.mark.parametrize("name, kind", CASES)
def test_placement_meta(name, kind):
    _check(name, kind, "meta")


@pytest.mark.gpu
@pytest.mark.parametrize("name, kind", CASES)
def test_placement_cuda(name, kind):
    _check(name, kind, "cuda")


TRAINER_CASES = [pytest.param(name, kind, id=f"{name}-{kind}") for name, kind in (
    ("dp2xtp2xpp4-1f1b-z1", "gpt"), ("dp8-z3-bf16", "llama"), ("moe-dp8xtp2-ep8-bf16", "llama"),
    ("dp2xpp2xcp2xtp2-sp-bf16", "gpt"))]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """A small plain-text corpus (no download, no package): 40 KB of a few sentences."""
    path = tmp_path_factory.mktemp("placement") / "text.txt"
    line = "Now is the winter of our discontent made glorious summer by this sun of York.\n"
    path.write_text(line * 500, encoding="utf-8")
    return str(path)


def _check_trainer(name: str, kind: str, device: str, corpus: str) -> None:
    ws, sections = _sections(name, kind)
    for rank in (0, ws - 1):
        res = run_rank(sections, rank, ws, torch.device(device), corpus=corpus)
        _ran(res, name, rank)
        seen = list(dict.fromkeys(str(v) for v in res.violations))
        assert not seen, f"trainer {name} {kind} rank {rank} of {ws}: " + "; ".join(seen[:5])
        assert not res.structure, f"{name} {kind} rank {rank}: " + "; ".join(res.structure[:5])


@pytest.mark.parametrize("name, kind", TRAINER_CASES)
def test_trainer_placement_meta(name, kind, text_file):
    """The language-model app's Trainer (batches, step, evaluate over dp) in four layouts."""
    _check_trainer(name, kind, "meta", text_file)


@pytest.mark.gpu
@pytest.mark.parametrize("name, kind", TRAINER_CASES)
def test_trainer_placement_cuda(name, kind, text_file):
    _check_trainer(name, kind, "cuda", text_file)


DEVICES = [pytest.param("meta", id="meta"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_stray_cpu_tensor_is_caught(monkeypatch, device):
    """A tensor made without ``device=`` inside the library (here: the gradient norm's
    accumulator, as ``torch.zeros(2, dtype=torch.float64)``) is reported with its line."""
    from shardwise.parallel import precision

    real = torch.zeros

    def stray(*args, **kwargs):
        if kwargs.get("dtype") is torch.float64 and args == (2,):
            kwargs.pop("device", None)
        return real(*args, **kwargs)

    monkeypatch.setattr(precision.torch, "zeros", stray)
    _, sections = _sections("dp8-z1", "gpt")
    res = run_rank(sections, 7, 8, torch.device(device), steps=1)
    assert any("device cpu" in str(v) and "precision.py" in v.where and "global_norm" in v.where
               for v in res.violations), [str(v) for v in res.violations]


@pytest.mark.parametrize("device", DEVICES)
def test_a_wrong_dtype_is_caught(monkeypatch, device):
    """A floating tensor in neither the compute dtype nor fp32 / fp64 (here: the loss of a
    fp32 run computed in fp16) is reported."""
    from shardwise.engine import model as engine_model

    real = engine_model.lm_loss_fp32
    monkeypatch.setattr(engine_model, "lm_loss_fp32",
                        lambda logits, targets, *rest: real(logits.half(), targets, *rest))
    _, sections = _sections("dp8-z0", "gpt")
    res = run_rank(sections, 0, 8, torch.device(device), steps=1)
    assert any("dtype torch.float16" in str(v) for v in res.violations), \
        [str(v) for v in res.violations]


@pytest.mark.parametrize("device", DEVICES)
def test_a_stray_pipeline_buffer_is_caught(monkeypatch, device):
    """A pipeline receive buffer made on the CPU (what ``Executor._recv_act`` would make
    without ``device=``) fails the run where the activation is used, naming where the
    buffer was made."""
    from placement import PlacementError
    from shardwise.parallel.pipeline.executor import Executor

    def stray(self, op):
        return "recv", torch.empty(self.act_shape, dtype=self.dtype), ("act", op.mb, op.chunk)

    monkeypatch.setattr(Executor, "_recv_act", stray)
    ws, sections = _sections("dp2xtp2xpp4-1f1b-z1", "llama")
    with pytest.raises(PlacementError, match=r"device cpu .* at parallel/pipeline/executor.py"):
        run_rank(sections, ws - 1, ws, torch.device(device), steps=1)
