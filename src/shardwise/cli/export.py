"""``shardwise export RUN_DIR --format hf|peft --out DIR [--step N] [--merge-lora]``: a run's
checkpoint as a Hugging Face model that ``transformers``' ``from_pretrained`` loads with no
custom code, or a LoRA run's adapters as ``peft.PeftModel.from_pretrained`` loads them
(``apps.lm.export``).

Examples::

    shardwise export runs/finetune --format hf --out exported            # the newest checkpoint
    shardwise export runs/finetune --format hf --out exported --step 50  # that step's
    shardwise export runs/lora --format peft --out adapter               # LoRA adapters
    shardwise export runs/lora --format hf --merge-lora --out merged     # W + alpha / r B A
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('exported')"
"""

from __future__ import annotations

import re
import sys
from typing import Sequence

from shardwise.cli.common import EXIT_USAGE, Parser

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9 bytes, ``"40KB"``, ``"2GiB"``, ``"1000"``; ``ValueError`` otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB, 40KB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def main(argv: Sequence[str] | None = None) -> int:
    """``shardwise export``: returns 0, or 2 with one line on stderr (no checkpoint, a
    non-empty --out, a model with no Hugging Face architecture)."""
    from shardwise.models.hf.arch import all_requirements  # the options each arch fixes

    ap = Parser(prog="shardwise export",
                description="Write a run's checkpoint as a Hugging Face model: config.json, "
                "safetensors (sharded above --max-shard-size, with an index) and the tokenizer.")
    ap.add_argument("run_dir", metavar="RUN_DIR",
                    help="the run's training.out_dir (its checkpoints/), a checkpoint "
                    "directory, or one step_NNNNNN")
    ap.add_argument("--format", required=True, choices=["hf", "peft"],
                    help="peft: a LoRA run's adapters (adapter_config.json, "
                    "adapter_model.safetensors) for peft.PeftModel.from_pretrained on the "
                    "Hugging Face base; hf: transformers' LlamaForCausalLM / MistralForCausalLM / "
                    "GPT2LMHeadModel / MixtralForCausalLM / Qwen2ForCausalLM / "
                    "Qwen3ForCausalLM / Qwen2MoeForCausalLM / Qwen3MoeForCausalLM / "
                    "Phi3ForCausalLM / GemmaForCausalLM / Gemma2ForCausalLM / "
                    "Gemma3ForCausalLM / DeepseekV3ForCausalLM / DeepseekV2ForCausalLM: "
                    "the arch of the run's source checkpoint "
                    "(model.init_from) when it holds the model exactly (a Mistral in is a "
                    "Mistral out, a Phi-3 a Phi-3; a Gemma3ForConditionalGeneration's "
                    "language model a text-only Gemma3ForCausalLM, without the vision "
                    "tower), else the arch the model is exactly: with experts a Mixtral, a "
                    "Qwen3-MoE or, with a gated shared expert, a Qwen2-MoE, with a "
                    "rotary_dim below head_dim a Phi-3, with one sliding window on every "
                    "layer a Mistral, with mlp_activation = gelu_tanh a Gemma, with latent "
                    "attention (kv_lora_rank) and experts a DeepSeek-V3 (sigmoid gating) or "
                    "V2 (softmax), with none of these a Llama, each with the options it "
                    f"fixes ({all_requirements()})")
    ap.add_argument("--merge-lora", action="store_true",
                    help="with --format hf, a LoRA run: each adapted weight merged, "
                    "W + alpha / r B A, over the run's base")
    ap.add_argument("--out", required=True, metavar="DIR", help="an empty or new directory")
    ap.add_argument("--step", type=int, metavar="N", help="the checkpoint of step N "
                    "(default: the newest)")
    ap.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                    help="largest safetensors file before sharding (default 5GB, as "
                    "transformers)")
    args = ap.parse_args(argv)
    from shardwise.apps.lm.export import export_hf, export_peft

    if args.merge_lora and args.format != "hf":
        print("shardwise export: error: --merge-lora writes a Hugging Face model: use it with "
              "--format hf", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.format == "peft":
            done = export_peft(args.run_dir, args.out, args.step)
        else:
            done = export_hf(args.run_dir, args.out, args.step,
                             parse_size(args.max_shard_size), merge_lora=args.merge_lora)
    except ValueError as e:  # ExportError, CheckpointError, ConfigError: one line each
        print(f"shardwise export: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    shards = [f for f in done.files if f.endswith(".safetensors")]
    files = [f for f in done.files if f not in shards[1:]]
    if len(shards) > 1:
        files[files.index(shards[0])] = f"{len(shards)} safetensors shards"
    print(f"shardwise export: {done.architecture}, {done.parameters / 1e6:.2f}M parameters "
          f"from {done.source} (step {done.step}) -> {args.out}: {', '.join(files)}")
    return 0
