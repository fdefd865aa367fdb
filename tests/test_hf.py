"""Hugging Face checkpoints in and out, sampling from a checkpoint, TensorBoard.

Small ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` / ``MixtralForCausalLM`` /
``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` / ``Qwen2MoeForCausalLM`` /
``Qwen3MoeForCausalLM`` / ``MistralForCausalLM`` / ``Phi3ForCausalLM`` /
``GemmaForCausalLM`` / ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` with random weights
are built here and saved with ``save_pretrained`` (no hub). The round trip:
``shardwise train --model.init_from hf:DIR`` at dp2 x tp2 x pp2 (the Mixtral with ep2 too;
the Qwen3 with its q_norm / k_norm and a head_dim other than hidden / heads)
for one step with ``--optimizer.lr 0`` -> ``shardwise export`` -> ``from_pretrained``: every
tensor equal bit for bit (fp32) and the logits equal. Our forward on the imported weights
against ``transformers``' within 1e-5 at tp = 1 and 2 (and the Mixtral, a Qwen3-MoE and
the Qwen2-MoE at dp2 x ep2), three of them with a sliding window shorter than the sequence
(a Mistral's, a Qwen2's and a Qwen2-MoE's, on all or some layers); with a window, the
gradients too, in one process. The Qwen2-MoE's round trip runs in one process: ours ->
export -> transformers' load and ``save_pretrained`` -> the engine's import, bit for bit;
so does the Mistral's and the Phi-3's: the engine's import -> a checkpoint ->
``export_hf`` -> a Mistral (a Phi-3, its Q/K/V and gate/up packed) again; so do the
Gemmas', whose forward and gradients are checked in one process against transformers'
(and against the planted faults of each of Gemma's options). A small multimodal
``Gemma3ForConditionalGeneration`` (SigLIP tower of one layer) is read for its language
model only, under the Hub's tensor names and its ``state_dict``'s, and exported as a
text-only ``Gemma3ForCausalLM``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO
from helpers import assert_one_line_exit_2
from shardwise.checkpoint.hf import read_config
from shardwise.cli.main import main
from shardwise.models.hf import section_of

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

from hf_models import BUILDERS, GEMMA3_ROPE, VOCAB, WINDOW, perturb, save  # noqa: E402


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """Every checkpoint of ``hf_models.BUILDERS``, saved as transformers does: one per
    architecture shardwise reads and writes, and a second Qwen3-MoE (top k not
    renormalised), four with a sliding window of 8 tokens, shorter than the 32 the tests
    feed (``WINDOW``): a Mistral (every layer), a Qwen2 (``use_sliding_window``,
    ``max_window_layers`` 1: layer 1 only), a Qwen2-MoE (its default pattern: the even
    layers, layer 0 only) and a Phi-3 (Phi-3-mini-4k's window in small, on every layer; the
    default rotary, on 10 of each head's 16 features); the Gemma 2's and 3's windows on
    layer 0. Sizes and options: each builder's docstring in ``tests/hf_models.py``."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {name: save(name, root) for name in BUILDERS}
    assert (root / "llama" / "model.safetensors.index.json").is_file()
    assert (root / "gpt2" / "model.safetensors").is_file()
    saved = safetensors.safe_open(root / "qwen3moe" / "model.safetensors", "pt").keys()
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in saved  # per expert on disk
    saved = safetensors.safe_open(root / "qwen2moe" / "model.safetensors", "pt").keys()
    assert {"model.layers.1.mlp.shared_expert_gate.weight",
            "model.layers.1.mlp.experts.3.up_proj.weight"} <= set(saved)
    saved = safetensors.safe_open(root / "phi3" / "model.safetensors", "pt").keys()
    assert {"model.layers.1.self_attn.qkv_proj.weight",
            "model.layers.1.mlp.gate_up_proj.weight"} <= set(saved)  # packed on disk
    saved = safetensors.safe_open(root / "gemma3_vlm" / "model.safetensors", "pt").keys()
    assert {"language_model.model.embed_tokens.weight",  # the Hub's names, not state_dict's
            "multi_modal_projector.mm_input_projection_weight"} <= set(saved)
    return dirs


@pytest.fixture(scope="module")
def text(tmp_path_factory, corpus) -> Path:
    """20 KB of Shakespeare: fewer distinct characters than VOCAB."""
    path = tmp_path_factory.mktemp("text") / "my.txt"
    path.write_text(corpus.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    assert len(set(path.read_text(encoding="utf-8"))) < VOCAB
    return path


def _hf_logits(path: Path, idx: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(idx).logits


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral", "qwen3"])
def test_round_trip_at_dp2_tp2_pp2_is_bit_exact(arch, hf_dirs, text, tmp_path, capfd):
    """init_from at dp2 x tp2 x pp2 (the Mixtral's experts also over ep2: each rank reads
    its two experts' tp slices), one step at lr 0, export: the exported model's tensors
    equal the original's bit for bit and so do its logits; the Llama run also writes
    TensorBoard events, read back with tensorboard's own reader. (The commands run in this
    process, ``cli.main``: the ranks are spawned either way.)"""
    run, out = tmp_path / "run", tmp_path / "exported"
    extra = {"llama": ["--training.tensorboard", "true"],
             "mixtral": ["--parallel.ep", "2"]}.get(arch, [])
    code = main(["train", "--config", str(REPO / "configs" / "finetune_hf.toml"),
                 "--data", str(text), "--model.init_from", f"hf:{hf_dirs[arch]}",
                 "--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2",
                 "--training.steps", "1", "--optimizer.lr", "0",
                 "--training.out_dir", str(run), "--training.eval_batches", "1",
                 "--training.sample_chars", "0", "--training.progress", "false", *extra])
    done = capfd.readouterr()
    assert code == 0, done.err[-3000:]
    kind = "gpt" if arch == "gpt2" else "llama"
    dp = "dp=2 (ep=2)" if arch == "mixtral" else "dp=2"
    assert f"shardwise: {kind} " in done.out and f"{dp} x pp=2" in done.out
    assert f"from hf:{hf_dirs[arch]}" in done.out
    assert main(["export", str(run), "--format", "hf", "--out", str(out),
                 "--max-shard-size", "30KB"]) == 0, capfd.readouterr().err
    assert (out / "model.safetensors.index.json").is_file()  # sharded above the size

    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[arch]).eval()
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported) is type(original)
    a, b = original.state_dict(), exported.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.float32, name
        assert torch.equal(a[name], b[name]), name
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(original(idx).logits, exported(idx).logits)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(original).__name__]

    tok = transformers.AutoTokenizer.from_pretrained(out)  # the run's characters, same ids
    sample = text.read_text(encoding="utf-8")[:200]
    chars = sorted(set(text.read_text(encoding="utf-8")))
    assert tok(sample)["input_ids"] == [chars.index(c) for c in sample]
    assert tok.decode(tok(sample)["input_ids"]) == sample

    if arch == "llama":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        from shardwise.training.metrics import read_metrics

        events = EventAccumulator(str(run / "tensorboard"))
        events.Reload()
        tags = set(events.Tags()["scalars"])
        assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/mfu",
                "memory/max_rss_mib", "val/val_loss"} <= tags, tags
        rows = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
        assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
            (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
        assert events.Scalars("train/lr")[0].value == 0.0


def test_forward_on_imported_weights_equals_transformers_at_tp1_and_tp2(hf_dirs):
    """The engine's logits on the imported weights equal transformers' within 1e-5 (fp32):
    in one process, and at tp = 2 (each rank loading its slices: the Qwen2's Q/K/V biases
    split with their rows, the Qwen3's q_norm / k_norm whole, the Qwen2-MoE's shared
    expert by its width and its gate whole, the Mistral's heads of head_dim 12, the Phi-3's
    slice of each of Q, K, V in its packed qkv_proj and of gate and up in gate_up_proj, the
    Gemma 2's soft-capped scores of its heads and logits of its half of the vocabulary, the
    Gemma 3's zero-centred q_norm / k_norm whole, the multimodal Gemma 3's language model
    against transformers' Gemma3ForConditionalGeneration on text; the figures:
    ``benchmarks/hf_parity.py``), all twenty models, six of them
    attending in a sliding window of 8 of the 32 tokens (on every layer, on layer 1, on
    layer 0, on every layer, the Gemma 2's and 3's on layer 0: each rank's heads in the
    window), two DeepSeeks (MLA: each rank's heads, the down projections whole; V3's
    routing bias read into every rank);
    the Mixtral (top 2 of 4
    experts), the Qwen3-MoE whose top 2 are not renormalised (``norm_topk_prob`` false) and
    the Qwen2-MoE also at dp2 x ep2 (each rank loading its two experts)."""
    from hf_workers import imported_logits
    from shardwise.launch import spawn

    dirs = [str(hf_dirs[a]) for a in ("llama", "gpt2", "qwen2", "qwen3", "mistral", "phi3",
                                      "mistral_swa", "qwen2_swa", "qwen2moe_swa", "phi3_swa",
                                      "gemma", "gemma2", "gemma3", "gemma3_vlm",
                                      "deepseek_v2", "deepseek_v3", "qwen3moe",
                                      "qwen3moe_raw", "qwen2moe", "mixtral")]
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
    want = [_hf_logits(Path(d), idx) for d in dirs]
    tp1 = imported_logits(dirs, idx)
    tp2 = spawn(imported_logits, 2, (dirs, idx, 2, dirs[-3:]), threads=1)
    assert len(tp1) == 20 and len(tp2[0]) == 23
    for ours in (tp1, tp2[0], tp2[1]):
        for got, ref in zip(ours, want + want[-3:]):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_the_parity_benchmark_measures_a_gemma3_and_covers_every_arch(hf_dirs, tmp_path):
    """``benchmarks/hf_parity.py`` (the figures docs/models.md cites) keeps running: its row
    of the Gemma 3 (the engine's import, both attention kernels, the gradients, the export)
    is within the bounds these tests assert, and every arch of ``models.hf.ARCHS`` has a
    checkpoint in ``hf_models.BUILDERS``, so the benchmark has a row for it."""
    import importlib.util

    from shardwise.models.hf import ARCHS

    spec = importlib.util.spec_from_file_location("hf_parity",
                                                  REPO / "benchmarks" / "hf_parity.py")
    hf_parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_parity)
    row = hf_parity.measure("gemma3", hf_dirs["gemma3"], tmp_path)
    assert row["architecture"] == "Gemma3ForCausalLM" and row["export_exact"], row
    assert max(row["tp1_max"], row["math_max"], row["grad"]) < 1e-5, row
    architectures = {read_config(path)["architectures"][0] for path in hf_dirs.values()}
    assert {a.architecture for a in ARCHS} <= architectures


