"""Meta-device construction: no rank ever holds the whole GPT, and every parameter a rank
holds equals (``torch.equal``) its slice of the single-process ``torch.manual_seed(seed);
GPT(cfg)`` in every layout (pp, tp, dp x tp x pp, interleaved chunks, tied or not, a
vocabulary tp does not divide); the replay equals the Llama's constructor too; each rank's
peak memory while building (GPT and Llama) is what it holds plus one full tensor (the
replay's scratch) and a few MiB, well under the model's size."""

import sys

import pytest
import torch
import torch.nn as nn
from torch.nn.init import trunc_normal_

from meta_init_workers import local_params_worker, memory_worker
from shardwise.launch import spawn
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.llama import Llama, LlamaConfig
from shardwise.models.meta_init import _MAP_BYTES, record_init, replay_init

SEED = 7
GPT_SMALL = {"vocab_size": 67, "n_layer": 3, "n_head": 4, "n_embd": 32, "block_size": 16}
UNTIED = {**GPT_SMALL, "tie_weights": False}


def _reference(gpt: dict) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    return {n: p.detach() for n, p in GPT(GPTConfig(**gpt)).named_parameters(remove_duplicate=False)}


def _expected(full: torch.Tensor, tp_dim: int, tp_rank: int, tp_size: int, local_shape) -> torch.Tensor:
    if tp_dim < 0:
        return full
    rows = local_shape[0] * tp_size if tp_dim == 0 else full.shape[0]
    if rows > full.shape[0]:  # vocabulary padded with zero rows to a multiple of tp
        full = torch.cat([full, full.new_zeros((rows - full.shape[0],) + tuple(full.shape[1:]))])
    return full.chunk(tp_size, dim=tp_dim)[tp_rank]


@pytest.mark.parametrize("tie", [True, False])
def test_replay_equals_gpt_constructor(tie):
    gpt = GPT_SMALL if tie else UNTIED
    ref = _reference(gpt)
    rec = record_init(lambda: GPT(GPTConfig(**gpt)))
    assert all(p.is_meta for p in rec.model.parameters())
    got = {}
    replay_init(rec, SEED, list(ref), lambda n, t: got.__setitem__(n, t.clone()))
    assert got.keys() == ref.keys()
    for n in ref:
        assert torch.equal(got[n], ref[n]), n


@pytest.mark.parametrize("tie", [True, False])
def test_replay_equals_llama_constructor(tie):
    """Grouped-query attention, SwiGLU, RMSNorm: every parameter (tied or not) as
    ``torch.manual_seed(seed); Llama(cfg)`` gives it, scratch tensors mapped or not."""
    cfg = LlamaConfig(vocab_size=1100, block_size=16, n_layer=2, n_head=8, n_kv_heads=2,
                      n_embd=256, ffn_hidden=640, tie_weights=tie)
    torch.manual_seed(SEED)
    ref = {n: p.detach() for n, p in Llama(cfg).named_parameters(remove_duplicate=False)}
    assert 4 * 1100 * 256 >= _MAP_BYTES > 4 * 256 * 256  # both kinds of scratch are used
    rec = record_init(lambda: Llama(cfg))
    got = {}
    replay_init(rec, SEED, list(ref), lambda n, t: got.__setitem__(n, t.clone()))
    assert got.keys() == ref.keys()
    for n, want in ref.items():
        assert torch.equal(got[n], want), n


LAYOUTS = {
    4: [{"dp": 2, "pp": 2, "tp": 1, "gpt": GPT_SMALL},
        {"dp": 1, "pp": 4, "tp": 1, "gpt": UNTIED},
        {"dp": 2, "pp": 1, "tp": 2, "gpt": GPT_SMALL},
        {"dp": 1, "pp": 2, "tp": 2, "gpt": GPT_SMALL},
        {"dp": 1, "pp": 2, "tp": 2, "v": 2, "gpt": UNTIED}],
    8: [{"dp": 2, "pp": 2, "tp": 2, "gpt": GPT_SMALL},
        {"dp": 2, "pp": 2, "tp": 2, "gpt": UNTIED}],
}


