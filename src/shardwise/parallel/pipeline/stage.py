"""A pipeline chunk: a contiguous run of the GPT's layers, keeping the GPT's parameter names.

Every rank builds the full GPT from the same seed, then keeps only its chunks' layers, so
the weights are those one process would start from (parity by construction).

Tied embeddings: the LM head is tied to the token embedding by default, and with pp > 1 the
two sit on different stages. The engine handles that (``engine.model.build_local_model``):
the last stage's head gets its own copy, equal at start, and the engine sums the two copies'
gradients between the first and the last stage before every step (Megatron's embedding
group), so pipeline parallelism trains a tied GPT exactly. ``gpt_chunks`` here is the bare
cutter (for references and benchmarks): it makes no such copy, so it refuses a tied GPT cut
into more than one part (a one-line ``ValueError``).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.parallel.pipeline.partition import Partition, gpt_layers


class StageChunk(nn.Module):
    """Layers ``[(name, module), ...]`` applied in order. First chunk: (B, T) int64 token ids
    -> (B, T, C); middle: (B, T, C) -> (B, T, C); last: -> (B, T, V) logits."""

    def __init__(self, named_layers: Sequence[tuple[str, nn.Module]]):
        super().__init__()
        self.names = [n for n, _ in named_layers]
        self.layers = nn.ModuleList(m for _, m in named_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the chunk's layers in order (its input activations to its output)."""
        for layer in self.layers:
            x = layer(x)
        return x

    def model_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name in the full GPT, parameter)`` for this chunk's parameters."""
        for name, layer in zip(self.names, self.layers):
            for pname, p in layer.named_parameters():
                yield f"{name}.{pname}", p


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in nats per token, exactly as ``GPT.forward``. (B, T, V), (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_chunks(model: nn.Module, partition: Partition, chunk_ids: Sequence[int]) -> dict[int, StageChunk]:
    """Chunks ``chunk_ids`` of ``model`` (a shardwise GPT) cut by ``partition`` over its
    ``n_layer + 2`` layers. Raises ``ValueError`` for a tied GPT cut into more than one part
    (the engine's ``build_local_model`` unties it across stages; this cutter does not)."""
    layers = gpt_layers(model)
    if partition.bounds[-1] != len(layers):
        raise ValueError(f"partition covers {partition.bounds[-1]} layers, the GPT has {len(layers)}")
    if partition.parts > 1 and getattr(model.cfg, "tie_weights", False):
        raise ValueError("gpt_chunks cannot cut a tied GPT into parts (the embedding and head "
                         "share one parameter); use model.tie_weights = false here, or the "
                         "engine, which keeps a copy per stage and sums their gradients")
    return {c: StageChunk([layers[i] for i in partition.layers(c)]) for c in chunk_ids}
