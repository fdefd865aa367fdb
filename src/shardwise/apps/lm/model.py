"""The language model's GPT from the ``[model]`` section, and the words for a layout."""

from __future__ import annotations

from shardwise.base.config import Config
from shardwise.models.gpt import from_section as gpt_config  # noqa: F401 (the PS's GPT)


def describe_layout(cfg: Config) -> str:
    """``dp=2`` / ``dp=1 x pp=2 (pipedream, m=4)`` / ``dp=2 x cp=2 (ring)`` / ``dp=2 x tp=2
    (SP)`` / ``dp=4 (ep=2)``, ZeRO and precision."""
    p = cfg.parallel
    parts = [f"dp={p.dp}"]
    if p.pp > 1:
        v = f", v={p.chunks_per_rank}" if p.schedule == "interleaved" else ""
        parts.append(f"pp={p.pp} ({p.schedule}, m={p.micro_batches}{v})")
    if p.cp > 1:
        parts.append(f"cp={p.cp} (ring)")
    if p.tp > 1:
        parts.append(f"tp={p.tp}" + (" (SP)" if p.sequence_parallel else ""))
    if p.dp_replicate > 1:
        parts[0] += f" (HSDP {p.dp_replicate}x{p.dp // p.dp_replicate})"
    if p.ep > 1:
        parts[0] += f" (ep={p.ep})"
    extra = (f", ZeRO-{p.zero}" if p.zero else "") + (
        f", {cfg.training.precision}" if cfg.training.precision != "fp32" else "")
    return " x ".join(parts) + extra
