"""``shardwise export RUN_DIR --format hf --out DIR``: a checkpoint as a Hugging Face model.

Reads one checkpoint of a run (the newest, or ``--step N``) with the checkpoint reader
(checksums verified, metadata unpickled by the restricted unpickler, tensors by DCP with
``weights_only``): its ``model.NAME`` fp32 masters are the single-process model's
tensors whatever layout wrote them. Writes into DIR:

- ``config.json``: the model's ``transformers`` config, of the arch ``models.hf.export_arch``
  picks (the source checkpoint's when it holds the model exactly: a Mistral in is a Mistral
  out; else ``arch_for``'s), written by its ``HFArch.config_json`` over the source
  checkpoint's config.json when the run started from one, so its other fields, token ids
  and context survive; the sliding window is the model's own (``model.sliding_window``,
  ``model.layer_types``). A run that started from a multimodal checkpoint (a
  ``Gemma3ForConditionalGeneration``) trained its language model only, and is written as
  that, text only (``models.hf.text_source``: a ``Gemma3ForCausalLM`` of its
  ``text_config``); its vision tower and projector are not carried;
- ``model.safetensors``, or shards above ``max_shard_bytes`` with
  ``model.safetensors.index.json``: the tensors under ``transformers``' names and layouts
  (GPT-2's packed, transposed ``c_attn``; a tied head written once, as HF does), fp32;
- ``tokenizer.json`` and ``tokenizer_config.json``: the run's tokenizer for
  ``AutoTokenizer``: a ``shardwise prepare`` tokenizer as it is (its end-of-text token as
  ``eos_token``, and its id as config.json's ``eos_token_id`` unless the source's set one),
  the character tokenizer as a ``tokenizers`` BPE with no merges, so every character is one
  token with the run's id.

``AutoModelForCausalLM.from_pretrained(DIR)`` loads it with no custom code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from shardwise import checkpoint
from shardwise.base.config import Config
from shardwise.base.errors import CheckpointError
from shardwise.base.files import write_text
from shardwise.checkpoint.hf import CONFIG, write_safetensors
from shardwise.models.description import describe, describe_section
from shardwise.models.hf import export_arch, requirements, text_source, to_hf_tensors


class ExportError(CheckpointError):
    """Nothing to export, or nowhere to write it; one line."""


@dataclass(frozen=True)
class Exported:
    """What ``export_hf`` wrote: the checkpoint it read, the architecture, the files."""

    source: Path
    step: int
    architecture: str
    files: list[str]
    parameters: int


def find_checkpoint(run_dir: str | Path, step: int | None = None) -> Path:
    """The checkpoint of ``run_dir`` to read: ``run_dir`` itself when it is one
    (``step_NNNNNN``), else the newest complete one (or ``step``'s) under
    ``run_dir/checkpoints`` or ``run_dir``. ``ExportError`` (one line) when there is none."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ExportError(f"{run}: no such run directory")
    if (run / checkpoint.META).is_file() and (run / ".metadata").is_file():
        named = checkpoint.read_meta(run).get("step")  # the step it was saved at
        if step is not None and named is not None and named != step:
            raise ExportError(f"{run} is the checkpoint of step {named}, not --step {step}")
        return run
    steps = []  # every complete checkpoint's step, to name them when --step matches none
    for root in (run / "checkpoints", run):
        done = checkpoint.complete_checkpoints(root)
        steps += [checkpoint.step_of(d) for d in done]
        if step is not None:
            done = [d for d in done if checkpoint.step_of(d) == step]
        if done:
            return done[-1]
    if step is not None and steps:
        raise ExportError(f"{run}: no checkpoint of --step {step} in it or in "
                          f"{run / 'checkpoints'}; its steps: "
                          f"{', '.join(str(s) for s in sorted(set(steps)))}")
    raise ExportError(f"{run}: no complete checkpoint in it or in {run / 'checkpoints'} (a run "
                      "writes one at its end, or every checkpoint.every steps)")


def export_hf(run_dir: str | Path, out: str | Path, step: int | None = None,
              max_shard_bytes: int = 5 * 2**30, merge_lora: bool = False) -> Exported:
    """Write the checkpoint of ``run_dir`` (``find_checkpoint``) into ``out`` as a Hugging
    Face model (see the module docstring). ``out`` must be empty or absent. ``merge_lora``:
    the run trained LoRA adapters (``lora.rank`` > 0; its checkpoint holds those only), and
    each adapted weight is written as ``W + alpha / r B A`` over the run's base (its
    ``model.init_from``, or the model drawn from its seed). Raises ``ExportError`` /
    ``CheckpointError`` (one line) for no checkpoint, a damaged or unsafe one, a non-empty
    ``out``, a model kind with no Hugging Face architecture, or ``merge_lora`` that does not
    match the run."""
    path, meta, cfg, tok_state, d, source = _open(run_dir, out, step)
    if cfg.lora.rank and not merge_lora:
        raise ExportError(f"{path}: a LoRA run's checkpoint holds its adapters only "
                          f"(lora.rank = {cfg.lora.rank}): export them with --format peft, or "
                          "the merged model with --format hf --merge-lora")
    if merge_lora and not cfg.lora.rank:
        raise ExportError(f"--merge-lora: {path} is not a LoRA run's (lora.rank = 0); export "
                          "it with --format hf alone")
    tensors = {k.removeprefix("model."): v
               for k, v in checkpoint.read_tensors(path, "model.").items()}
    # training-state buffers the arch has a tensor for (DeepSeek-V3's routing bias)
    tensors.update({k.removeprefix("buffers."): v
                    for k, v in checkpoint.read_tensors(path, "buffers.").items()})
    if merge_lora:
        tensors = _merged(cfg, d, tensors)
    with torch.device("meta"):
        complete = describe(d.hf.complete(d.config)).build()
    hf_tensors = to_hf_tensors(d, tensors, complete)
    config_json = d.hf.config_json(d.config, source)
    if config_json.get("eos_token_id") is None and tok_state.get("eos_id") is not None:
        config_json["eos_token_id"] = int(tok_state["eos_id"])  # tokenizer_config's eos_token

    def write(out: Path) -> list[str]:
        files = write_safetensors(out, hf_tensors, max_shard_bytes)
        _write_json(out / CONFIG, config_json)
        return [CONFIG] + files + _write_tokenizer(out, tok_state, d.block_size)

    files = _write_all(Path(out), write)
    return Exported(path, int(meta.get("step", 0)), d.hf.architecture, files,
                    sum(t.numel() for t in hf_tensors.values()))


def export_peft(run_dir: str | Path, out: str | Path, step: int | None = None) -> Exported:
    """Write the LoRA adapters of the checkpoint of ``run_dir`` into ``out`` as PEFT's
    ``PeftModel.from_pretrained`` reads them onto the Hugging Face base (the run's
    ``model.init_from``, or the model ``--format hf`` writes): ``adapter_config.json``
    (``peft_type`` LORA, ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules`` a regular
    expression naming exactly the adapted modules) and ``adapter_model.safetensors``
    (``base_model.model.<HF module>.lora_A.weight`` (r, in) and ``.lora_B.weight`` (out, r),
    fp32; PEFT's ``save_pretrained`` names). ``ExportError`` (one line) for a run without
    LoRA, or an adapted layer that the architecture packs or transposes (GPT-2's Conv1D,
    Phi-3's qkv_proj), which PEFT cannot adapt as one ``nn.Linear``."""
    import re

    from safetensors.torch import save_file

    path, meta, cfg, tok_state, d, source = _open(run_dir, out, step)
    lora = cfg.lora
    if not lora.rank:
        raise ExportError(f"--format peft: {path} is not a LoRA run's (lora.rank = 0); "
                          "export it with --format hf")
    tensors, modules = {}, []
    for name, t in sorted(checkpoint.read_tensors(path, "model.").items()):
        module, _, which = name.removeprefix("model.").rpartition(".")  # ..., lora_A
        spec = d.hf.tensor(f"{module}.weight")
        if spec.transpose or spec.part is not None or spec.stacked:
            raise ExportError(f"--format peft: {module} is {spec.name}, packed or transposed "
                              f"in {d.hf.architecture}, which PEFT cannot adapt as one "
                              "nn.Linear; train adapters on other layers (lora.targets), or "
                              "export with --format hf --merge-lora")
        hf_module = spec.name.removesuffix(".weight")
        tensors[f"base_model.model.{hf_module}.{which}.weight"] = t.float().contiguous()
        modules.append(hf_module)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
              "target_modules": "|".join(re.escape(m) for m in sorted(set(modules))),
              "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
              "modules_to_save": None, "use_rslora": False, "use_dora": False,
              "base_model_name_or_path": cfg.model.init_from.removeprefix("hf:") or None}

    def write(out: Path) -> list[str]:
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        _write_json(out / "adapter_config.json", config)
        return ["adapter_config.json", "adapter_model.safetensors"]

    files = _write_all(Path(out), write)
    return Exported(path, int(meta.get("step", 0)), f"PEFT LoRA for {d.hf.architecture}",
                    files, sum(t.numel() for t in tensors.values()))


