"""`shardwise train` with tensor parallelism: a checkpoint taken at tp = 2 resumes at dp = 2,
and sizes tp must divide. Parity of every tp layout with one process is in test_layouts.py."""

import pytest

from ddp_workers import resume_and_finish, tiny_config, train, train_and_checkpoint
from shardwise.base.config import Config, ConfigError
from shardwise.launch import spawn
from test_ddp import assert_parity


def test_tp_checkpoint_resumes_into_another_layout(corpus, tmp_path):
    """Saved at tp=2 in the full model's layout, resumed at dp=2: the same trajectory as an
    uninterrupted single process."""
    full = train(tiny_config(str(corpus), str(tmp_path / "full"), training={"steps": 8}))
    cut = tiny_config(str(corpus), str(tmp_path / "cut"), parallel={"tp": 2}, training={"steps": 8})
    spawn(train_and_checkpoint, 2, (cut, 4))
    again = Config.from_dict(cut).model_dump()
    again["parallel"] |= {"tp": 1, "dp": 2}
    resumed = spawn(resume_and_finish, 2, (again,))[0]
    assert resumed["resumed_at"] == 4
    assert_parity(resumed, full)


def train_compiled(cfg_dict: dict) -> dict:
    """``ddp_workers.train``, and how many graphs dynamo compiled on this rank."""
    from torch._dynamo.utils import counters

    return train(cfg_dict) | {"graphs": int(counters["stats"]["unique_graphs"])}


def test_compiled_tp_with_sp_trains_like_one_eager_process(corpus, tmp_path):
    """``training.compile`` with tp = 2 and sequence parallelism (a Llama with grouped-query
    attention): the blocks compile in pieces around the tp collectives, which run eagerly
    (``torch.compiler.disable``), and the run equals one eager process within 1e-4
    (Inductor's fused fp32 kernels round differently from eager ones)."""
    model = {"kind": "llama", "n_kv_heads": 2, "multiple_of": 16}
    ref = train(tiny_config(str(corpus), str(tmp_path / "ref"), model=model,
                            training={"steps": 4}))
    cut = tiny_config(str(corpus), str(tmp_path / "tp"), model=model,
                      parallel={"tp": 2, "sequence_parallel": True},
                      training={"steps": 4, "compile": True})
    for r in spawn(train_compiled, 2, (cut,)):
        assert r["graphs"] > 0  # it compiled: not an eager run under another name
        assert_parity(r, ref, rtol=1e-4)


def test_tp_sizes_must_divide():
    with pytest.raises(ConfigError, match=r"model.n_head=4 is not divisible by parallel.tp=3"):
        Config.from_dict({"parallel": {"dp": 1, "tp": 3}, "model": {"n_head": 4, "n_embd": 96}})
