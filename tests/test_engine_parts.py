"""The engine's shape: no config field copied into engine/, the parallelization steps public,
evaluation leaves the chunks training even when it fails, one forward-only schedule."""

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from pipeline_workers import _model, batches, run_evaluations
from shardwise.base.config import Config
from shardwise.base.topology import Topology
from shardwise.engine import Engine, EngineConfig
from shardwise.launch import spawn
from shardwise.models import GPTConfig
from shardwise.parallel.pipeline.schedules import Forward, RecvActivation, SendActivation
from shardwise.parallel.pipeline.schedules import forward_only

ENGINE = Path(__file__).resolve().parents[1] / "src" / "shardwise" / "engine"
TINY = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _dataclass_fields(cls: ast.ClassDef) -> int | None:
    """Fields of ``cls`` when it is a dataclass (annotated names of its body), else None."""
    names = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", None)
             for d in cls.decorator_list for d in [d.func if isinstance(d, ast.Call) else d]}
    if "dataclass" not in names:
        return None
    return sum(isinstance(s, ast.AnnAssign) and "ClassVar" not in ast.unparse(s.annotation)
               for s in cls.body)


def test_no_class_in_engine_redeclares_config_fields():
    """The engine reads the config sections (``EngineConfig`` holds them by reference): no
    dataclass in engine/ has 10 or more fields."""
    wide = []
    for path in sorted(ENGINE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                n = _dataclass_fields(node)
                if n is not None and n >= 10:
                    wide.append(f"{path.name}:{node.name} ({n} fields)")
    assert not wide, wide


def test_engine_config_holds_the_sections_themselves():
    cfg = Config.from_dict({"model": {"block_size": 8}, "parallel": {"dp": 1},
                            "training": {"global_batch_size": 4}})
    view = EngineConfig.of(cfg, eos_id=3)
    assert view.parallel is cfg.parallel and view.optimizer is cfg.optimizer
    assert view.training is cfg.training and (view.seq_len, view.eos_id) == (8, 3)
    assert len(dataclasses.fields(EngineConfig)) < 10
    engine = Engine(GPTConfig(**TINY), Topology.build(1, 1, 1), cfg)  # a Config directly
    assert engine.cfg.training is cfg.training


def test_evaluation_leaves_the_chunks_training_after_an_error():
    engine = Engine(GPTConfig(**TINY, dropout=0.1), Topology.build(1, 1, 1),
                    EngineConfig(seq_len=8, training={"global_batch_size": 2}))
    idx = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(Exception):
        engine.loss(idx, torch.zeros(3, 8, dtype=torch.long))  # targets of the wrong shape
    assert all(m.training for c in engine.chunks.values() for m in c.modules())
    assert engine.loss(idx, idx) > 0 and all(c.training for c in engine.chunks.values())


@pytest.mark.parametrize("p, v", [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1)])
def test_forward_only_runs_every_chunk_once_in_order(p, v):
    """Each rank runs its chunks in order; every send meets a receive of the same chunk."""
    s = forward_only(p, v)
    sends, recvs = set(), set()
    for rank, ops in enumerate(s.ranks):
        assert [o.chunk for o in ops if isinstance(o, Forward)] == list(range(rank, p * v, p))
        sends |= {(o.chunk + 1, rank, o.peer) for o in ops if isinstance(o, SendActivation)}
        recvs |= {(o.chunk, o.peer, rank) for o in ops if isinstance(o, RecvActivation)}
    assert sends == recvs and len(sends) == (p * v - 1 if p > 1 else 0)


def test_the_steps_are_public_and_usable_on_a_users_layers():
    """``apply_compile`` / ``apply_ac`` take (name, module) pairs of any model."""
    from shardwise.engine import parallelize

    assert [f for f in ("apply_tp", "apply_ep", "apply_cp", "apply_float8", "apply_ac",
                        "apply_compile", "apply_dp") if not hasattr(parallelize, f)] == []
    layers = [("0", torch.nn.Linear(4, 4)), ("1", torch.nn.Linear(4, 4))]
    parallelize.apply_ac(layers, torch.device("cpu"))
    x = torch.randn(2, 4, requires_grad=True)
    layers[1][1](layers[0][1](x)).sum().backward()
    assert x.grad is not None


def test_evaluation_runs_through_the_pipeline_and_leaves_the_step_alone():
    """At pp = 2 (interleaved, v = 2: four chunks over two ranks; PipeDream; zbv, whose last
    chunk is on rank 0), ``loss`` is one
    process's loss of the same weights, and evaluating between steps (PipeDream: with
    micro-batches in flight) changes no training loss and leaves the stream's micro-batches
    in flight as they were."""
    cfgs = [{"schedule": "interleaved", "micro_batches": 2, "chunks_per_rank": 2},
            {"schedule": "pipedream", "micro_batches": 2},
            {"schedule": "zbv", "micro_batches": 2, "chunks_per_rank": 2}]  # V: ends on rank 0
    ranks = spawn(run_evaluations, 2, (cfgs,))
    idx, tgt = batches(1)[0]
    _, want = _model()(idx, tgt)
    for i in range(len(cfgs)):
        rows = [r[i] for r in ranks]
        for row in rows:
            assert row["loss0"] == pytest.approx(want.item(), rel=1e-6)
            assert row["evaluated"] == row["plain"]
        assert [loss for loss, _ in rows[0]["plain"]] == [loss for loss, _ in rows[1]["plain"]]
    assert [n for n in (r[1]["plain"][-1][1] for r in ranks)] == [1, 0]  # PipeDream, p = 2