@torch.no_grad()
def _merged(cfg: Config, d, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's tensors (single-process names; the run's ``model.init_from``, or drawn
    from its ``training.seed`` as the engine does) with each adapted weight merged:
    ``W + (alpha / r) B A``."""
    from shardwise.engine.model import build_local_model
    from shardwise.parallel.tensor_parallel.group import RankGroup

    local = build_local_model(d, pp=1, pp_rank=0, chunk_ids=[0], n_chunks=1, tp=RankGroup(),
                              seed=cfg.training.seed, dropout_seed=0,
                              device=torch.device("cpu"),
                              init_from=cfg.model.init_from.removeprefix("hf:") or None)
    tensors = {n: p.detach() for n, p in local.named_parameters()}
    scaling = cfg.lora.alpha / cfg.lora.rank
    for name, a in adapters.items():
        if name.endswith(".lora_A"):
            module = name.removesuffix(".lora_A")
            w = tensors[f"{module}.weight"]
            w += scaling * (adapters[f"{module}.lora_B"].to(w.dtype) @ a.to(w.dtype))
        elif not name.endswith(".lora_B"):
            tensors[name] = adapters[name]  # a training-state buffer
    return tensors


def _open(run_dir, out, step):
    """``(checkpoint, meta, config, tokenizer state, description with its export arch, the
    source config.json)`` of the run's checkpoint; ``out`` checked empty."""
    path = find_checkpoint(run_dir, step)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out}: exists and is not an empty directory")
    meta = checkpoint.read_meta(path)
    if "config" not in meta or "tokenizer" not in meta:
        raise ExportError(f"{path}: not a language model's checkpoint (no config or tokenizer)")
    cfg = Config.from_dict(meta["config"])
    tok_state = meta["tokenizer"]
    d = describe_section(cfg.model, _vocab_size(tok_state))
    # model.init_from's config.json, if the run had one (a multimodal one's language model)
    source = text_source(meta.get("hf_config"))
    d = replace(d, hf=export_arch(d, source))
    if d.hf is None and d.kind == "llama" and d.n_experts:
        raise ExportError(f"{path}: this Llama's mixture of experts is not a Mixtral's, a "
                          "Qwen2-MoE's or a Qwen3-MoE's, the only ones exported (softmax "
                          "gating, dropless, no routing bias: model.moe_bias_update_rate = 0; "
                          "Mixtral: moe_norm_topk, no shared expert, "
                          f"{requirements('Mixtral')}; Qwen2-MoE: a shared expert with "
                          f"moe_shared_expert_gate, {requirements('Qwen2-MoE')}; Qwen3-MoE: "
                          f"no shared expert, {requirements('Qwen3-MoE')}; or with MLA, "
                          "model.kv_lora_rank, a DeepSeek-V3's or V2's: docs/models.md)")
    if d.hf is None and d.kind == "llama" and _has_gemma_options(d.config):
        raise ExportError(f"{path}: this Llama's Gemma options are not a Gemma's, a Gemma "
                          "2's or a Gemma 3's, the only ones exported (each: "
                          "mlp_activation = gelu_tanh, no experts; Gemma: "
                          f"{requirements('Gemma')}, query_pre_attn_scalar unset or head_dim, "
                          "no window; "
                          f"Gemma 2: {requirements('Gemma2')}; Gemma 3: "
                          f"{requirements('Gemma3')})")
    if d.hf is None:
        raise ExportError(f"{path}: model.kind={d.kind!r} has no Hugging Face architecture "
                          "(ModelDescription.hf)")
    return path, meta, cfg, tok_state, d, source


