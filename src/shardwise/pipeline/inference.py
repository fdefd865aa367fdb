"""Forward-only passes through a pipeline: validation loss and text generation.

Training runs a schedule; evaluation and sampling need only the forward of each chunk in
order, so chunk ``c`` (on pipeline rank ``c % p``) receives its input from the owner of chunk
``c - 1`` with a blocking ``comm.recv``, runs, and sends to the owner of ``c + 1``. One
micro-batch in flight: the naive model parallelism of seed 000, which is all inference
at these sizes needs.
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.models.gpt import sample_next
from shardwise.pipeline.stage import lm_loss


def _last_owner(runner) -> int:
    """Pipeline rank (index in the pp group) holding the last chunk (the head)."""
    p = runner.topology.pp
    return (p * runner.cfg.chunks_per_rank - 1) % p


@torch.no_grad()
def pipeline_logits(runner, idx: torch.Tensor, n_embd: int) -> torch.Tensor | None:
    """Logits (B, T, V) of ``idx`` (B, T) int64 on the rank holding the head; None on the
    others. Every rank of the pipeline must call it with the same ``idx`` shape."""
    p, me, ranks = runner.topology.pp, runner.pp_rank, runner.pp_ranks
    group = runner.groups.pp if runner.groups is not None else None
    n = p * runner.cfg.chunks_per_rank
    B, T = idx.shape
    x = None
    for c in range(n):
        if c % p != me:
            continue
        if c == 0:
            x = idx
        elif (c - 1) % p != me:
            x = torch.empty(B, T, n_embd, device=idx.device)
            comm.recv(x, src=ranks[(c - 1) % p], group=group)
        x = runner.chunks[c](x)
        if c < n - 1 and (c + 1) % p != me:
            comm.send(x.contiguous(), dst=ranks[(c + 1) % p], group=group)
    return x if me == _last_owner(runner) else None


@torch.no_grad()
def pipeline_loss(runner, idx: torch.Tensor, targets: torch.Tensor, n_embd: int) -> float:
    """Mean cross-entropy (nats per token) of one batch, returned on every pipeline rank."""
    logits = pipeline_logits(runner, idx, n_embd)
    loss = torch.zeros(1, dtype=torch.float64)
    if logits is not None:
        loss[0] = lm_loss(logits, targets).item()
    if runner.topology.pp > 1:
        comm.broadcast(loss, src=runner.pp_ranks[_last_owner(runner)], group=runner.groups.pp)
    return float(loss)


@torch.no_grad()
def pipeline_generate(runner, idx: torch.Tensor, new_tokens: int, block_size: int, n_embd: int,
                      generator: torch.Generator | None = None, **sampling) -> torch.Tensor:
    """``GPT.generate`` through the pipeline: (B, T0) -> (B, T0 + new_tokens) on every rank.
    The rank holding the head samples (with ``generator``) and broadcasts each token."""
    owner = runner.pp_ranks[_last_owner(runner)]
    for chunk in runner.chunks.values():
        chunk.eval()
    for _ in range(new_tokens):
        logits = pipeline_logits(runner, idx[:, -block_size:], n_embd)
        nxt = torch.zeros(idx.shape[0], 1, dtype=torch.long, device=idx.device)
        if logits is not None:
            nxt = sample_next(logits[:, -1, :], generator=generator, **sampling)
        if runner.topology.pp > 1:
            comm.broadcast(nxt, src=owner, group=runner.groups.pp)
        idx = torch.cat([idx, nxt], dim=1)
    for chunk in runner.chunks.values():
        chunk.train()
    return idx