def _forward_and_backward_equal_transformers(path, impl: str):
    """transformers' model of the checkpoint at ``path`` and ours of it (attention kernel
    ``impl``) on the same 2 x 32 tokens: our logits equal theirs within 1e-5 and every
    parameter's gradient of the cross-entropy within 1e-5 of its largest entry (fp32).
    Returns ``(our LlamaConfig, our model, the tokens, their logits)``."""
    import torch.nn.functional as F

    from shardwise.base.config import ModelConfig
    from shardwise.models.description import describe_section
    from shardwise.models.llama import Llama, from_hf_state_dict, hf_name

    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    section = section_of(read_config(path))
    g = torch.Generator().manual_seed(6)
    idx, targets = (torch.randint(0, VOCAB, (2, 32), generator=g) for _ in range(2))
    logits = theirs(idx).logits
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    want = {n: p.grad for n, p in theirs.named_parameters()}
    cfg = describe_section(ModelConfig(**section, attention=impl), 0).config
    ours = Llama(cfg)
    ours.load_state_dict(from_hf_state_dict(theirs.state_dict(), cfg.tie_weights))
    got, loss = ours(idx, targets)
    loss.backward()
    torch.testing.assert_close(got, logits.detach(), rtol=1e-5, atol=1e-5)
    for name, p in ours.named_parameters():
        ref = want[hf_name(name)]
        err = float((p.grad - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, (impl, name, err)
    return cfg, ours, idx, logits.detach()


@pytest.mark.parametrize("arch", ["mistral_swa", "qwen2_swa"])
def test_sliding_window_forward_and_backward_equal_transformers(arch, hf_dirs):
    """32 tokens through a sliding window of 8 (a Mistral's on every layer; a Qwen2's on
    layer 1 only, ``max_window_layers`` 1, its head tied): our logits and every
    parameter's gradient of the cross-entropy equal transformers' within 1e-5 (fp32),
    with both attention kernels: the band as SDPA's boolean mask (as transformers' own
    SDPA path) and the scores written out (the figures: ``benchmarks/hf_parity.py``,
    rows ``mistral_swa`` and ``qwen2_swa``). The band's edges are transformers' (query i
    sees keys i - W < j <= i): a window one token longer or shorter is off by more than
    1e-2."""
    from dataclasses import replace

    from shardwise.models.llama import Llama

    section = section_of(read_config(hf_dirs[arch]))
    assert section["sliding_window"] == WINDOW and section["block_size"] == 32
    for impl in ("sdpa", "math"):
        cfg, ours, idx, logits = _forward_and_backward_equal_transformers(hf_dirs[arch], impl)
        assert cfg.windows == ((WINDOW,) * 2 if arch == "mistral_swa" else (None, WINDOW))
        for off in (-1, 1):  # the band's edges: one token more or less changes the logits
            other = Llama(replace(cfg, sliding_window=WINDOW + off))
            other.load_state_dict(ours.state_dict())
            with torch.no_grad():
                assert (other(idx)[0] - logits).abs().max() > 1e-2, (impl, off)


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
def test_gemma_forward_and_backward_equal_transformers(arch, hf_dirs):
    """A Gemma, a Gemma 2 (soft caps 2 and 3, eager attention as transformers runs it) and
    a Gemma 3 (linear-scaled global rotary, local base 1e4, QK-norm), their windows of 8 on
    layer 0 of 32 tokens: our logits and every parameter's gradient of the cross-entropy
    equal transformers' within 1e-5 (fp32; the figures: ``benchmarks/hf_parity.py``), with
    SDPA (the Gemma 3 with the scores written out too; a soft cap writes them out either
    way). Each of Gemma's
    options matters here: the ``PLANTED`` faults (the norm without its 1 +, the embedding
    unscaled, SiLU for GeGLU, the sandwich norms swapped, head_dim's scale, the soft caps
    off, the global rotary on the local layers) each move the logits by more than 1e-3."""
    from dataclasses import replace

    from shardwise.models.llama import Llama

    # the Gemma 2's soft cap writes the scores out whatever the kernel: one kernel is enough
    for impl in ("sdpa", "math") if arch == "gemma3" else ("sdpa",):
        cfg, ours, idx, logits = _forward_and_backward_equal_transformers(hf_dirs[arch], impl)
        assert cfg.windows == ((None, None) if arch == "gemma" else (WINDOW, None))
    planted = {"mlp_activation": "silu", "scale_embedding": False,
               "query_pre_attn_scalar": None if cfg.query_pre_attn_scalar else 100.0}
    if arch == "gemma2":
        planted.update(attn_logit_softcapping=None, final_logit_softcapping=None)
    if arch == "gemma3":
        planted.update(rope_local_base_freq=None)
    for field, value in planted.items():
        other = Llama(replace(cfg, **{field: value}))
        other.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert (other(idx)[0] - logits).abs().max() > 1e-3, field
    state = ours.state_dict()
    with torch.no_grad():  # the norms' weights as a Llama's (no 1 +): other logits
        other = Llama(replace(cfg, norm_zero_centered=False))
        other.load_state_dict(state)
        assert (other(idx)[0] - logits).abs().max() > 1e-3, "norm_zero_centered"
        if cfg.sandwich_norm:  # the attention output's and the MLP input's norms swapped
            swapped = dict(state)
            for i in range(cfg.n_layer):
                a, b = (f"blocks.{i}.{n}.weight" for n in ("post_attention_layernorm",
                                                          "pre_feedforward_layernorm"))
                swapped[a], swapped[b] = state[b], state[a]
            other = Llama(cfg)
            other.load_state_dict(swapped)
            assert (other(idx)[0] - logits).abs().max() > 1e-3, "sandwich_norm"


def _exported_is_the_source(src, out, architecture: str, idx, ours) -> None:
    """The checkpoint exported to ``out`` loads in transformers as ``architecture``, holds
    the source ``src``'s tensors bit for bit and gives its logits on ``idx`` exactly; our
    logits ``ours`` (of the same tokens) are theirs within 1e-5."""
    original = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == architecture
    a, b = original.state_dict(), exported.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        theirs = exported(idx).logits
        assert torch.equal(theirs, original(idx).logits)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
def test_a_gemma_in_is_a_gemma_out(arch, hf_dirs, tmp_path):
    """A Gemma, Gemma 2 or Gemma 3 imported by the engine in one process, saved as a run's
    checkpoint with its source config.json, exported (``export_hf``) as itself: its tensors
    are the source's bit for bit, the logits of the exported model equal the source's
    exactly and ours within 1e-5, its config.json keeps the model's options (Gemma 3's
    rotary keyed by layer type). Without a source the same model is that Gemma too
    (``arch_for``; with the sandwich norms a Gemma is a Gemma 2, with QK-norm a Gemma 2
    none, its scores capped; without zero-centred norms, the embedding's scale or GeGLU, or
    with Q/K/V biases, none: the export refuses it), and ``config_json(cfg, None)`` reads back the
    same [model] fields. The older form of a Gemma 3 config.json (``rope_theta``,
    ``rope_local_base_freq``, ``rope_scaling``) reads as the new one does."""
    from dataclasses import replace

    from shardwise.apps.lm.hf import check_init_from, resolve_init_from
    from shardwise.base.config import Config
    from shardwise.models.description import describe_section
    from shardwise.models.hf import GEMMA, GEMMA2, GEMMA3, arch_for, export_arch

    src = hf_dirs[arch]
    source = read_config(src)
    cfg = resolve_init_from(Config.from_dict({"model": {"init_from": f"hf:{src}"}}))
    check_init_from(cfg, VOCAB)
    d = describe_section(cfg.model, VOCAB)
    want = {"gemma": GEMMA, "gemma2": GEMMA2, "gemma3": GEMMA3}[arch]
    assert d.hf is want and export_arch(d, source) is want and arch_for(d.config) is want
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(5))
    ours, done = _import_and_export(cfg, d, src, source, idx, 32, tmp_path)
    assert done.architecture == want.architecture
    _exported_is_the_source(src, tmp_path / "out", want.architecture, idx, ours)
    others = {"gemma": ({"sandwich_norm": True}, GEMMA2),
              "gemma2": ({"qk_norm": True}, None),  # Gemma 3's attention has no cap
              "gemma3": ({"qk_norm": False}, None)}  # Gemma 3's local rotary: no Gemma 2
    change, arch = others[arch]
    assert arch_for(replace(d.config, **change)) is arch
    for other in ({"norm_zero_centered": False}, {"mlp_activation": "silu"},
                  {"scale_embedding": False}, {"qkv_bias": True}):
        assert arch_for(replace(d.config, **other)) is None, other  # no arch: export refuses
    fresh = section_of(want.config_json(d.config, None))
    assert {k: fresh[k] for k in section_of(source)} == section_of(source)
    if arch == "gemma3":
        assert read_config(tmp_path / "out")["rope_parameters"] == GEMMA3_ROPE
        older = {k: v for k, v in source.items() if k != "rope_parameters"}
        older.update(rope_theta=1e6, rope_local_base_freq=1e4,
                     rope_scaling={"rope_type": "linear", "factor": 8.0})
        assert section_of(older) == section_of(source)
        assert transformers.Gemma3TextConfig(**older).rope_parameters == GEMMA3_ROPE


def _state_dict_layout(src: Path, dst: Path, text: str = "model.language_model.") -> None:
    """``src`` copied to ``dst`` with its safetensors keys renamed from the Hub's
    ``Gemma3ForConditionalGeneration`` names (``language_model.model.layers.N...``, what
    ``save_pretrained`` writes) to the model's own ``state_dict`` names
    (``model.language_model.layers.N...``, ``model.vision_tower.*``; ``text``: another
    prefix for the language model's, to plant a wrong one)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    renamed = {(text + k[len("language_model.model."):] if k.startswith("language_model.model.")
                else "lm_head.weight" if k == "language_model.lm_head.weight"
                else "model." + k): v for k, v in tensors.items()}
    save_file(renamed, dst / "model.safetensors", metadata={"format": "pt"})


def test_a_gemma3_vlm_trains_its_language_model_and_exports_it_text_only(hf_dirs, tmp_path,
                                                                         monkeypatch):
    """A ``Gemma3ForConditionalGeneration`` (``_gemma3_vlm``; its config.json's
    ``text_config`` as the Hub's files list it, ``_as_released``) is read for its language
    model: the [model] fields transformers' ``Gemma3Config`` gives its text config (the
    Hub's gemma-3-4b-it config.json too, whose text_config lists six fields); the engine
    reads the language model's slices only, never a vision or projector tensor, under the
    Hub's names (``language_model.model.*``, what ``save_pretrained`` writes) or the
    model's ``state_dict``'s (``model.language_model.*``: the same logits, bit for bit; a
    checkpoint under neither is refused naming its file), and its logits on text
    equal transformers' multimodal model's within 1e-5. Exported, the run is a text-only
    ``Gemma3ForCausalLM`` holding that language model's tensors bit for bit, whose logits
    are the multimodal model's; ``shardwise plan`` prices the checkpoint as that model."""
    from hf_workers import imported_logits
    from shardwise.apps.lm.hf import check_init_from, resolve_init_from
    from shardwise.base.config import Config, ConfigError
    from shardwise.checkpoint.hf import SafetensorsDir
    from shardwise.models.description import describe_section
    from shardwise.models.hf import GEMMA3, GEMMA3_VLM, HFConfigError, export_arch
    from shardwise.planner.specs import load_model

    src = hf_dirs["gemma3_vlm"]
    source = read_config(src)
    text = transformers.Gemma3Config(**source).text_config.to_dict()  # defaults filled
    assert section_of(source) == section_of(text)
    hub_4b = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "eos_token_id": [1, 106], "mm_tokens_per_image": 256, "text_config": {
                  "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                  "num_hidden_layers": 34, "sliding_window": 1024,
                  "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
              "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}}
    assert section_of(hub_4b) == section_of(
        transformers.Gemma3Config(**hub_4b).text_config.to_dict())
    for bad, what in (({"text_config": {"model_type": "llama"}}, "text_config.model_type"),
                      ({"tie_word_embeddings": False}, "text_config.tie_word_embeddings=True"),
                      ({"text_config": {**source["text_config"], "use_bidirectional_attention":
                                        True}}, "text_config.use_bidirectional_attention")):
        with pytest.raises(HFConfigError, match=re.escape(what)):
            section_of({**source, "text_config": {**source["text_config"],
                                                  "tie_word_embeddings": True}, **bad})

    cfg = resolve_init_from(Config.from_dict({"model": {"init_from": f"hf:{src}"}}))
    check_init_from(cfg, VOCAB)
    d = describe_section(cfg.model, VOCAB)
    assert d.hf is GEMMA3 and export_arch(d, source) is GEMMA3_VLM
    read, plain = [], SafetensorsDir.read
    monkeypatch.setattr(SafetensorsDir, "read",
                        lambda self, name, *a: read.append(name) or plain(self, name, *a))
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(5))
    ours, done = _import_and_export(cfg, d, src, source, idx, 32, tmp_path)
    assert read and all(n.startswith("language_model.model.") for n in read), read
    theirs = transformers.Gemma3ForConditionalGeneration.from_pretrained(src).eval()
    with torch.no_grad():
        want = theirs(input_ids=idx).logits
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)

    own = tmp_path / "own"
    _state_dict_layout(src, own)
    cfg_own = resolve_init_from(Config.from_dict({"model": {"init_from": f"hf:{own}"}}))
    check_init_from(cfg_own, VOCAB)
    assert torch.equal(imported_logits([str(own)], idx)[0][..., :VOCAB], ours)
    _state_dict_layout(src, tmp_path / "wrong", text="model.language_model.model.")
    cfg_wrong = resolve_init_from(Config.from_dict({"model": {"init_from":
                                                              f"hf:{tmp_path / 'wrong'}"}}))
    with pytest.raises(ConfigError, match=re.escape(
            f"{tmp_path / 'wrong' / 'model.safetensors'}: no Gemma3ForConditionalGeneration "
            "language model in it")):
        check_init_from(cfg_wrong, VOCAB)

    out = tmp_path / "out"
    assert done.architecture == "Gemma3ForCausalLM"
    written = read_config(out)
    assert (written["model_type"], written["architectures"], written["query_pre_attn_scalar"],
            written["rope_parameters"]) == ("gemma3_text", ["Gemma3ForCausalLM"], 256,
                                            GEMMA3_ROPE)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported) is transformers.Gemma3ForCausalLM
    a = theirs.model.language_model.state_dict()
    b = {k.removeprefix("model."): v for k, v in exported.state_dict().items()
         if k != "lm_head.weight"}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        torch.testing.assert_close(exported(idx).logits, want, rtol=1e-5, atol=1e-5)
    plan, plan_out = load_model(f"hf:{src}"), load_model(f"hf:{out}")
    assert (plan.params, plan.n_layer, plan.attention_windows) == (
        plan_out.params, plan_out.n_layer, plan_out.attention_windows)