def _write_all(out: Path, write) -> list[str]:
    """``write(out)`` (the file names it wrote) into ``out``, made if absent; on any error
    nothing of it is left there."""
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # read-only, a file on the way, no permission
        raise ExportError(f"--out {out}: cannot create it ({e.strerror or e})") from None
    try:
        return write(out)
    except BaseException as e:  # no half-written model: --out was empty, so is it again
        for f in out.iterdir():
            if f.is_file():
                f.unlink()
        if created:
            out.rmdir()
        if isinstance(e, OSError):
            raise ExportError(f"--out {out}: cannot write the model ({e.strerror or e}); "
                              "nothing of it is left there") from None
        raise


def _has_gemma_options(cfg) -> bool:
    from shardwise.models.hf import _no_gemma

    return not _no_gemma(cfg)


def _vocab_size(tok_state: dict) -> int:
    from shardwise.data.tokenizer import tokenizer_from_state

    return tokenizer_from_state(tok_state).vocab_size


def _write_json(path: Path, obj: dict) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(out: Path, state: dict, max_length: int) -> list[str]:
    """``tokenizer.json`` + ``tokenizer_config.json`` for the run's tokenizer; the file names.
    The character tokenizer becomes a ``tokenizers`` BPE over its characters with no merges
    (each character one token, the run's ids) and a decoder that joins them; a tokenizer
    that carries its own ``tokenizer.json`` (``state["json"]``) is written as it is."""
    if state.get("kind") == "char":
        from tokenizers import Tokenizer, decoders, models

        vocab = {c: i for i, c in enumerate(state["chars"])}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
        tok.decoder = decoders.Fuse()
        text = tok.to_str()
    elif isinstance(state.get("json"), str):  # shardwise prepare's: a tokenizer.json
        text = state["json"]
    else:
        return []
    write_text(out / "tokenizer.json", text)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    if state.get("eos_id") is not None:  # documents were joined by it: HF's eos token
        from tokenizers import Tokenizer

        eos = Tokenizer.from_str(text).id_to_token(int(state["eos_id"]))
        if eos is not None:
            config["eos_token"] = eos
    _write_json(out / "tokenizer_config.json", config)
    return ["tokenizer.json", "tokenizer_config.json"]
