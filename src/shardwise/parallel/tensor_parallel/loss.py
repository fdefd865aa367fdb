"""Cross-entropy over logits split by vocabulary, without ever gathering them.

Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053, section 3: "fuse the output of the
parallel GEMM with the cross-entropy loss, which reduces the dimension to b x s"). Each
rank holds logits for its slice of the vocabulary, (N_tokens, V / tp). Per token:

    m      = max over ranks of the local max                   (all-reduce "max", N floats)
    sum_e  = sum over ranks of sum_j exp(z_j - m)              \\ one all-reduce "sum"
    z_t    = the target's logit, from the rank that holds it   /  of 2 x N floats
    loss   = log(sum_e) - (z_t - m)

so 3 N floats cross ranks instead of N x V. The backward is local: softmax minus the
one-hot of the target, on this rank's columns only.
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.data.sampler import IGNORE_INDEX
from shardwise.parallel.tensor_parallel.group import RankGroup
from shardwise.parallel.tensor_parallel.mappings import _mark, _note


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, tp, vocab_size, tag):
        n_local = logits.shape[-1]
        start = tp.rank * n_local
        real = max(0, min(n_local, vocab_size - start))  # columns that are real vocabulary
        z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        if real < n_local:  # padding of a vocabulary not divisible by tp: never a candidate
            z = z.clone()
            z[:, real:] = float("-inf")
        m = z.max(dim=-1).values.clone()                             # (N,)
        if tp.size > 1:
            mark = _mark()
            comm.all_reduce(m, op="max", group=tp.group, algorithm=tp.all_reduce,
                            check=tp.check)
            _note(tag, "forward", mark, "all_reduce", m.numel() * m.element_size())
        e = (z - m.unsqueeze(-1)).exp()                               # (N, V / tp)
        inside = (targets >= start) & (targets < start + n_local)
        local_t = (targets - start).masked_fill(~inside, 0)
        zt = torch.where(inside, z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) - m, 0.0)
        stats = torch.stack([e.sum(dim=-1), zt])                      # (2, N)
        if tp.size > 1:
            mark = _mark()
            comm.all_reduce(stats, group=tp.group, algorithm=tp.all_reduce, check=tp.check)
            _note(tag, "forward", mark, "all_reduce", stats.numel() * stats.element_size())
        loss = stats[0].log() - stats[1]                              # (N,)
        e.div_(stats[0].unsqueeze(-1))                                # softmax, local columns
        ctx.save_for_backward(e, local_t, inside)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, inside = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= inside.to(grad.dtype)
        grad.mul_(g.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None


@torch.compiler.disable  # its all-reduces run eagerly inside a compiled loss
def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: RankGroup,
                                 vocab_size: int | None = None, reduction: str = "mean",
                                 tag: str = "cross_entropy",
                                 denominator: float | None = None) -> torch.Tensor:
    """Cross-entropy in nats of ``logits`` (..., V_pad / tp), this rank's vocabulary
    columns ``[rank * V_pad / tp, (rank + 1) * V_pad / tp)``, against ``targets`` (...)
    holding global ids < ``vocab_size``.

    ``vocab_size`` (default: all columns are real) marks columns at or above it as padding:
    they are excluded from the softmax, so padding never changes the loss or the gradients
    of real columns. ``reduction``: "mean" (over tokens), "sum" or "none" (shape of
    ``targets``). Targets ``IGNORE_INDEX`` (-100, a loss mask) count 0. "mean" divides the
    sum by ``denominator`` (default ``targets.numel()``; the engine gives the global batch's
    target count per micro-batch and rank). Equals ``F.cross_entropy(reduction="sum") /
    denominator`` on the gathered, unpadded logits (with no mask, the plain mean).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    v = logits.shape[-1] * tp.size if vocab_size is None else vocab_size
    loss = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]),
                                            targets.reshape(-1), tp, v, tag)
    loss = torch.where(targets.reshape(-1) != IGNORE_INDEX, loss, 0.0)
    if reduction == "mean":  # sum / numel: bit for bit loss.mean() (measured, CPU fp32)
        return loss.sum() / float(targets.numel() if denominator is None else denominator)
    return loss.sum() if reduction == "sum" else loss.view(targets.shape)