@pytest.mark.parametrize("ws", [4, 8])
def test_every_rank_holds_its_exact_slices(ws):
    results = spawn(local_params_worker, ws, (LAYOUTS[ws], SEED))
    for i, lay in enumerate(LAYOUTS[ws]):
        ref = _reference(lay["gpt"])
        covered = set()
        for rank_out in results:
            r = rank_out[i]
            for key, (local, tp_dim) in r["params"].items():
                name = key.removesuffix("#shared")
                want = _expected(ref[name], tp_dim, r["tp_rank"], r["tp_size"], local.shape)
                assert torch.equal(local, want), (lay, key)
                covered.add(name)
        assert covered == set(ref), lay  # every parameter held by some rank


MEMORY_MODELS = {
    # ~230 MB of fp32 parameters each; tp2 x pp2: each rank holds about a quarter
    "gpt": {"vocab_size": 4096, "n_layer": 8, "n_head": 8, "n_embd": 768, "block_size": 64},
    "llama": {"vocab_size": 4096, "n_layer": 8, "n_head": 12, "n_kv_heads": 4, "n_embd": 768,
              "ffn_hidden": 2048, "block_size": 64},
}


@pytest.mark.parametrize("kind", list(MEMORY_MODELS))
def test_peak_memory_near_what_a_rank_holds(kind):
    sizes = MEMORY_MODELS[kind]
    build = (lambda: Llama(LlamaConfig(**sizes))) if kind == "llama" else (
        lambda: GPT(GPTConfig(**sizes)))
    params = list(record_init(build).model.parameters())
    model_bytes = 4 * sum(p.numel() for p in params)
    largest = 4 * max(p.numel() for p in params)
    results = spawn(memory_worker, 4, (sizes, 1, 2, 2, SEED, kind))
    for r in results:
        print(f"{kind}: rise {r['rise'] / 2**20:.1f} MiB, held {r['held'] / 2**20:.1f} MiB, "
              f"one-time imports {r['imports'] / 2**20:.1f} MiB, "
              f"model {model_bytes / 2**20:.1f} MiB")
        # what the rank holds plus one full tensor (the replay's scratch, in its own memory
        # map: nothing left in the heap) and a few MiB of the build's own; the 1.3x
        # at 1B parameters is measured by benchmarks/meta_init.py --model llama (1.24x).
        # The old code rose by the whole model here (228 MiB).
        assert r["rise"] <= r["held"] + largest + 8 * 2**20, r
        assert r["rise"] < 0.5 * model_bytes, r


def test_one_process_tied_and_meta():
    """dp = pp = tp = 1: the head shares the embedding's materialised parameter; every
    parameter equals the GPT's; on the meta device nothing is materialised."""
    from shardwise.engine.model import build_local_model
    from shardwise.parallel.tensor_parallel.group import RankGroup

    cfg = GPTConfig(**GPT_SMALL)
    kw = {"pp": 1, "pp_rank": 0, "chunk_ids": [0], "n_chunks": 1, "tp": RankGroup(),
          "seed": SEED, "dropout_seed": 0}
    local = build_local_model(cfg, device=torch.device("cpu"), **kw)
    chunk = local.chunks[0]
    assert chunk.layers[-1].proj.weight is chunk.layers[0].tok.weight
    ref = _reference(GPT_SMALL)
    for name, p in local.named_parameters():
        assert torch.equal(p, ref[name]), name
    meta = build_local_model(cfg, device=torch.device("meta"), **kw)
    assert all(p.is_meta for _, p in meta.named_parameters())


