"""A small Hugging Face checkpoint with random weights, written as ``save_pretrained`` writes
a real one: the stand-in for a downloaded model where no hub is reachable.

    python examples/hf_checkpoint.py runs/hf-llama                # LlamaForCausalLM, ~0.3M
    python examples/hf_checkpoint.py runs/hf-gpt2 --arch gpt2     # GPT2LMHeadModel
    python examples/hf_checkpoint.py DIR --max-shard-size 200KB   # several safetensors + index

With a hub, ``hf download meta-llama/Llama-3.2-1B --local-dir DIR`` (or any
``LlamaForCausalLM`` / ``GPT2LMHeadModel`` repository) gives the same layout: config.json and
*.safetensors. Then ``shardwise train --config configs/finetune_hf.toml --model.init_from
hf:DIR --data my.txt`` (README: "Start from a Hugging Face checkpoint").

The vocabulary (256 ids) is larger than a character tokenizer's: the tokenizer may be
smaller than the model's vocabulary, never larger.
"""

from __future__ import annotations

import argparse

import torch
import transformers


def build(arch: str) -> transformers.PreTrainedModel:
    """A randomly initialised ``LlamaForCausalLM`` (grouped-query attention, untied head) or
    ``GPT2LMHeadModel`` (tied head), fp32, from ``torch.manual_seed(0)``."""
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=256, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(cfg).float()
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=96, n_layer=2, n_head=4,
                                  n_positions=128, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="directory to write (config.json, *.safetensors)")
    ap.add_argument("--arch", choices=["llama", "gpt2"], default="llama")
    ap.add_argument("--max-shard-size", default="5GB",
                    help="save_pretrained's shard size (default 5GB: one file)")
    args = ap.parse_args()
    model = build(args.arch)
    model.save_pretrained(args.out, max_shard_size=args.max_shard_size)
    n = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__}, {n / 1e6:.2f}M parameters (random) -> {args.out}")


if __name__ == "__main__":
    main()