def test_a_llama_with_experts_exports_as_a_mixtral_only_when_it_is_one(tmp_path):
    """A Llama trained here with a Mixtral's mixture and a sliding window of 4 on every
    layer (no source config.json) is written as a ``MixtralForCausalLM`` whose logits
    on 16 tokens equal ours; sigmoid gating, unrenormalised gates, a capacity factor, a
    shared expert or a window on some layers only have no such mapping."""
    from dataclasses import replace

    from shardwise.checkpoint.hf import write_safetensors
    from shardwise.models.hf import MIXTRAL, to_hf_tensors
    from shardwise.models.llama import Llama, LlamaConfig, describe

    cfg = LlamaConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_kv_heads=2,
                      n_embd=32, ffn_hidden=24, moe_ffn_hidden=16, n_experts=4, top_k=2,
                      sliding_window=4)
    d = describe(cfg)
    assert d.hf is MIXTRAL
    for other in ({"moe_gating": "sigmoid"}, {"moe_norm_topk": False},
                  {"moe_capacity_factor": 1.25}, {"moe_shared_expert": True},
                  {"moe_bias_update_rate": 0.001},
                  {"layer_types": ("sliding_attention", "full_attention")}):
        assert describe(replace(cfg, **other)).hf is None, other
    torch.manual_seed(3)
    ours = perturb(Llama(cfg))
    write_safetensors(tmp_path, to_hf_tensors(d, {k: v.detach() for k, v in
                                                  ours.state_dict().items()}))
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL.config_json(cfg, None)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == "MixtralForCausalLM" and theirs.config.sliding_window == 4
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], theirs(idx).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_topk", [True, False])
def test_a_llama_with_experts_and_qk_norm_exports_as_a_qwen3_moe(norm_topk, tmp_path):
    """A Llama trained here with Qwen3's QK-norm (head_dim other than n_embd / n_head) and
    a mixture of experts, its top k renormalised or not (``norm_topk_prob``), no source
    config.json, is written as a ``Qwen3MoeForCausalLM`` (per-expert tensors) whose logits
    equal ours; sigmoid gating, a capacity factor, a shared expert, a routing bias or Q/K/V
    biases have no such mapping, and without the QK-norm it is a Mixtral (renormalised)."""
    from dataclasses import replace

    from shardwise.checkpoint.hf import write_safetensors
    from shardwise.models.hf import MIXTRAL, QWEN3_MOE, to_hf_tensors
    from shardwise.models.llama import Llama, LlamaConfig, describe

    cfg = LlamaConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_kv_heads=2,
                      n_embd=32, ffn_hidden=24, moe_ffn_hidden=16, n_experts=4, top_k=2,
                      qk_norm=True, head_dim=12, moe_norm_topk=norm_topk, rope_theta=1e6)
    d = describe(cfg)
    assert d.hf is QWEN3_MOE
    for other in ({"moe_gating": "sigmoid"}, {"moe_capacity_factor": 1.25},
                  {"moe_shared_expert": True}, {"moe_bias_update_rate": 0.001},
                  {"qkv_bias": True}):
        assert describe(replace(cfg, **other)).hf is None, other
    assert describe(replace(cfg, qk_norm=False)).hf is (MIXTRAL if norm_topk else None)
    torch.manual_seed(3)
    ours = perturb(Llama(cfg))
    tensors = to_hf_tensors(d, {k: v.detach() for k, v in ours.state_dict().items()})
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in tensors
    write_safetensors(tmp_path, tensors)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE.config_json(cfg, None)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    assert theirs.config.norm_topk_prob is norm_topk and theirs.config.num_experts == 4
    # over a source config.json as save_pretrained writes it (num_local_experts, 8 experts,
    # the other norm_topk_prob): ours written over it, read back as ours
    source = transformers.Qwen3MoeConfig(num_experts=8, norm_topk_prob=not norm_topk).to_dict()
    written = QWEN3_MOE.config_json(cfg, source)
    assert "num_local_experts" not in written
    back = section_of(written)
    assert {k: back[k] for k in ("n_experts", "top_k", "moe_norm_topk", "moe_ffn_hidden",
                                 "qk_norm", "head_dim", "n_kv_heads", "moe_aux_loss_coef")} == {
        "n_experts": 4, "top_k": 2, "moe_norm_topk": norm_topk, "moe_ffn_hidden": 16,
        "qk_norm": True, "head_dim": 12, "n_kv_heads": 2, "moe_aux_loss_coef": 0.01}
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], theirs(idx).logits, rtol=1e-5, atol=1e-5)


