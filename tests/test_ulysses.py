"""All-to-all context parallelism (``parallel.cp_comm = "all_to_all"``, DeepSpeed-Ulysses,
Jacobs et al. 2023) and the ring x all-to-all hybrid (``"hybrid"``, ``parallel.cp_a2a``),
against one process.

The kernel first: on head groups of 2 and 4 ranks (cp 2 beside cp 2, and cp 4) and on the
hybrid cp 4 = 2 x 2, the output and the q, k, v gradients of the engine's context-parallel
attention, stitched back from every rank's shard, equal ``causal_attention`` on the whole
sequence in one process (grouped-query attention with fewer key/value heads than the degree:
repeated; sliding windows; packed documents; Gemma 2's soft cap under the pure all-to-all,
refused in one line with a ring). Per rank the all-to-alls send, forward and backward each,
(A - 1) / A of the rank's q, k (repeated), v and output bytes (``_a2a_bytes``), in two calls
(q, k and v together, then the output). Then training: one process trains each model (the
reference) and a spawn of 4 ranks trains every layout of ``LAYOUTS`` on the same global
batches: every loss and parameter of every rank within ``RTOL`` relative (the GPT, the Llama
with GQA, block_causal documents with a sliding window, tp + SP, ZeRO-3, ZeRO-2 under the
interleaved pipeline schedule, every other schedule at cp2 x pp2 (naive, GPipe, zb1p, ZBV,
DualPipeV), selective recomputation replaying the all-to-alls, the hybrid, and what ring
attention cannot run: DeepSeek's latent attention and Gemma 2's soft cap); PipeDream at cp2
x pp2 trains like its stream without cp (``PIPEDREAM``); fp8 under cp2 x dp2 follows fp8 in
one process within float8's rounding (``FP8``, where torchao is installed); a checkpoint
saved under ring attention resumes under the all-to-all (``RESUME``); selective
recomputation replays the all-to-alls, full runs them again (``RECOMPUTED``). cp2 (a2a) x
tp2 (SP) x pp2 with ZeRO-1 (1F1B) runs in ``test_context_parallel.py``'s spawn of 8 ranks.
"""

import dataclasses
import importlib.util

import pytest

from cp_workers import case_documents, full_inputs, run_measured
from shardwise.base.config import Config, ConfigError
from shardwise.launch import spawn
from shardwise.models import sequence
from shardwise.models.gpt import causal_attention
from shardwise.parallel.context import unshard_sequence
from ddp_workers import tiny_config
from test_context_parallel import DATA, MODELS, STEPS, STOP, _check
from ulysses_workers import run_fp8, ulysses_worker

_SMALL = {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16, "kind": "llama",
          "multiple_of": 16}
MODELS = {**MODELS,
          # DeepSeek's latent attention: values 12 wide, queries and keys 12 (8 + 4 rotary)
          "mla": {**_SMALL, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                  "v_head_dim": 12},
          # Gemma 2's soft cap on the scores, a window of 5 on layer 0
          "softcap": {**_SMALL, "n_kv_heads": 2, "attn_logit_softcapping": 2.0,
                      "sliding_window": 5,
                      "layer_types": ["sliding_attention", "full_attention"]},
          # PipeDream's stages step on their own clocks: no embedding tied across them
          "gpt-untied": {**MODELS["gpt"], "tie_weights": False}}

