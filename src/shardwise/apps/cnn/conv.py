"""Convolutions split across the ranks of a group: by filters, by input channels, by rows.

Each is built from the full ``nn.Conv2d`` (``master``: same seed on every rank) and keeps
its parameter names (``weight``, ``bias``); sharded ones carry ``tp_dim``. Their
communication is ``shardwise.apps.cnn.conv_mappings``'s (sources there). Shapes for a
(B, C_in, H, W) input and C_out filters, N ranks:

================  =====================  ==========================  =====================
layer             weight on a rank       input                       output
================  =====================  ==========================  =====================
FilterConv2d      (C_out/N, C_in, k, k)  full, or batch (B/N, ...)   (B, C_out/N, H, W)
ChannelConv2d     (C_out, C_in/N, k, k)  (B, C_in/N, H, W)           full, or batch
SpatialConv2d     (C_out, C_in, k, k)    (B, C_in, H/N, W)           (B, C_out, H/N s, W/s)
================  =====================  ==========================  =====================
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.apps.cnn.conv_mappings import halo_exchange
from shardwise.apps.cnn.layout import BATCH
from shardwise.parallel.tensor_parallel import (
    RankGroup,
    copy_to_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    shard_tensor,
)


def _param(t: torch.Tensor, dim: int | None = None) -> nn.Parameter:
    p = nn.Parameter(t.detach().clone())
    if dim is not None:
        p.tp_dim = dim  # a sharded parameter (norms, gathering, checkpoints)
    return p


class _Conv(nn.Module):
    def __init__(self, master: nn.Conv2d, group: RankGroup, tag: str):
        super().__init__()
        self.group, self.tag = group, tag
        self.stride, self.padding = master.stride, master.padding

    def conv(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.conv2d(x, self.weight, bias, self.stride, self.padding)


class FilterConv2d(_Conv):
    """This rank's C_out/N filters of ``master``; the input is whole on every rank (from the
    batch layout: all-gathered forward, its gradient reduce-scattered backward; from full:
    its gradient all-reduced backward); the maps leave channel-split."""

    def __init__(self, master: nn.Conv2d, group: RankGroup, layout_in: str, tag: str = ""):
        super().__init__(master, group, tag)
        self.layout_in = layout_in
        self.weight = _param(shard_tensor(master.weight, 0, group), 0)
        self.bias = _param(shard_tensor(master.bias, 0, group), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout_in == BATCH:
            x = gather_from_sequence(x, self.group, dim=0, tag=self.tag)   # (B, C_in, H, W)
        else:
            x = copy_to_region(x, self.group, tag=self.tag)
        return self.conv(x, self.bias)                                     # (B, C_out/N, H, W)


class ChannelConv2d(_Conv):
    """Every filter's slice over this rank's C_in/N input channels; the partial maps summed
    over the ranks (to full: all-reduce forward; to batch: reduce-scatter along the batch
    forward, all-gather backward), then the bias (replicated; in the batch layout its
    gradient is a partial sum over the ranks)."""

    def __init__(self, master: nn.Conv2d, group: RankGroup, layout_out: str, tag: str = ""):
        super().__init__(master, group, tag)
        self.layout_out = layout_out
        self.weight = _param(shard_tensor(master.weight, 1, group), 1)
        self.bias = _param(master.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.conv(x)                                             # (B, C_out, H, W)
        if self.layout_out == BATCH:
            y = reduce_scatter_to_sequence(partial, self.group, dim=0, tag=self.tag)
        else:
            y = reduce_from_region(partial, self.group, tag=self.tag)
        return y + self.bias.view(1, -1, 1, 1)


def spatial_halo(kernel: int, stride: int, padding: int) -> tuple[int, int]:
    """Rows a band needs from above and below: ``padding`` and ``kernel - stride - padding``
    (for the output height H / stride that same padding gives)."""
    return padding, kernel - stride - padding


class SpatialConv2d(_Conv):
    """``master`` whole on every rank, applied to this rank's band of H/N rows after the halo
    exchange; the weights' gradients are partial sums over the ranks (summed as data
    parallelism's). Needs an odd kernel with padding k // 2 and H/N divisible by the stride
    (ValueError otherwise, one line)."""

    def __init__(self, master: nn.Conv2d, group: RankGroup, tag: str = ""):
        super().__init__(master, group, tag)
        k, s, p = master.kernel_size[0], master.stride[0], master.padding[0]
        if master.kernel_size[0] != master.kernel_size[1] or k % 2 == 0 or p != k // 2:
            raise ValueError(f"{tag}=spatial: needs a square odd kernel with padding k // 2, "
                             f"got kernel {master.kernel_size}, padding {master.padding}")
        self.halo = spatial_halo(k, s, p)
        self.padding = (0, master.padding[1])     # rows come from the halo, columns padded
        self.weight = _param(master.weight)
        self.bias = _param(master.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[2] % self.stride[0]:
            raise ValueError(f"{self.tag}=spatial: a band of {x.shape[2]} rows is not "
                             f"divisible by the stride {self.stride[0]}")
        x = halo_exchange(x, self.group, *self.halo)             # (B, C_in, h + k - s, W)
        return self.conv(x, self.bias)                           # (B, C_out, h / s, W / s)