def test_a_llama_with_a_gated_shared_expert_is_a_qwen2_moe_out_and_back_in(tmp_path):
    """A Llama trained here with Qwen2's Q/K/V biases and a Qwen2-MoE's mixture (top 2 of 4
    not renormalised, a shared expert of its own width 24 scaled by its sigmoid gate), no
    source config.json, is written as a ``Qwen2MoeForCausalLM`` whose logits equal ours;
    what transformers' ``save_pretrained`` writes of it is what we wrote, bit for bit, and
    the engine (one process) imports that back as our tensors, bit for bit. Without the
    gate, with QK-norm, sigmoid gating, a capacity factor or a routing bias there is no such
    mapping; without the biases it is a Qwen2-MoE still (``qkv_bias`` false); a gate
    without a shared expert is refused, naming the field."""
    from dataclasses import replace

    from safetensors.torch import load_file

    from shardwise.base.config import ModelConfig
    from shardwise.base.topology import Topology
    from shardwise.checkpoint.hf import write_safetensors
    from shardwise.engine import Engine, EngineConfig
    from shardwise.engine.state import model_tensors
    from shardwise.models.description import describe_section
    from shardwise.models.hf import QWEN2_MOE, to_hf_tensors
    from shardwise.models.llama import Llama, LlamaConfig, describe

    cfg = LlamaConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_kv_heads=2,
                      n_embd=32, ffn_hidden=48, moe_ffn_hidden=16, n_experts=4, top_k=2,
                      moe_norm_topk=False, qkv_bias=True, moe_shared_expert=True,
                      moe_shared_ffn_hidden=24, moe_shared_expert_gate=True, rope_theta=1e6)
    d = describe(cfg)
    assert d.hf is QWEN2_MOE and describe(replace(cfg, qkv_bias=False)).hf is QWEN2_MOE
    for other in ({"moe_shared_expert_gate": False}, {"qk_norm": True},
                  {"moe_gating": "sigmoid"}, {"moe_capacity_factor": 1.25},
                  {"moe_bias_update_rate": 0.001}):
        assert describe(replace(cfg, **other)).hf is None, other
    with pytest.raises(ValueError, match="model.moe_shared_expert_gate=True without"):
        replace(cfg, moe_shared_expert=False)
    torch.manual_seed(3)
    ours = perturb(Llama(cfg))
    tensors = to_hf_tensors(d, {k: v.detach() for k, v in ours.state_dict().items()})
    assert tensors["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 32)
    assert tensors["model.layers.1.mlp.shared_expert.down_proj.weight"].shape == (32, 24)
    write_safetensors(tmp_path / "ours", tensors)
    (tmp_path / "ours" / "config.json").write_text(json.dumps(QWEN2_MOE.config_json(cfg, None)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(theirs).__name__ == "Qwen2MoeForCausalLM"
    c = theirs.config
    assert (c.shared_expert_intermediate_size, c.moe_intermediate_size, c.norm_topk_prob,
            c.qkv_bias, c.num_experts) == (24, 16, False, True, 4)
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], theirs(idx).logits, rtol=1e-5, atol=1e-5)
    theirs.save_pretrained(tmp_path / "theirs")
    saved = load_file(tmp_path / "theirs" / "model.safetensors")
    assert saved.keys() == tensors.keys()
    assert all(torch.equal(saved[k], tensors[k]) for k in tensors)
    back = describe_section(ModelConfig(**section_of(read_config(tmp_path / "theirs"))), 0)
    assert back.config == cfg
    engine = Engine(back, Topology.build(1, 1, 1), EngineConfig(
        seq_len=16, init_from=str(tmp_path / "theirs"), optimizer={"grad_clip": 0.0},
        training={"global_batch_size": 1}))
    imported = model_tensors(engine)
    want = dict(ours.named_parameters())
    assert imported.keys() == want.keys()
    assert all(torch.equal(imported[k], want[k]) for k in want)
    # over a source config.json (other sizes, a window on no layer): ours written over it
    source = transformers.Qwen2MoeConfig(num_experts=8, shared_expert_intermediate_size=100,
                                         norm_topk_prob=True, qkv_bias=False).to_dict()
    got = section_of(QWEN2_MOE.config_json(cfg, source))
    assert {k: got[k] for k in ("n_experts", "moe_norm_topk", "moe_shared_ffn_hidden",
                                "moe_shared_expert_gate", "qkv_bias", "block_size")} == {
        "n_experts": 4, "moe_norm_topk": False, "moe_shared_ffn_hidden": 24,
        "moe_shared_expert_gate": True, "qkv_bias": True, "block_size": 32768}


def _import_export(path: Path, out: Path):
    """``path``'s checkpoint through one process's engine (``model.init_from``) and out
    again as its arch writes it (the parameters and the training-state buffers the arch
    has: DeepSeek-V3's routing bias): (our description, our logits of a fixed batch, the
    batch)."""
    from shardwise.base.config import ModelConfig
    from shardwise.base.topology import Topology
    from shardwise.checkpoint.hf import write_safetensors
    from shardwise.engine import Engine, EngineConfig
    from shardwise.engine.state import model_tensors
    from shardwise.models.description import describe_section
    from shardwise.models.hf import to_hf_tensors

    source = read_config(path)
    d = describe_section(ModelConfig(**section_of(source)), 0).with_checkpoint_arch(source)
    engine = Engine(d, Topology.build(1, 1, 1), EngineConfig(
        seq_len=16, init_from=str(path), optimizer={"grad_clip": 0.0},
        training={"global_batch_size": 2}))
    tensors = {**model_tensors(engine), **dict(engine.local.named_buffers())}
    model = d.build().eval()
    model.load_state_dict(tensors)
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(idx)[0]
    with torch.device("meta"):
        complete = d.build()
    write_safetensors(out, to_hf_tensors(d, tensors, complete))
    (out / "config.json").write_text(json.dumps(d.hf.config_json(d.config, source)))
    return d, logits, idx


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_deepseek_in_and_out(name, hf_dirs, tmp_path):
    """A DeepSeek-V3 / V2 (``_deepseek``) imported as our Llama with MLA, mixed blocks and
    DeepSeek's routing (V3's ``e_score_correction_bias`` our frozen routing bias,
    ``model.moe_expert_bias``), its logits transformers' within 1e-5; exported, every tensor
    ``from_pretrained`` reads equals the original bit for bit (the bias too) and so do the
    logits. A multi-token-prediction layer after the last (V3's ``num_nextn_predict_layers``;
    transformers ignores its tensors) is ignored too; linear rope scaling and a mismatched
    key/value head count are refused in one line naming the field."""
    from safetensors.torch import load_file, save_file

    from shardwise.models.hf import HFConfigError

    src = tmp_path / "in"
    shutil.copytree(hf_dirs[name], src)
    file = src / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)  # an MTP layer's
    save_file(tensors, file, metadata={"format": "pt"})
    d, logits, idx = _import_export(src, tmp_path / "out")
    assert d.config.kv_lora_rank == 16 and d.config.dense_layers == (0,)
    assert d.config.moe_expert_bias == (name == "deepseek_v3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[name]).eval()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(hf)
    a, b = hf.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(idx).logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(back(idx).logits, hf(idx).logits)
    config = read_config(hf_dirs[name])
    for changes, what in (({"rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 1e4}}, "rope_type='linear'"),
                          ({"num_key_value_heads": 2}, "num_key_value_heads=2")):
        with pytest.raises(HFConfigError, match=rf"^config.json: {what} .*cannot hold it"):
            section_of({**config, **changes})


def test_deepseek_yarn_in_and_out(tmp_path):
    """A DeepSeek-V3 with YaRN (factor 8 over an original 8 tokens, fed 16; mscale 0.9 and
    mscale_all_dim 0.7, so cos and sin are scaled and so is the softmax): imported, our
    logits equal transformers' within 1e-5 (measured 2.4e-7), and differ by more than 1e-3
    from the same weights without YaRN; exported, ``from_pretrained`` reads the same
    ``rope_parameters`` and gives the same logits, bit for bit."""
    from dataclasses import replace

    from shardwise.models.llama import Yarn, describe

    torch.manual_seed(0)
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0,
            "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 0.9, "mscale_all_dim": 0.7}
    hf = perturb(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=64,
        rope_parameters=rope, tie_word_embeddings=False))).eval()
    hf.save_pretrained(tmp_path / "in")
    d, logits, idx = _import_export(tmp_path / "in", tmp_path / "out")
    assert isinstance(d.config.rope_scaling, Yarn) and d.config.rope_scaling.mscale == 0.9
    with torch.no_grad():
        want = hf(idx).logits
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        plain = describe(replace(d.config, rope_scaling=None)).build().eval()
        plain.load_state_dict(_ours(tmp_path / "in", d))
        assert (plain(idx)[0] - want).abs().max() > 1e-3
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.config.rope_parameters == {**rope, "rope_theta": 1e4}
    with torch.no_grad():
        assert torch.equal(back(idx).logits, want)


def _ours(path: Path, d) -> dict:
    """``path``'s tensors under our names, loaded by one process's engine."""
    from shardwise.base.topology import Topology
    from shardwise.engine import Engine, EngineConfig
    from shardwise.engine.state import model_tensors

    engine = Engine(d, Topology.build(1, 1, 1), EngineConfig(
        seq_len=16, init_from=str(path), optimizer={"grad_clip": 0.0},
        training={"global_batch_size": 1}))
    return {**model_tensors(engine), **dict(engine.local.named_buffers())}


@pytest.mark.parametrize("kind", ["qwen2moe", "qwen3moe"])
def test_mixed_dense_and_moe_layers_in_and_out(kind, tmp_path):
    """A Qwen2-MoE with ``mlp_only_layers`` [0] and a Qwen3-MoE with ``decoder_sparse_step``
    2 (layers 0 and 2 dense, of ``intermediate_size``), three layers each: imported as
    ``model.dense_layers`` (the dense blocks' SwiGLU under Llama's names), our logits equal
    transformers'; exported, ``from_pretrained`` reads every tensor bit for bit (the dense
    layers written as ``mlp_only_layers``, step 1) and gives the same logits."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                  moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, num_experts=4,
                  num_experts_per_tok=2, tie_word_embeddings=False)
    if kind == "qwen2moe":
        hf = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, shared_expert_intermediate_size=24, mlp_only_layers=[0]))
        dense = (0,)
    else:
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, head_dim=8, decoder_sparse_step=2))
        dense = (0, 2)
    hf = perturb(hf).eval()
    assert [type(layer.mlp).__name__.endswith("MLP") for layer in hf.model.layers] == \
        [i in dense for i in range(3)]
    hf.save_pretrained(tmp_path / "in")
    d, logits, idx = _import_export(tmp_path / "in", tmp_path / "out")
    assert d.config.dense_layers == dense and d.hf.architecture == type(hf).__name__
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(idx).logits, rtol=1e-5, atol=1e-5)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.config.mlp_only_layers == list(dense) and back.config.decoder_sparse_step == 1
    a, b = hf.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("options,arch", [({"qkv_bias": True}, "Qwen2ForCausalLM"),
                                          ({"qk_norm": True, "head_dim": 12},
                                           "Qwen3ForCausalLM")])
def test_a_llama_with_qwen_options_exports_as_that_qwen(options, arch, tmp_path):
    """A Llama trained here with Qwen2's Q/K/V biases (tied head) or Qwen3's QK-norm and a
    head_dim other than n_embd / n_head, and a sliding window of 4 on layer 1 only (no
    source config.json), is written as that Qwen (``use_sliding_window``, ``layer_types``),
    whose logits on 16 tokens equal ours; a plain Llama stays a Llama, both options at once
    have no mapping, and with experts the QK-norm makes a Qwen3-MoE, the biases none."""
    from dataclasses import replace

    from shardwise.checkpoint.hf import write_safetensors
    from shardwise.models.hf import LLAMA, MIXTRAL, QWEN3_MOE, to_hf_tensors
    from shardwise.models.llama import Llama, LlamaConfig, describe

    cfg = LlamaConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_kv_heads=2,
                      n_embd=32, ffn_hidden=24, rope_theta=1e6, tie_weights="qkv_bias" in options,
                      sliding_window=4, layer_types=("full_attention", "sliding_attention"),
                      **options)
    d = describe(cfg)
    plain = replace(cfg, sliding_window=None, layer_types=None)
    assert d.hf.architecture == arch and describe(replace(plain, qkv_bias=False, qk_norm=False,
                                                          head_dim=8)).hf is LLAMA
    assert describe(replace(cfg, qkv_bias=True, qk_norm=True)).hf is None
    moe = replace(plain, n_experts=4, top_k=2)
    assert describe(moe).hf is (QWEN3_MOE if cfg.qk_norm else None) and describe(
        replace(moe, qkv_bias=False, qk_norm=False)).hf is MIXTRAL
    torch.manual_seed(3)
    ours = perturb(Llama(cfg))
    tensors = {k: v.detach() for k, v in ours.state_dict().items()}
    tensors.pop("head.proj.weight") if cfg.tie_weights else None  # listed once, as the export
    write_safetensors(tmp_path, to_hf_tensors(d, tensors))
    (tmp_path / "config.json").write_text(json.dumps(d.hf.config_json(cfg, None)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == arch
    assert (theirs.config.sliding_window, theirs.config.layer_types) == (
        4, ["full_attention", "sliding_attention"])
    assert set(theirs.state_dict()) >= set(to_hf_tensors(d, tensors))
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], theirs(idx).logits, rtol=1e-5, atol=1e-5)


def _import_and_export(cfg, d, src, source: dict, idx: torch.Tensor, seq_len: int,
                       tmp_path: Path):
    """The engine in one process imports ``src`` (``model.init_from``) for description ``d``;
    its logits of ``idx`` (B, T <= seq_len), then the run saved as a checkpoint with its
    source config.json and exported (``export_hf``) to ``tmp_path/out``. Returns
    ``(logits (B, T, VOCAB), export_hf's result)``."""
    from shardwise import checkpoint
    from shardwise.apps.lm.export import export_hf
    from shardwise.base.topology import Topology
    from shardwise.engine import Engine, EngineConfig
    from shardwise.engine.state import model_tensors

    engine = Engine(d, Topology.build(1, 1, 1), EngineConfig(
        seq_len=seq_len, init_from=str(src), optimizer={"grad_clip": 0.0},
        training={"global_batch_size": 1}))
    with engine.evaluating():
        ours = engine._logits(idx)[..., :VOCAB]
    tokenizer = {"kind": "char", "chars": [chr(33 + i) for i in range(VOCAB)]}
    checkpoint.save(tmp_path / "run" / "checkpoints", 1, {"model": model_tensors(engine)},
                    {"step": 1, "config": cfg.model_dump(), "tokenizer": tokenizer,
                     "hf_config": source})
    return ours, export_hf(tmp_path / "run", tmp_path / "out")


def test_a_mistral_in_is_a_mistral_out(hf_dirs, tmp_path):
    """A Mistral (head_dim 12 where hidden / heads is 16, rope_theta 1e6, a sliding window
    of 16 tokens, fed 32) imported by the engine in one process, saved as a run's
    checkpoint with its source config.json, is exported (``export_hf``) as a
    ``MistralForCausalLM`` whose config.json keeps the model's window, the source's context
    and token ids, whose tensors are the source's bit for bit and whose logits equal the
    source's and ours. The arch comes from the source only when it holds the model
    (``export_arch``): a Qwen option makes it ``arch_for``'s; without a source a model with
    a window on every layer is a Mistral, without one a Llama, with windows on some
    layers only neither. A config.json's silences read as ``MistralConfig`` fills them
    (Mistral-7B-v0.1's window of 4096)."""
    from dataclasses import replace

    from shardwise.apps.lm.hf import check_init_from, resolve_init_from
    from shardwise.base.config import Config
    from shardwise.models.description import describe_section
    from shardwise.models.hf import LLAMA, MISTRAL, QWEN2, export_arch
    from shardwise.models.llama import describe

    src = tmp_path / "src"
    shutil.copytree(hf_dirs["mistral"], src)
    source = {**read_config(src), "sliding_window": 16, "bos_token_id": 5}
    (src / "config.json").write_text(json.dumps(source))
    cfg = resolve_init_from(Config.from_dict({"model": {"init_from": f"hf:{src}"}}))
    check_init_from(cfg, VOCAB)
    d = describe_section(cfg.model, VOCAB)
    assert (d.block_size, d.config.head_dim, d.config.rope_theta, d.config.windows) == (
        32, 12, 1e6, (16, 16))
    assert d.hf is MISTRAL and export_arch(d, None) is MISTRAL and export_arch(d, source) is MISTRAL
    assert export_arch(describe(replace(d.config, qkv_bias=True)), source) is QWEN2
    windowless = describe(replace(d.config, sliding_window=None))
    assert windowless.hf is LLAMA and export_arch(windowless, source) is MISTRAL
    some = describe(replace(d.config, layer_types=("full_attention", "sliding_attention")))
    assert some.hf is None and export_arch(some, source) is None
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(5))
    ours, done = _import_and_export(cfg, d, src, source, idx, 32, tmp_path)
    assert done.architecture == "MistralForCausalLM"
    written = read_config(tmp_path / "out")
    assert {k: written[k] for k in ("model_type", "architectures", "sliding_window",
                                    "max_position_embeddings", "head_dim", "bos_token_id",
                                    "rope_parameters")} == {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"],
        "sliding_window": 16, "max_position_embeddings": 32, "head_dim": 12,
        "bos_token_id": 5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    _exported_is_the_source(src, tmp_path / "out", "MistralForCausalLM", idx, ours)
    # Mistral-7B-v0.1's config.json leaves these out: MistralConfig's defaults, not Llama's
    silent = {k: v for k, v in source.items() if k not in (
        "sliding_window", "max_position_embeddings", "num_key_value_heads", "rope_parameters",
        "rms_norm_eps")}
    want = transformers.MistralConfig(**silent)
    got = section_of(silent)
    assert (got["block_size"], got["sliding_window"], got["n_kv_heads"], got["rope_theta"],
            got["norm_eps"]) == (
        want.max_position_embeddings, want.sliding_window, want.num_key_value_heads,
        want.rope_parameters["rope_theta"], want.rms_norm_eps)
    assert section_of({**silent, "sliding_window": None})["sliding_window"] == 0


@pytest.mark.parametrize("form", ["longrope", "older"])
def test_a_phi3_in_is_a_phi3_out(form, hf_dirs, tmp_path):
    """A Phi-3 is read as transformers reads it, in the form ``save_pretrained`` writes
    (Phi-4-mini's LongRoPE: block_size bounded by its original 32 tokens, the short factors
    and the attention factor sqrt(1 + ln 4 / ln 32) of a 4x longer context) or the older
    one of Phi-3-mini-4k's config.json (top-level ``rope_theta`` and
    ``partial_rotary_factor``, ``rope_scaling`` null, a sliding window of 16 of the 32
    tokens fed: the model's, no bound on block_size): imported by the engine in one process
    (its own slices of the packed qkv_proj / gate_up_proj), saved as a run's checkpoint,
    exported (``export_hf``) as a ``Phi3ForCausalLM`` whose tensors are the source's bit
    for bit, written packed, and whose logits equal the source's and ours (beyond 32
    tokens too, where transformers switches to the long factors the export kept); its
    config.json keeps the model's window and the source's context and token ids. Without a
    source the same model (12 of 16 features rotated, or LongRoPE) is still a Phi-3
    (``arch_for``: no other arch rotates part of a head or has LongRoPE); rotating all of a
    head with the default rotary, a Mistral with the window, a Llama without."""
    from dataclasses import replace

    from shardwise.apps.lm.hf import check_init_from, resolve_init_from
    from shardwise.base.config import Config
    from shardwise.models.description import describe_section
    from shardwise.models.hf import LLAMA, MISTRAL, PHI3, export_arch
    from shardwise.models.llama import describe

    src = tmp_path / "src"
    shutil.copytree(hf_dirs["phi3"], src)
    source = {**read_config(src), "bos_token_id": 5}
    rope = source["rope_parameters"]
    if form == "older":
        del source["rope_parameters"]
        source.update(rope_theta=250000.0, rope_scaling=None, partial_rotary_factor=0.75,
                      sliding_window=16, max_position_embeddings=32)
    (src / "config.json").write_text(json.dumps(source))
    cfg = resolve_init_from(Config.from_dict({"model": {"init_from": f"hf:{src}"}}))
    check_init_from(cfg, VOCAB)
    d = describe_section(cfg.model, VOCAB)
    T = 32  # the LongRoPE's original length; the older form's context, twice its window
    assert (d.block_size, d.config.rotary_dim) == (T, 12)
    assert bool(PHI3.bound_reason(source)) is (form == "longrope")  # the window bounds none
    assert d.config.windows == ((16, 16) if form == "older" else (None, None))
    assert d.hf.architecture == "Phi3ForCausalLM"
    if form == "older":
        assert d.config.rope_theta == 250000.0 and d.config.rope_scaling is None
        full = describe(replace(d.config, rotary_dim=None))
        assert full.hf is MISTRAL and describe(replace(full.config, sliding_window=None)).hf \
            is LLAMA
        assert export_arch(full, source).model_type == "phi3"
        some = replace(d.config, layer_types=("full_attention", "sliding_attention"))
        assert describe(some).hf is None and export_arch(describe(some), source) is None
    else:
        long = d.config.rope_scaling
        assert long.short_factor == tuple(rope["short_factor"])
        assert long.attention_factor == pytest.approx((1 + math.log(4) / math.log(32)) ** 0.5)
        whole = replace(long, short_factor=(1.0,) * 8, long_factor=(2.0,) * 8)  # D / 2 each
        assert describe(replace(d.config, rotary_dim=None, rope_scaling=whole)).hf.model_type \
            == "phi3" and not LLAMA.holds(d.config)  # LongRoPE alone makes it a Phi-3
    assert export_arch(describe(replace(d.config, qkv_bias=True)), source) is None
    # tp rank 1 of 2 reads its half of K's rows, after Q's H D = 64, from qkv_proj alone
    spec = d.hf.tensor("blocks.0.self_attn.k_proj.weight")
    assert spec.hf_shape((32, 64)) == (128, 64)
    assert spec.reads((32, 64), ((16, 16), (0, 64))) == [
        ("model.layers.0.self_attn.qkv_proj.weight", (slice(80, 96), slice(0, 64)), ())]
    idx = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    ours, done = _import_and_export(cfg, d, src, source, idx[:, :T], T, tmp_path)
    assert done.architecture == "Phi3ForCausalLM"
    written = read_config(tmp_path / "out")
    want_rope = ({"rope_type": "default", "rope_theta": 250000.0, "partial_rotary_factor": 0.75}
                 if form == "older" else {**rope, "attention_factor": long.attention_factor})
    assert {k: written[k] for k in ("model_type", "sliding_window", "max_position_embeddings",
                                    "original_max_position_embeddings", "bos_token_id",
                                    "rope_parameters", "tie_word_embeddings")} == {
        "model_type": "phi3", "sliding_window": 16 if form == "older" else None,
        "max_position_embeddings": 32 if form == "older" else 128,
        "original_max_position_embeddings": 32, "bos_token_id": 5, "tie_word_embeddings": True,
        "rope_parameters": want_rope}
    original = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(exported).__name__ == "Phi3ForCausalLM"
    assert original.config.rope_parameters["rope_theta"] == d.config.rope_theta  # read alike
    a, b = original.state_dict(), exported.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        theirs = exported(idx[:, :T]).logits
        assert torch.equal(theirs, original(idx[:, :T]).logits)
        if form == "longrope":  # past the original length: the long factors, kept
            torch.testing.assert_close(exported(idx).logits, original(idx).logits)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_llama_rotating_part_of_each_head_exports_as_a_phi3(tmp_path):
    """A Llama trained here with ``rotary_dim`` 6 of head_dim 10 (no source config.json) is
    written as a ``Phi3ForCausalLM`` (``partial_rotary_factor`` 0.6, which transformers
    truncates back to 6 features), Q/K/V and gate/up packed, whose logits equal ours;
    the other archs rotate all of a head and hold it not."""
    from shardwise.checkpoint.hf import write_safetensors
    from shardwise.models.hf import LLAMA, MIXTRAL, QWEN2, QWEN3, _rotary_factor, to_hf_tensors
    from shardwise.models.llama import Llama, LlamaConfig, describe

    cfg = LlamaConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_kv_heads=2,
                      n_embd=40, ffn_hidden=24, rotary_dim=6)
    d = describe(cfg)
    assert d.hf.architecture == "Phi3ForCausalLM"
    assert not any(a.holds(cfg) for a in (LLAMA, QWEN2, QWEN3, MIXTRAL))
    assert all(int(h * _rotary_factor(r, h)) == r for h in range(2, 257, 2)
               for r in range(2, h + 1, 2))  # 30 / 44 alone would give 29
    torch.manual_seed(3)
    ours = perturb(Llama(cfg))
    tensors = {k: v.detach() for k, v in ours.state_dict().items()}
    hf = to_hf_tensors(d, tensors)
    assert hf["model.layers.1.self_attn.qkv_proj.weight"].shape == (80, 40)  # (4 + 2 x 2) x 10
    assert torch.equal(hf["model.layers.1.mlp.gate_up_proj.weight"],
                       torch.cat([tensors["blocks.1.mlp.gate_proj.weight"],
                                  tensors["blocks.1.mlp.up_proj.weight"]]))
    write_safetensors(tmp_path, hf)
    (tmp_path / "config.json").write_text(json.dumps(d.hf.config_json(cfg, None)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == "Phi3ForCausalLM"
    assert set(theirs.state_dict()) == set(hf)
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], theirs(idx).logits, rtol=1e-5, atol=1e-5)


def test_a_routing_bias_is_checkpointed_sampled_with_and_not_exported(text, tmp_path, capsys,
                                                                     monkeypatch):
    """A 4-expert Llama trained 2 steps on one process without the routing bias, then
    resumed to step 4 with auxiliary-loss-free balancing (``model.moe_bias_update_rate``:
    the biases, absent from the checkpoint, start at zero): the checkpoint of step 4 holds
    each block's ``expert_bias`` (moved off zero) under ``buffers.``; ``shardwise
    generate``'s loader puts them back into the engine it samples with; ``shardwise
    export`` refuses it in one line (Mixtral has no such tensor, and without it the experts
    chosen would differ)."""
    from shardwise import checkpoint
    from shardwise.apps.lm.generate import generate_rank
    from shardwise.engine import state as engine_state

    run = tmp_path / "run"
    for steps, rate in (("2", "0"), ("4", "0.01")):
        assert main(["train", "--config", str(REPO / "configs" / "tiny.toml"), "--data",
                     str(text), "--model.kind", "llama", "--model.n_experts", "4",
                     "--model.moe_bias_update_rate", rate, "--parallel.dp", "1",
                     "--training.steps", steps, "--checkpoint.every", "2",
                     "--training.out_dir", str(run), "--training.sample_chars", "0",
                     "--training.progress", "false"]) == 0, capsys.readouterr().err[-3000:]
    path = checkpoint.latest_checkpoint(run / "checkpoints")
    assert checkpoint.step_of(path) == 4
    saved = checkpoint.read_tensors(path, "buffers.")
    assert sorted(saved) == ["buffers.blocks.0.mlp.expert_bias", "buffers.blocks.1.mlp.expert_bias"]
    assert sum(t.abs().sum() for t in saved.values()) > 0
    loaded = {}
    load = engine_state.load_logical_tensors

    def spy(engine, tensors):
        load(engine, tensors)
        loaded.update({f"buffers.{n}": b.clone() for n, b in engine.local.named_buffers()})

    monkeypatch.setattr(engine_state, "load_logical_tensors", spy)
    meta = checkpoint.read_meta(path)
    out = generate_rank(meta["config"], str(path), [1, 2], 4, 1.0, 1, 0)
    assert len(out) == 6
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    capsys.readouterr()
    assert_one_line_exit_2(["export", str(run), "--format", "hf", "--out", str(tmp_path / "x")],
                           capsys, "not a Mixtral's", "model.moe_bias_update_rate = 0")


def test_bad_inputs_are_one_line_exit_2(hf_dirs, text, tmp_path, capsys):
    """Before any rank starts: no config.json, another architecture, shapes that disagree
    with config.json, a contradicting [model] field, a tokenizer larger than the model's
    vocabulary; a Mixtral whose router jitters its input, or a sliding window other than
    its config.json's (a Mistral's and a Phi-3's too), or a mixture of experts asked of a
    Llama; a Qwen3-MoE or a Qwen2-MoE with no layer left to its experts
    (``decoder_sparse_step`` 3 of 2 layers, ``mlp_only_layers`` naming both); a Phi-3 with
    LongRoPE under its older name or with too few
    factors, a partial rotary factor rotating an odd number of features, or trained on more
    tokens than its LongRoPE's original length; a Llama with a partial rotary factor at
    all; a DeepSeek-V3 with linear rope scaling; an export of a run with no checkpoint; a
    Gemma with bidirectional attention, another activation, a scaled or unknown rotary, a
    null window with sliding layers, a multimodal Gemma 3 whose safetensors hold its
    language model under neither of its names (a text-only one's) or whose logits are
    soft-capped, and a Gemma 2's soft-capped scores under context parallelism."""
    train = ["train", "--config", str(REPO / "configs" / "finetune_hf.toml"), "--data",
             str(text), "--training.out_dir", str(tmp_path / "run")]

    def variant(name: str, source: str = "llama", **changes) -> Path:
        d = tmp_path / name
        shutil.copytree(hf_dirs[source], d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **changes}))
        return d

    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{empty}"], capsys,
                           "no config.json")
    other = variant("falcon", model_type=None, architectures=["FalconForCausalLM"])
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{other}"], capsys,
                           "unsupported architecture FalconForCausalLM")
    wide = variant("wide", intermediate_size=128)
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{wide}"], capsys,
                           "has shape [96, 64] in the checkpoint, config.json implies [128, 64]")
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{hf_dirs['llama']}",
                            "--model.n_layer", "3"], capsys,
                           "model.n_layer=3 contradicts model.init_from")
    small = variant("small", vocab_size=40)
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{small}"], capsys,
                           "more than the model's vocabulary of 40")
    jitter = variant("jitter", "mixtral", router_jitter_noise=0.1)
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{jitter}"], capsys,
                           "router_jitter_noise=0.1", "Mixtral cannot hold it exactly")
    window = variant("window", "mixtral", sliding_window=16)
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{window}",
                            "--model.sliding_window", "8"], capsys,
                           "model.sliding_window=8 contradicts", "gives 16)")
    # the window is the model's: a sequence longer than it is trained exactly
    assert {k: section_of(read_config(window))[k] for k in ("block_size", "sliding_window")} \
        == {"block_size": 32, "sliding_window": 16}
    mwin = variant("mwin", "mistral", sliding_window=16)  # Mistral-7B-v0.1's, in small
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{mwin}", "--model.sliding_window",
                            "0"], capsys, "model.sliding_window=0 contradicts", "gives 16)")
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{mwin}",
                            "--model.sliding_window", "0.5"], capsys,
                           "model.sliding_window: Input should be a valid integer")
    mbad = variant("mbad", "mistral", sliding_window=0)
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{mbad}"], capsys,
                           "sliding_window=0: expected a whole number >= 1 or null")
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{hf_dirs['llama']}",
                            "--model.n_experts", "4"], capsys,
                           "model.n_experts=4 contradicts", "gives 0")
    qwin = variant("qwin", "qwen2", use_sliding_window=True, sliding_window=16,
                   layer_types=["full_attention", "sliding_attention"])
    assert {k: section_of(read_config(qwin))[k] for k in ("sliding_window", "layer_types")} \
        == {"sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"]}
    off = variant("qoff", "qwen2", use_sliding_window=False, sliding_window=16,
                  layer_types=["full_attention", "sliding_attention"])
    assert transformers.AutoConfig.from_pretrained(off).sliding_window is None
    assert section_of(read_config(off))["sliding_window"] == 0  # no window unless it is used
    qbias = variant("qbias", "qwen3", attention_bias=True)
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{qbias}"], capsys,
                           "attention_bias=True", "Qwen3 cannot hold it exactly")
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{hf_dirs['qwen3']}",
                            "--model.qk_norm", "false"], capsys,
                           "model.qk_norm=False contradicts")
    linear = variant("dslinear", "deepseek_v3", rope_parameters={
        "rope_type": "linear", "factor": 4.0, "rope_theta": 1e4})
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{linear}"], capsys,
                           "rope_type='linear'", "DeepSeek-V3 cannot hold it exactly")
    for source, arch in (("qwen3moe", "Qwen3-MoE"), ("qwen2moe", "Qwen2-MoE")):
        for name, changes, what in (("step", {"decoder_sparse_step": 3}, "decoder_sparse_step=3"),
                                    ("dense", {"mlp_only_layers": [0, 1]},
                                     "mlp_only_layers=[0, 1] leave no layer with experts")):
            assert_one_line_exit_2([*train, "--model.init_from",
                                    f"hf:{variant(source + name, source, **changes)}"], capsys,
                                   what, f"{arch} cannot hold it exactly")
    # a Qwen2-MoE's window: on the even layers below max_window_layers unless layer_types
    # says otherwise, and only with use_sliding_window
    even = ["sliding_attention", "full_attention"]
    for name, changes, want in (("q2win", {}, (16, even)), ("q2low", {"max_window_layers": 0},
                                                          (0, None)),
                                ("q2off", {"use_sliding_window": False}, (0, None))):
        q2win = variant(name, "qwen2moe", **{"use_sliding_window": True, "sliding_window": 16,
                                            "layer_types": None, **changes})
        got = section_of(read_config(q2win))
        assert (got["sliding_window"], got["layer_types"]) == want, name
        assert transformers.AutoConfig.from_pretrained(q2win).layer_types == (
            want[1] or ["full_attention"] * 2), name
    # a Qwen3-MoE's window is on every layer, and only with use_sliding_window
    for use, want in ((True, 16), (False, 0)):
        qmwin = variant(f"qmwin{use}", "qwen3moe", use_sliding_window=use, sliding_window=16)
        got = section_of(read_config(qmwin))
        assert (got["sliding_window"], got["layer_types"], got["block_size"]) == (want, None, 32)
    # Phi-3: LongRoPE's older name "su", its factors not one per rotary frequency, a factor
    # rotating an odd number of features refused; LongRoPE's original length (beyond it
    # transformers takes the long factors) bounds block_size, its window is the model's;
    # partial rotary on a Llama refused
    rope = read_config(hf_dirs["phi3"])["rope_parameters"]
    for name, changes, what in (
            ("su", {"rope_parameters": None, "rope_scaling": {"type": "su"}}, "'su'"),
            ("short", {"rope_parameters": {**rope, "short_factor": [1.0] * 5}},
             "short_factor has 5 factors, expected 6"),
            ("odd", {"rope_parameters": {**rope, "partial_rotary_factor": 0.7}},
             "partial_rotary_factor=0.7: expected")):
        assert_one_line_exit_2([*train, "--model.init_from",
                                f"hf:{variant('phi' + name, 'phi3', **changes)}"], capsys, what)
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{hf_dirs['phi3']}",
                            "--model.block_size", "64"], capsys, "model.block_size=64 contradicts",
                           "gives 32 or less, its LongRoPE")
    pwin = variant("pwin", "phi3", sliding_window=16)  # Phi-3-mini-4k's 2047 of 4096, in small
    assert {k: section_of(read_config(pwin))[k] for k in ("block_size", "sliding_window")} \
        == {"block_size": 32, "sliding_window": 16}  # the window is the model's, no bound
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{pwin}",
                            "--model.sliding_window", "8"], capsys,
                           "model.sliding_window=8 contradicts", "gives 16)")
    lpart = variant("lpart", partial_rotary_factor=0.5)
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{lpart}"], capsys,
                           "partial_rotary_factor=0.5", "Llama cannot hold it exactly")
    assert_one_line_exit_2(["export", str(empty), "--format", "hf", "--out",
                            str(tmp_path / "x")], capsys, "no complete checkpoint")
    # Gemma: bidirectional attention, another activation, a scaled rotary on the sliding
    # layers, a null window with sliding layers, a multimodal Gemma 3 of text-only tensors
    # or with a logit cap; the scores' soft cap under context parallelism
    g3 = read_config(hf_dirs["gemma3"])
    for name, source, changes, what in (
            ("gbi", "gemma3", {"use_bidirectional_attention": True},
             "use_bidirectional_attention=True"),
            ("gact", "gemma", {"hidden_act": "silu"}, "hidden_act='silu'"),
            ("g2act", "gemma2", {"hidden_activation": "gelu_new"}, "hidden_activation='gelu_new'"),
            ("glocal", "gemma3", {"rope_parameters": {
                **g3["rope_parameters"], "sliding_attention": {"rope_type": "linear",
                                                               "factor": 2.0}}},
             "rope_parameters.sliding_attention.rope_type='linear'"),
            ("gyarn", "gemma3", {"rope_parameters": {
                **g3["rope_parameters"], "full_attention": {"rope_type": "yarn", "factor": 2.0}}},
             "rope_parameters.full_attention.rope_type='yarn'"),
            ("gnull", "gemma2", {"sliding_window": None}, "sliding_window=null"),
            ("gmm", "gemma3", {"model_type": "gemma3",
                               "architectures": ["Gemma3ForConditionalGeneration"],
                               "text_config": {k: v for k, v in g3.items()
                                               if k not in ("architectures", "model_type")}},
             ("model.safetensors: no Gemma3ForConditionalGeneration language model in it "
              "(no language_model.model.embed_tokens.weight or "
              "model.language_model.embed_tokens.weight)")),
            ("gmmcap", "gemma3_vlm", {"text_config": {
                **read_config(hf_dirs["gemma3_vlm"])["text_config"],
                "final_logit_softcapping": 30.0}},
             "text_config.final_logit_softcapping=30.0")):
        assert_one_line_exit_2([*train, "--model.init_from",
                                f"hf:{variant(name, source, **changes)}"], capsys, what)
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{hf_dirs['gemma2']}",
                            "--parallel.cp", "2", "--parallel.dp", "1"], capsys,
                           "model.attn_logit_softcapping=2.0 with parallel.cp=2")

