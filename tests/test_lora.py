"""LoRA (issue 46): adapters on the targeted linears, the base frozen, in every layout.

The parity test spawns 8 ranks once and trains dp 2 x tp 2 x pp 2 under ZeRO-1 and then
ZeRO-3 (adapters on every column- and row-parallel linear of a tiny GPT), each against one
process: losses and every adapter within 1e-5 relative, the base never touched."""

import pytest
import torch

from ddp_workers import tiny_config
from helpers import rel_err
from lora_workers import lora_worker, run_lora
from shardwise.base.config import Config, ConfigError
from shardwise.launch import spawn

RTOL = 1e-5
# every linear of the GPT's blocks: q, k, v, fc column-parallel, out_proj, mlp.proj row
TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc", "blocks.*.mlp.proj"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "zeta"]
    ids = torch.randint(0, len(words), (6000,), generator=g).tolist()
    path = tmp_path_factory.mktemp("lora") / "corpus.txt"
    path.write_text(" ".join(words[i] for i in ids), encoding="utf-8")
    return str(path)


def _cfg(corpus: str, out: str, parallel: dict | None = None, **lora) -> dict:
    return tiny_config(corpus, out, training={"steps": 4, "global_batch_size": 8, "seed": 3},
                       optimizer={"lr": 1e-2, "warmup_steps": 1},
                       parallel={"micro_batches": 2, **(parallel or {})},
                       lora={"rank": 4, "alpha": 8.0, "targets": TARGETS, **lora})


def test_lora_dp2_tp2_pp2_zero1_and_zero3_match_one_process(corpus, tmp_path):
    ref = run_lora(_cfg(corpus, str(tmp_path / "ref"), {"dp": 1}))
    losses = torch.tensor(ref["losses"])
    assert losses[-1] < losses[0] and ref["base_unchanged"] and ref["base_grads"] == 0
    assert set(ref["params"]) == set(ref["piece_names"])  # the optimizer: adapters only
    assert all(n.endswith(("lora_A", "lora_B")) for n in ref["params"])
    assert len(ref["params"]) == 2 * 2 * len(TARGETS)  # 2 blocks, A and B each
    grid = {"dp": 2, "tp": 2, "pp": 2}
    layouts = {"zero1": _cfg(corpus, str(tmp_path / "z1"), {**grid, "zero": 1}),
               "zero3": _cfg(corpus, str(tmp_path / "z3"), {**grid, "zero": 3})}
    results = spawn(lora_worker, 8, (list(layouts.values()),))
    for i, name in enumerate(layouts):
        seen = set()
        for rank, r in enumerate(results):
            got = r[i]
            assert got["base_unchanged"] and got["base_grads"] == 0 and got["frozen"], (name, rank)
            assert all(n.endswith(("lora_A", "lora_B")) for n in got["piece_names"])
            err = (torch.tensor(got["losses"]) - losses).abs() / losses.abs()
            assert (err <= RTOL).all(), (name, rank, got["losses"], ref["losses"])
            for n, t in got["params"].items():
                assert rel_err(t, ref["params"][n]) <= RTOL, (name, rank, n)
            seen |= set(got["params"])
        assert seen == set(ref["params"]), name  # the stages hold every adapter between them


def test_lora_config_is_checked_at_the_door():
    with pytest.raises(ConfigError, match="lora.targets is empty"):
        Config.from_dict({"lora": {"rank": 2, "targets": []}})
    with pytest.raises(ConfigError, match="lora.rank with training.precision=fp8"):
        Config.from_dict({"lora": {"rank": 2}, "training": {"precision": "fp8"}})
    with pytest.raises(ConfigError, match="lora.rank"):
        Config.from_dict({"lora": {"rank": -1}})


def test_lora_targets_that_match_nothing_or_the_head_are_refused(corpus, tmp_path):
    with pytest.raises(ValueError, match="matches no linear"):
        run_lora(_cfg(corpus, str(tmp_path / "a"), {"dp": 1}, targets=["nothing_*"]))
    with pytest.raises(ValueError, match="head.proj is a vocab_head layer"):
        run_lora(_cfg(corpus, str(tmp_path / "b"), {"dp": 1}, targets=["proj"]))
