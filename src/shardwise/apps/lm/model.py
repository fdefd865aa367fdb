"""The language model's GPT from the ``[model]`` section, and the words for a layout."""

from __future__ import annotations

from shardwise.base.config import Config, ModelConfig
from shardwise.models import GPTConfig


def gpt_config(m: ModelConfig, vocab_size: int) -> GPTConfig:
    """The GPT of the ``[model]`` section (every field, ``attention`` included);
    ``model.vocab_size`` when set, else ``vocab_size`` (the tokenizer's)."""
    return GPTConfig(vocab_size=m.vocab_size or vocab_size, block_size=m.block_size,
                     n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout,
                     bias=m.bias, tie_weights=m.tie_weights, attention=m.attention)


def describe_layout(cfg: Config) -> str:
    """``dp=2`` / ``dp=1 x pp=2 (pipedream, m=4)`` / ``dp=2 x tp=2 (SP)``, ZeRO and precision."""
    p = cfg.parallel
    parts = [f"dp={p.dp}"]
    if p.pp > 1:
        v = f", v={p.chunks_per_rank}" if p.schedule == "interleaved" else ""
        parts.append(f"pp={p.pp} ({p.schedule}, m={p.micro_batches}{v})")
    if p.tp > 1:
        parts.append(f"tp={p.tp}" + (" (SP)" if p.sequence_parallel else ""))
    extra = (f", ZeRO-{p.zero}" if p.zero else "") + (
        f", {cfg.training.precision}" if cfg.training.precision != "fp32" else "")
    return " x ".join(parts) + extra