def test_a_checkpoint_its_index_or_config_json_contradicts_is_one_line(text, tmp_path,
                                                                        capsys):
    """An index naming a file that lacks the tensor, and config.json sizes that are zero,
    text or fractional (a SafetensorError or a ZeroDivisionError traceback before): one
    line naming the file and what was expected, exit 2, no rank started."""
    from safetensors.torch import load_file, save_file

    src = save("llama", tmp_path / "src")
    capsys.readouterr()  # save_pretrained's progress bar
    train = ["train", "--config", str(REPO / "configs" / "finetune_hf.toml"), "--data",
             str(text), "--training.out_dir", str(tmp_path / "run"), "--parallel.dp", "1"]

    def variant(name: str, **changes) -> Path:
        d = tmp_path / name
        shutil.copytree(src, d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **changes}))
        return d

    lost = variant("lost")
    file = json.loads((lost / "model.safetensors.index.json").read_text())["weight_map"][
        "model.norm.weight"]
    tensors = load_file(lost / file)
    del tensors["model.norm.weight"]
    save_file(tensors, lost / file, metadata={"format": "pt"})
    assert_one_line_exit_2([*train, "--model.init_from", f"hf:{lost}"], capsys,
                           f"{file}: holds no tensor 'model.norm.weight', which "
                           "model.safetensors.index.json places there")
    for name, value in (("zero", 0), ("text", "4"), ("half", 2.5)):
        bad = variant(name, num_attention_heads=value)
        for argv in ([*train, "--model.init_from", f"hf:{bad}"],
                     ["plan", "--model", f"hf:{bad}", "--cluster", "dgx-h100", "--gpus", "8",
                      "--global-batch", "8"]):
            assert_one_line_exit_2(argv, capsys, f"config.json: num_attention_heads={value!r}: "
                                   "expected a whole number >= 1")
    assert not (tmp_path / "run").exists()


