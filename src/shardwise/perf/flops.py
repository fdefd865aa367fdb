"""Training FLOPs per token of the GPT, the numerator of MFU.

Chowdhery et al. 2022 (PaLM), appendix B: a decoder-only transformer trained on sequences of
``T`` tokens spends, per token,

    6 N + 12 L H Q T   FLOPs

where ``N`` is the number of parameters that take part in matrix products (2 FLOPs per
multiply-add in forward, twice that in backward: 6 per parameter), ``L`` the layers, and
``H Q = C`` the attention width: ``Q K^T`` and ``softmax(.) V`` are ``2 T C`` multiply-adds per
token and layer in forward, three times that with backward. The same count as Narayanan et al.
2021 (equation 3) without their vocabulary term, which ``N`` here already holds (the LM head).
This is *model* FLOPs: recomputed activations are not counted (MFU, not hardware FLOPs
utilisation), and the causal mask's skipped half of the scores is counted, as PaLM does.
"""

from __future__ import annotations


def matmul_parameters(cfg) -> int:
    """``N``: parameters of the blocks' linear layers and norms and of the LM head (V x C),
    not the position embedding (a lookup) nor, when untied, the token embedding (a lookup;
    the head's own weight is counted). ``cfg``: a ``GPTConfig`` or ``config.ModelConfig``
    with ``vocab_size`` set."""
    c, L, v = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    b = 1 if cfg.bias else 0
    attn = 4 * c * c + b * 3 * c  # q, k, v, out weights; biases of q, v, out (k has none)
    mlp = 8 * c * c + b * 5 * c  # fc (C -> 4C) and proj (4C -> C) with their biases
    norms = 2 * (c + b * c)
    head = v * c + (c + b * c)  # projection and the final LayerNorm
    return L * (attn + mlp + norms) + head


def flops_per_token(cfg, seq_len: int | None = None) -> float:
    """Training FLOPs (forward + backward) per token: ``6 N + 12 L C T`` (see module
    docstring). ``seq_len``: ``T``, default ``cfg.block_size``."""
    t = cfg.block_size if seq_len is None else seq_len
    return 6.0 * matmul_parameters(cfg) + 12.0 * cfg.n_layer * cfg.n_embd * t