CASES = [
    {"seed": 0, "shape": (2, 4, 32, 8), "kv_heads": 2, "impl": "sdpa"},
    {"seed": 1, "shape": (2, 4, 32, 8), "kv_heads": 1, "impl": "math"},  # repeated K/V
    {"seed": 2, "shape": (2, 4, 32, 8), "kv_heads": 4, "impl": "sdpa", "window": 5},
    {"seed": 3, "shape": (2, 4, 32, 8), "kv_heads": 2, "impl": "math", "window": 13,
     "docs": 0.2},
    {"seed": 4, "shape": (2, 4, 32, 8), "kv_heads": 2, "impl": "sdpa", "docs": 0.2},
    {"seed": 5, "shape": (2, 4, 32, 8), "kv_heads": 2, "impl": "math", "softcap": 5.0},
]
KERNELS = {"a2a-cp2": (2, 2), "a2a-cp4": (4, 4), "hybrid-cp4": (4, 2)}  # name -> (cp, a2a)
A2A = {"cp_comm": "all_to_all"}
HYBRID = {"cp_comm": "hybrid", "cp_a2a": 2}
# name -> (world size, model, parallel section)
LAYOUTS = {
    "a2a-cp2xdp2-gpt": (4, "gpt", {"cp": 2, "dp": 2, **A2A}),
    # ZeRO's shards over dp x cp: ZeRO-3's units gathered around the all-to-alls, and ZeRO-2
    # under the interleaved schedule (2 chunks a stage, the tied head on the last)
    "a2a-cp2xdp2-z3-gpt": (4, "gpt", {"cp": 2, "dp": 2, "zero": 3, **A2A}),
    "a2a-cp2xpp2-interleaved-z2-llama": (4, "llama", {"cp": 2, "pp": 2, "micro_batches": 2,
                                                      "schedule": "interleaved",
                                                      "chunks_per_rank": 2, "zero": 2, **A2A}),
    # a split backward (B sends the all-to-alls' gradients, W none) and GPipe's order
    "a2a-cp2xpp2-zb1p-llama": (4, "llama", {"cp": 2, "pp": 2, "micro_batches": 2,
                                            "schedule": "zb1p", **A2A}),
    "a2a-cp2xpp2-gpipe-gpt": (4, "gpt", {"cp": 2, "pp": 2, "micro_batches": 2,
                                         "schedule": "gpipe", **A2A}),
    # the rest of the schedules: naive (one micro-batch at a time), and the V-shaped ones
    # (two chunks a rank, the embedding and the head on pipeline rank 0): ZBV's split
    # backward, DualPipeV's fused and split backwards in one list
    "a2a-cp2xpp2-naive-gpt": (4, "gpt", {"cp": 2, "pp": 2, "micro_batches": 2,
                                         "schedule": "naive", **A2A}),
    "a2a-cp2xpp2-zbv-llama": (4, "llama", {"cp": 2, "pp": 2, "micro_batches": 2,
                                           "schedule": "zbv", "chunks_per_rank": 2, **A2A}),
    "a2a-cp2xpp2-dualpipev-gpt": (4, "gpt", {"cp": 2, "pp": 2, "micro_batches": 4,
                                             "schedule": "dualpipev", "chunks_per_rank": 2,
                                             **A2A}),
    "a2a-cp4-llama": (4, "llama", {"cp": 4, **A2A}),  # 2 key/value heads repeated to 4
    "a2a-cp4-doc-llama": (4, "llama-doc", {"cp": 4, **A2A}),  # documents and a window
    "a2a-cp2xtp2-sp-swa-llama": (4, "llama-swa", {"cp": 2, "tp": 2, "sequence_parallel": True,
                                                  **A2A}),
    "a2a-cp4-selective-swa-llama": (4, "llama-swa", {"cp": 4, "recompute": "selective",
                                                     **A2A}),
    "hybrid-cp4-swa-llama": (4, "llama-swa", {"cp": 4, **HYBRID}),
    # what ring attention cannot run: the all-to-all runs the model's own attention
    "a2a-cp2xdp2-mla": (4, "mla", {"cp": 2, "dp": 2, **A2A}),
    "a2a-cp4-softcap": (4, "softcap", {"cp": 4, **A2A}),
    "ring-cp2xdp2-llama": (4, "llama", {"cp": 2, "dp": 2}),  # saves for RESUME
}
# recomputation -> the all-to-alls of one step at cp2 x dp2, 2 layers: 2 forward (q, k and
# v in one, the output) and 2 backward each; selective replays the forward's, full runs them
# again
RECOMPUTED = {False: 8, "selective": 8, True: 12}
RESUME = ("ring-cp2xdp2-llama", "a2a-cp4-llama")  # saved under the ring, resumed all-to-all
# PipeDream (no flush: each stage steps after each backward, on weights stashed per
# micro-batch) trains like no one process; its reference is the same stream without cp, the
# global batch split over dp2 x pp2 instead (test_pipeline_parity checks PipeDream's stream
# against an exact one-process emulation). One micro-batch a step, so that dp's micro-batch
# is cp's (the global batch; with more, dp's would take other sequences); the stream still
# runs stage 0's next forward before its backward, on the stashed weights.
# name -> (its parallel section, the reference's)
_PIPEDREAM = {"pp": 2, "micro_batches": 1, "schedule": "pipedream"}
PIPEDREAM = {"a2a-cp2xpp2-pipedream-gpt": ({"cp": 2, **_PIPEDREAM, **A2A},
                                           {"dp": 2, **_PIPEDREAM})}