def test_wandb_without_the_package_is_one_line(capsys, text):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed")
    assert_one_line_exit_2(["train", "--data", str(text), "--training.wandb", "offline"],
                           capsys, "the wandb package is not installed")


@pytest.mark.slow  # the same path in-process: test_round_trip_at_dp2_tp2_pp2_is_bit_exact
def test_docs_start_from_a_hugging_face_checkpoint(text, tmp_path):
    """docs/models.md's "Start from a Hugging Face checkpoint" commands (the README's before
    it became a front door), as a user runs them (in a fresh directory holding the configs
    and examples, with my.txt): fine-tune a Llama from a checkpoint, generate at tp = 2,
    export, load with transformers."""
    page = (REPO / "docs" / "models.md").read_text()
    section = page.split("## Start from a Hugging Face checkpoint", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    assert [c.split()[0] for c in commands] == ["python", "shardwise", "shardwise", "shardwise",
                                                "python"]
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    shutil.copy(text, tmp_path / "my.txt")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO / "src"))
    outputs = []
    for command in commands:
        argv = shlex.split(command)
        argv = [sys.executable, "-m", "shardwise", *argv[1:]] if argv[0] == "shardwise" \
            else [sys.executable, *argv[1:]]
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-3000:])
        outputs.append(done.stdout)
    train = outputs[1]
    assert "shardwise: llama" in train and "dp=2" in train
    losses = [json.loads(line)["loss"] for line in
              (tmp_path / "runs" / "finetune" / "metrics.jsonl").read_text().splitlines()
              if '"train"' in line]
    assert losses[-1] < losses[0]  # it fine-tunes
    assert outputs[2].startswith("ROMEO:") and len(outputs[2].rstrip("\n")) == len("ROMEO:") + 40
    assert outputs[4].split() == ["LlamaForCausalLM", outputs[4].split()[1]]