class _Init(nn.Module):
    """A Linear (its own Kaiming draws first) and a parameter ``w`` given its value by
    ``how``: the idioms of users' models."""

    def __init__(self, how: str):
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.w = nn.Parameter(torch.empty(4, 4))
        nn.init.ones_(self.w)
        w = self.w
        with torch.no_grad():
            if how == "p.data.normal_":  # Hugging Face's _init_weights
                w.data.normal_(0.0, 0.02)
            elif how == "p.detach().uniform_":
                w.detach().uniform_(-0.1, 0.1)
            elif how == "whole view":
                w.data.view(-1).normal_()
            elif how == "trunc_normal_":  # torchtitan's init
                nn.init.trunc_normal_(w, std=0.02, a=-0.04, b=0.04)
                nn.init.trunc_normal_(self.lin.weight)
            elif how == "trunc_normal_ imported by name":
                trunc_normal_(w, std=0.5)
            elif how == "eye_":
                nn.init.eye_(w)
            elif how == "arithmetic after a draw":
                w.uniform_(-1.0, 1.0)
                w.mul_(3.0).add_(1.0).clamp_(-1.0, 2.5)
            elif how == "torch.randn":
                self.r = nn.Parameter(torch.randn(4))
            elif how == "dirac_":
                self.c = nn.Parameter(torch.empty(4, 4, 3))
                nn.init.dirac_(self.c)
            elif how == "a slice":
                w[:2].zero_()
            elif how == "a transpose":
                w.data.t().normal_()
            elif how == "copy_":
                w.copy_(torch.ones(4, 4))
            elif how == "out=":
                torch.arange(16.0, out=w.data.view(-1))
            elif how == "orthogonal_":
                nn.init.orthogonal_(w)
            elif how == "sparse_":
                nn.init.sparse_(w, 0.5)
            elif how == "own generator":
                nn.init.trunc_normal_(w, generator=torch.Generator())


@pytest.mark.parametrize("how", ["p.data.normal_", "p.detach().uniform_", "whole view",
                                 "trunc_normal_", "trunc_normal_ imported by name", "eye_",
                                 "dirac_", "arithmetic after a draw"])
def test_replay_follows_every_replayable_idiom(how):
    """Writes through an alias of the parameter, and the nn.init functions torch skips on
    meta tensors, replay to the CPU constructor's values (before: all but dirac_ left the
    earlier value in place, silently; dirac_'s parameter had no write at all)."""
    torch.manual_seed(SEED)
    ref = dict(_Init(how).named_parameters())
    rec = record_init(lambda: _Init(how))
    got = {}
    replay_init(rec, SEED, list(ref), lambda n, t: got.__setitem__(n, t.clone()))
    for n in ref:
        assert torch.equal(got[n], ref[n].detach()), n


@pytest.mark.parametrize("how, expected", [
    ("a slice", "zero_ on part of a tensor"),
    ("a transpose", "normal_ on part of a tensor"),
    ("copy_", "aten.copy_ while building on the meta device"),
    ("out=", "aten.arange while building on the meta device"),
    ("orthogonal_", "nn.init.orthogonal_ while building on the meta device cannot be replayed"),
    ("sparse_", "nn.init.sparse_ while building on the meta device cannot be replayed"),
    ("own generator", "nn.init.trunc_normal_ with its own generator cannot be replayed"),
    ("torch.randn", "aten.randn while building on the meta device"),
])
def test_writes_that_cannot_be_replayed_are_refused(how, expected):
    before = sys.getprofile()
    with pytest.raises(NotImplementedError, match=expected.replace(".", r"\.").replace("(", r"\(")):
        record_init(lambda: _Init(how))
    assert sys.getprofile() is before  # the profile hook is gone


def test_a_parameter_without_an_init_write_is_named():
    class Zeros(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(3))

    rec = record_init(Zeros)
    with pytest.raises(ValueError, match="no initialising write recorded for 'w': give it"):
        replay_init(rec, SEED, ["w"], lambda n, t: None)