NO_CLIP = {"optimizer": {"grad_clip": 0.0}}  # PipeDream has no flush to clip at
# training.precision = "fp8" (torchao's float8 Linear layers; their matmuls run on the CPU,
# the engine's device check lifted: ``fp8_workers.fp8_on_the_cpu``) under cp2 x dp2, the
# all-to-all and, for reference, the ring, against fp8 in one process, the Llama.
# name -> (parallel section, training.fp8_recipe)
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
FP8 = {f"fp8-{mode}-cp2xdp2-{recipe}-llama": ({"cp": 2, "dp": 2, **comm}, recipe)
       for mode, comm in (("a2a", A2A), ("ring", {})) for recipe in ("tensorwise", "rowwise")}
# recipe -> relative bounds on (losses, parameters). Each rank scales its own tokens: under
# tensorwise the activations' and their gradients' scales span the rank's tokens, so float8
# rounds on another grid than one process's; under rowwise only the weight gradient's do.
# Measured over 4 steps (all-to-all / ring): tensorwise losses 2.9e-4 / 2.8e-4, parameters
# 4.4e-2 / 4.5e-2 (Adam amplifies); rowwise 3.9e-5 / 1.0e-4, 6.4e-3 / 1.6e-2; bf16 alone
# 1.9e-5 / 4.4e-5, 4.2e-3 / 8.8e-3. Without the all-to-all's backward: parameters 0.25,
# losses 5.8e-4 (tensorwise) and 1.1e-3 (rowwise).
FP8_RTOL = {"tensorwise": (1e-3, 0.1), "rowwise": (2e-4, 4e-2)}
RTOL = 1e-5


def _cfg(sources, out, model: str, parallel: dict | None = None, training: dict | None = None,
         **sections):
    return tiny_config(str(sources[DATA.get(model, "corpus")]), str(out), model=MODELS[model],
                       parallel=parallel or {},
                       training={"steps": STEPS, "global_batch_size": 8, **(training or {})},
                       **sections)


def test_config_rules_for_cp_comm():
    """One line naming the field for each bad combination; the degree said once."""
    def load(model=None, **parallel):
        return Config.from_dict({"model": {"n_head": 4, "n_embd": 32, "block_size": 16,
                                           **(model or {})},
                                 "parallel": {"dp": 1, **parallel},
                                 "training": {"global_batch_size": 8}})

    assert load(cp=4, cp_comm="all_to_all").parallel.cp_heads == 4
    assert load(cp=4, cp_comm="hybrid", cp_a2a=2).parallel.cp_heads == 2
    assert load(cp=4).parallel.cp_heads == 1
    for parallel, field in (({"cp": 4, "cp_comm": "hybrid"}, "parallel.cp_a2a=0"),
                            ({"cp": 4, "cp_comm": "hybrid", "cp_a2a": 4}, "parallel.cp_a2a=4"),
                            ({"cp": 8, "cp_comm": "hybrid", "cp_a2a": 3}, "parallel.cp_a2a=3"),
                            ({"cp": 2, "cp_a2a": 2}, "parallel.cp_a2a=2"),
                            ({"cp": 8, "cp_comm": "all_to_all"}, "parallel.cp_a2a=8"),
                            ({"cp": 2, "cp_comm": "sideways"}, "parallel.cp_comm")):
        with pytest.raises(ConfigError, match=field) as err:
            load(**parallel)
        assert "\n" not in str(err.value)
    # 3 key/value heads neither divide 2 nor divide by it
    with pytest.raises(ConfigError, match="parallel.cp_a2a=2"):
        load({"kind": "llama", "n_head": 6, "n_embd": 48, "n_kv_heads": 3}, cp=2,
             cp_comm="all_to_all")
    load({"kind": "llama", "n_kv_heads": 1}, cp=4, cp_comm="all_to_all")  # repeated: fine
    # latent attention and a soft cap: the all-to-all only
    for model in ({"kind": "llama", "kv_lora_rank": 8, "qk_nope_head_dim": 4,
                   "qk_rope_head_dim": 4, "v_head_dim": 8},
                  {"kind": "llama", "attn_logit_softcapping": 2.0}):
        load(model, cp=4, cp_comm="all_to_all")
        for parallel in ({"cp": 4}, {"cp": 4, "cp_comm": "hybrid", "cp_a2a": 2}):
            with pytest.raises(ConfigError, match="parallel.cp_comm = \"all_to_all\""):
                load(model, **parallel)