def test_export_of_a_checkpoint_directory_honours_step(tmp_path):
    """RUN_DIR may be a checkpoint itself; --step must then be its step, not ignored."""
    from shardwise import checkpoint
    from shardwise.apps.lm.export import ExportError, find_checkpoint

    ckpt = tmp_path / "step_000100"
    ckpt.mkdir()
    (ckpt / checkpoint.META).write_text(json.dumps({"step": 100}))
    (ckpt / ".metadata").write_bytes(b"")
    assert find_checkpoint(ckpt) == ckpt and find_checkpoint(ckpt, 100) == ckpt
    with pytest.raises(ExportError, match="checkpoint of step 100, not --step 50"):
        find_checkpoint(ckpt, 50)
    # a run directory: a --step it lacks is named with the steps it has
    with pytest.raises(ExportError, match=r"no checkpoint of --step 50 .*; its steps: 100$"):
        find_checkpoint(tmp_path, 50)
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(ExportError, match="no complete checkpoint"):
        find_checkpoint(tmp_path / "empty_run")


def test_export_help_names_every_arch_it_writes(capsys):
    """``shardwise export --help`` lists every architecture export can write (all of
    ``ARCHS`` but the read-only multimodal Gemma 3)."""
    from shardwise.cli.export import main
    from shardwise.models.hf import ARCHS, GEMMA3_VLM

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    missing = [a.architecture for a in ARCHS if a is not GEMMA3_VLM
               and a.architecture not in text.replace("/ ", "/").replace(" /", "/")]
    assert not missing, missing


