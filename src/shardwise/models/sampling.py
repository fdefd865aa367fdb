"""Autoregressive sampling from any model's logits: temperature, top-k, multinomial.

Shared by the single-process models (``GPT.generate``, ``Llama.generate``) and the
engine's generation in any layout (``engine.Engine.generate``), so both draw the same ids
from the same generator state.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@torch.no_grad()
def generate(logits_of: Callable[[torch.Tensor], torch.Tensor | None], idx: torch.Tensor,
             new_tokens: int, block_size: int, *, pad_to: int = 1,
             share: Callable[[torch.Tensor], None] | None = None, temperature: float = 0.8,
             top_k: int | None = 20, generator: torch.Generator | None = None) -> torch.Tensor:
    """Autoregressive sampling: ``idx`` (B, T0) int64 -> (B, T0 + new_tokens).

    Each step feeds the last ``block_size`` ids, right-padded with id 0 to a multiple of
    ``pad_to`` (sequence parallelism splits the sequence; causal attention keeps the pads
    from reaching the position read), to ``logits_of``, which returns the logits
    (B, T, V) or None on a rank that does not sample (a pipeline stage before the last);
    ``sample_next`` draws from the last real position. ``share(next_ids)`` (B, 1), if
    given, makes every rank agree in place (a broadcast from the sampling rank). Used by
    ``GPT.generate`` and ``engine.Engine.generate``: the same ids for the same
    ``generator`` state whatever the layout."""
    for _ in range(new_tokens):
        ctx = idx[:, -block_size:]
        t = ctx.shape[1]
        if t % pad_to:
            ctx = torch.cat([ctx, ctx.new_zeros(ctx.shape[0], pad_to - t % pad_to)], dim=1)
        logits = logits_of(ctx)
        if logits is None:
            nxt = torch.zeros(idx.shape[0], 1, dtype=torch.long, device=idx.device)
        else:
            nxt = sample_next(logits[:, t - 1, :], temperature, top_k, generator)
        if share is not None:
            share(nxt)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def sample_next(logits: torch.Tensor, temperature: float = 0.8, top_k: int | None = 20,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from last-position ``logits`` (B, V): temperature, then top-k, then
    a multinomial draw. Returns (B, 1) int64."""
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)


class DecoderLM(nn.Module):
    """What the single-process GPT and Llama share: ``embed -> blocks -> head`` (subclasses
    set ``cfg`` with ``block_size``, and the three parts), the fp32 loss and sampling.

    ``forward(idx (B, T) int64, targets (B, T) | None)`` returns ``(logits (B, T, V),
    loss)``, ``loss`` the mean cross-entropy in nats per token computed in fp32 (None
    without targets). Raises ``ValueError`` if ``T > cfg.block_size``."""

    def num_parameters(self) -> int:
        """Parameters, a tied matrix counted once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Token ids ``(B, T)`` -> ``(logits (B, T, vocab), loss)``; the loss (cross-entropy in fp32
        against ``targets`` ``(B, T)``) is None without targets. Raises ValueError when T exceeds
        ``block_size``."""
        if idx.shape[1] > self.cfg.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds block_size "
                             f"{self.cfg.block_size}")
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits, None
        # the loss in fp32 even when the model computes in bf16/fp16 (mixed precision)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 20, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``new_tokens`` ids after ``idx`` (B, T0); returns (B, T0 + new_tokens)
        (``generate`` with this model's logits; no KV cache)."""
        was_training = self.training
        self.eval()
        idx = generate(lambda ctx: self(ctx)[0], idx, new_tokens, self.cfg.block_size,
                       temperature=temperature, top_k=top_k, generator=generator)
        self.train(was_training)
        return idx