def _reference(case: dict) -> dict:
    """``causal_attention`` on the whole sequence in one process, and its gradients."""
    q, k, v, dout = full_inputs(case)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    docs = case_documents(case)
    with sequence.use(None if docs is None else sequence.SequenceShard(documents=docs)):
        y = causal_attention(q, k, v, impl=case["impl"], window=case.get("window"),
                             softcap=case.get("softcap"))
    y.backward(dout)
    return {"out": y.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _a2a_bytes(case: dict, cp: int, a2a: int) -> int:
    """Bytes one rank's all-to-alls send in one pass (forward, or backward): (A - 1) / A of
    its q, k, v (key/value heads repeated up to A) and output (or their gradients)."""
    B, H, T, D = case["shape"]
    hkv = max(case.get("kv_heads", H), a2a)
    local = B * T // cp * D * 4  # bytes of one head's local tokens, fp32
    return (a2a - 1) * (2 * H + 2 * hkv) * local // a2a


def _fp8(recipe: str) -> dict:
    return {"precision": "fp8", "fp8_recipe": recipe}


def _jobs(sources, root, layouts) -> list[tuple[str, dict]]:
    jobs = []
    for name, (_, model, parallel) in layouts.items():
        cfg = _cfg(sources, root / name, model, parallel)
        jobs.append((name, {"kind": "run", "save_at": STOP if name == RESUME[0] else None,
                            "cfg": cfg}))
        if name == RESUME[0]:
            cfg = _cfg(sources, root / "resume", LAYOUTS[RESUME[1]][1], LAYOUTS[RESUME[1]][2])
            jobs.append(("resume", {"kind": "resume", "cfg": cfg, "from_dir": str(
                Config.from_dict(jobs[-1][1]["cfg"]).checkpoint_dir)}))
    return jobs


@pytest.fixture(scope="module")
def sources(corpus, packed):
    return {"corpus": corpus, "packed": packed}


@pytest.fixture(scope="module")
def references(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("a2a-ref")
    models = {m for _, m, _ in LAYOUTS.values()}
    out = {m: run_measured({"kind": "run", "cfg": _cfg(sources, root / m, m)}) for m in models}
    for recipe in {r for _, r in FP8.values()} if HAS_TORCHAO else ():
        out[f"llama:fp8-{recipe}"] = run_fp8({"kind": "run", "cfg": _cfg(
            sources, root / f"llama-fp8-{recipe}", "llama", training=_fp8(recipe))})
    return out


@pytest.fixture(scope="module")
def results(sources, tmp_path_factory):
    """name -> every rank's report: the kernels and ``LAYOUTS`` in one spawn of 4 ranks."""
    root = tmp_path_factory.mktemp("a2a-layouts")
    jobs = [(name, {"kind": "kernel", "cp": cp, "a2a": a2a, "cases": CASES})
            for name, (cp, a2a) in KERNELS.items()] + _jobs(sources, root, LAYOUTS)
    jobs += [(f"count-{rc}", {"kind": "count", "cfg": _cfg(
        sources, root / f"count-{rc}", "llama", {"cp": 2, "dp": 2, "recompute": rc, **A2A})})
        for rc in RECOMPUTED]
    jobs += [(f"{name}{tag}", {"kind": "run", "cfg": _cfg(sources, root / f"{name}{tag}",
                                                          "gpt-untied", par, **NO_CLIP)})
             for name, pars in PIPEDREAM.items() for tag, par in zip(("", ":ref"), pars)]
    jobs += [(name, {"kind": "fp8", "cfg": _cfg(sources, root / name, "llama", par,
                                                training=_fp8(recipe))})
             for name, (par, recipe) in FP8.items() if HAS_TORCHAO]
    ranks = spawn(ulysses_worker, 4, ([j for _, j in jobs],))
    return {name: [r[i] for r in ranks] for i, (name, _) in enumerate(jobs)}


@pytest.mark.parametrize("name", list(KERNELS))
def test_attention_equals_one_process(results, name):
    cp, a2a = KERNELS[name]
    ranks = results[name]
    for n, case in enumerate(CASES):
        if "softcap" in case and a2a < cp:  # the ring's kernels have no cap: one line
            assert all("parallel.cp_comm" in r[n]["error"] for r in ranks), ranks[0][n]
            continue
        ref = _reference(case)
        for dp in range(len(ranks) // cp):  # rings side by side: the same answer
            mine = ranks[dp * cp:(dp + 1) * cp]
            for key in ("out", "dq", "dk", "dv"):
                got = unshard_sequence([r[n][key] for r in mine], dim=2)
                err = float((got - ref[key]).abs().max() / ref[key].abs().max())
                assert err < 5e-6, (name, case, key, err)
        want = _a2a_bytes(case, cp, a2a)
        for r in ranks:
            for when in ("forward", "backward"):
                calls = [b for c, b in r[n][when] if c == "all_to_all"]
                # q, k and v in one call, the output in another: the same bytes as four
                assert len(calls) == 2 and sum(calls) == want, (name, case, when, calls, want)
            if a2a == cp:  # nothing else travels
                assert {c for c, _ in r[n]["forward"] + r[n]["backward"]} == {"all_to_all"}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(results, references, name):
    ws, model, parallel = LAYOUTS[name]
    assert len(results[name]) == ws
    assert {r["coords"]["cp"] for r in results[name]} == set(range(parallel["cp"]))
    _check(name, results[name], references[model], RTOL)


@pytest.mark.parametrize("name", list(PIPEDREAM))
def test_pipedream_matches_its_stream_without_cp(results, name):
    """cp2 (all-to-all) x pp2 under PipeDream's weight stashing: every rank's losses and
    parameters those of the same stream over dp2 x pp2 (the losses of every rank, the
    parameters of its dp rank 0's two stages), within ``RTOL``."""
    ref_ranks = results[f"{name}:ref"]
    ref = {"losses": ref_ranks[0]["losses"],
           "params": {n: t for r in ref_ranks if r["coords"]["dp"] == 0
                      for n, t in r["params"].items()}}
    _check(f"{name}:ref", ref_ranks, ref, RTOL)  # its dp replicas agree
    assert {r["coords"]["cp"] for r in results[name]} == {0, 1}
    _check(name, results[name], ref, RTOL)


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (pip install "
                    "'shardwise[fp8]')")
@pytest.mark.parametrize("name", list(FP8))
def test_fp8_under_cp_matches_fp8_in_one_process(results, references, name):
    """fp8 (float8 matmuls, bf16 around them, fp32 masters) under cp2 x dp2 follows fp8 in
    one process within ``FP8_RTOL`` (losses, then every parameter), the same Linear layers
    converted; the ring's runs under the same bounds, for reference."""
    recipe = FP8[name][1]
    ref, (loss_rtol, param_rtol) = references[f"llama:fp8-{recipe}"], FP8_RTOL[recipe]
    assert ref["fp8_layers"] > 0
    for r in results[name]:
        assert r["fp8_layers"] == ref["fp8_layers"], (name, r["coords"])
        assert r["losses"] == pytest.approx(ref["losses"], rel=loss_rtol), (name, r["coords"])
    _check(name, results[name], ref, param_rtol)


def test_selective_recomputation_replays_the_all_to_alls(results):
    """Under ``parallel.recompute = "selective"`` a recomputed layer's all-to-alls are
    replayed (``comm.replay``: no call, no byte), as tp's collectives are; full
    recomputation runs them again."""
    for rc, want in RECOMPUTED.items():
        assert results[f"count-{rc}"] == [want] * 4, rc


def test_ring_checkpoint_resumes_under_the_all_to_all(results, references):
    assert all(r["resumed_at"] == STOP for r in results["resume"])
    _check("resume", results["resume"], references[LAYOUTS[RESUME[1]][1]], RTOL)


# -- the planner -------------------------------------------------------------------------------
def test_planner_prices_the_all_to_all_as_the_engine_moves_it():
    """``ulysses_bytes`` is the kernel's measured formula (``_a2a_bytes``, per rank: (A - 1) /
    A of q, k repeated up to A, v and the output) for the same shapes; the hybrid's ring
    passes the gathered heads' blocks over cp / A ranks; the all-to-alls are exposed in the
    block's cp seconds; the heads rule is the config's (``cp_a2a_choices``)."""
    from shardwise.planner.comm_price import ring_bytes, ulysses_bytes
    from shardwise.planner.costs import block_costs
    from shardwise.planner.hardware import get_cluster
    from shardwise.planner.layout import Layout
    from shardwise.planner.search import cp_a2a_choices
    from shardwise.planner.specs import NAMED

    spec = NAMED["llama3-8b"].with_seq(4096)  # 32 query heads, 8 key/value heads, d = 128
    for cp, a2a, kv in ((8, 8, 8), (16, 16, 8), (8, 2, 8), (4, 4, 1)):
        s = spec if kv == 8 else dataclasses.replace(spec, n_kv_heads=kv)
        lay = Layout(1, 1, 1, 2, 1, cp=cp, cp_a2a=a2a)
        case = {"shape": (2, 32, 4096, 128), "kv_heads": kv}
        assert ulysses_bytes(s, lay, 4) == _a2a_bytes(case, cp, a2a), (cp, a2a, kv)
    ring = ring_bytes(spec, Layout(1, 1, 1, 2, 1, cp=8), 2)
    hybrid = ring_bytes(spec, Layout(1, 1, 1, 2, 1, cp=8, cp_a2a=2), 2)
    assert hybrid.forward == ring.forward * 3 / 7  # 3 blocks of the same bytes, not 7
    assert ring_bytes(spec, Layout(1, 1, 1, 2, 1, cp=8, cp_a2a=8), 2).forward == 0.0
    cluster = get_cluster("dgx-h100", spec, 8)
    a2a = block_costs(spec, Layout(1, 1, 1, 2, 1, cp=8, cp_a2a=8), cluster, "bf16")
    assert a2a.cp_forward > 0 and a2a.cp_backward == a2a.cp_forward  # exposed, both passes
    assert cp_a2a_choices(spec, 8, 1) == [1, 2, 4, 8]
    assert cp_a2a_choices(spec, 8, 4) == [1, 2, 4, 8]  # 8 query, 2 key/value heads a rank
    # 12 query heads a rank: not 8; 3 key/value heads neither divide 2 nor by it
    assert cp_a2a_choices(dataclasses.replace(spec, n_head=24), 8, 2) == [1, 2, 4]
    assert cp_a2a_choices(dataclasses.replace(spec, n_head=24, n_kv_heads=6), 8, 2) == [1]
    assert cp_a2a_choices(spec, 8, 1, ("all_to_all",)) == [8]


def test_the_search_counts_every_mode():
    """With every ``cp_comm`` the search still simulates or prunes each layout of the space
    once (``enumerate_layouts``: one per all-to-all degree); with the ring alone a soft-capped
    model's cp layouts are pruned with the reason."""
    from shardwise.planner.hardware import PRESETS
    from shardwise.planner.search import enumerate_layouts, plan
    from shardwise.planner.specs import NAMED

    modes = ("ring", "all_to_all", "hybrid")
    for name, comm in (("llama3-8b", modes), ("gemma2-2b", ("ring",))):
        spec = NAMED[name].with_seq(4096)
        feasible, pruned = plan(spec, PRESETS["dgx-h100"], 8, 8, top=3, cp_comm=comm,
                                micro_batches=[1])
        space = sum(1 for _ in enumerate_layouts(spec, 8, 8, cp_comm=comm, micro_batches=[1]))
        assert len(feasible) + sum(p.count for p in pruned) == space, name
    assert any("ring attention cannot run gemma2-2b" in p.reason for p in pruned)


def test_plan_chooses_the_mode_and_emits_it(tmp_path, capsys):
    """``shardwise plan`` prices ring, all-to-all and hybrid and ranks them by step time:
    llama3-8b at 4k tokens on one DGX H100 over cp = 8 picks the hybrid (its ring's K/V
    would not hide behind so short an attention), and ``--emit-toml`` writes it as a
    config ``shardwise train`` loads; restricted to the ring, none is written."""
    import tomllib

    from shardwise.cli.plan import plan_main as main

    args = ["--model", "llama3-8b", "--seq", "4096", "--cluster", "dgx-h100", "--gpus", "8",
            "--global-batch", "8", "--cp", "8", "--top", "8"]
    out = tmp_path / "best.toml"
    assert main(args + ["--emit-toml", str(out)]) == 0
    table = capsys.readouterr().out
    assert "a2a2xring4" in table and " cp8 mb" in table  # both priced
    cfg = Config.from_dict(tomllib.loads(out.read_text()))
    assert (cfg.parallel.cp_comm, cfg.parallel.cp_a2a, cfg.parallel.cp) == ("hybrid", 2, 8)
    assert main(args + ["--cp-comm", "ring", "--emit-toml", str(out)]) == 0
    assert "cp_comm" not in out.read_text()
    assert main(args + ["--cp-comm", "sideways"]) == 2
    assert "--cp-comm sideways" in capsys.readouterr().err