def test_init_from_help_names_every_arch_it_reads():
    """model.init_from's description (docs/config.md, train --help) names every
    architecture of ``models.hf.ARCHS``, which is what it reads."""
    from shardwise.base.config import config_fields
    from shardwise.models.hf import ARCHS

    text = next(f.description for f in config_fields() if f.key == "model.init_from")
    assert not [a.architecture for a in ARCHS if a.architecture not in text]


def test_the_export_of_a_bpe_run_names_its_eos_token_in_config_json(tmp_path):
    """A run on ``shardwise prepare``'s BPE (documents joined by <|endoftext|>) exports a
    config.json whose ``eos_token_id`` is the id tokenizer_config.json's ``eos_token`` has
    (it was null)."""
    from tokenizers import Tokenizer, models

    from shardwise import checkpoint
    from shardwise.apps.lm.export import export_hf
    from shardwise.base.config import Config
    from shardwise.base.topology import Topology
    from shardwise.engine import Engine, EngineConfig
    from shardwise.engine.state import model_tensors
    from shardwise.models.description import describe_section

    vocab = {"<|endoftext|>": 0, **{chr(97 + i): i + 1 for i in range(VOCAB - 1)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    state = {"kind": "hf", "json": tok.to_str(), "eos_id": 0}
    cfg = Config.load(overrides={"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 16,
                                 "model.block_size": 8})
    engine = Engine(describe_section(cfg.model, VOCAB), Topology.build(1, 1, 1), EngineConfig(
        seq_len=8, optimizer={"grad_clip": 0.0}, training={"global_batch_size": 1}))
    checkpoint.save(tmp_path / "run" / "checkpoints", 1, {"model": model_tensors(engine)},
                    {"step": 1, "config": cfg.model_dump(), "tokenizer": state})
    export_hf(tmp_path / "run", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    tokenizer_config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|endoftext|>" and config["eos_token_id"] == 0
