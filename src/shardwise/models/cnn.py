"""An AlexNet-shaped small image classifier: a few convolutions, then large linear layers.

Krizhevsky's "One weird trick for parallelizing convolutional neural networks" (2014,
arXiv:1404.5997) observes that in such a network the convolutions hold ~5% of the
parameters and ~90-95% of the computation, the fully connected layers the opposite; seed
000 draws the consequence (data parallelism for the convolutions, tensor parallelism for
the fully connected layers). ``CNN`` is that shape at Fashion-MNIST scale (28 x 28 x 1):

    conv_i: Conv2d(c_{i-1}, c_i, k, padding k // 2) -> ReLU -> MaxPool2d(2)   (B, c_i, H/2, W/2)
    flatten                                                                  (B, c_n H W)
    fc_j:   Linear(h_{j-1}, h_j) -> ReLU (none after the last)              (B, h_j)

With ``inception`` branches, an Inception-style block (Szegedy et al. 2015, "Going deeper
with convolutions", arXiv:1409.4842) follows the last convolution: independent branches
(1x1, 3x3 or 5x5 convolutions, or 3x3 max-pooling then a 1x1 convolution), each with
padding that keeps the side, joined by concatenation along the channels, then ReLU:

    inception: cat_j(branch_j(x), dim=1) -> ReLU                               (B, sum c_j, H, W)

The model is a chain of ``Block``s (the layer, then its element-wise / pooling tail), which
is what ``shardwise.apps.cnn`` assigns a strategy to, one block at a time; ``specs()`` describes
each block's sizes for the cost model without running it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class CNNConfig:
    """Sizes. ``channels``: output channels of each convolution; ``hidden``: widths of the
    fully connected layers before the classifier (which has ``classes`` outputs)."""

    in_channels: int = 1
    image_size: int = 28
    channels: tuple[int, ...] = (32, 64)
    kernel: int = 3
    hidden: tuple[int, ...] = (512, 256)
    classes: int = 10
    inception: tuple[tuple[str, int], ...] = ()  # (kind, output channels) per branch

    def __post_init__(self) -> None:
        side = self.image_size >> len(self.channels)
        if side < 1:
            raise ValueError(f"cnn.channels: {len(self.channels)} poolings of 2 leave nothing "
                             f"of a {self.image_size}-pixel image")


BRANCH_KINDS = ("1x1", "3x3", "5x5", "pool")


def parse_branches(entries: list[str] | tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """``["1x1:16", "pool:8"]`` -> ``(("1x1", 16), ("pool", 8))``: the branches of
    ``cnn.inception``. ValueError (one line naming the entry) on a bad kind or count, or
    fewer than two branches."""
    out = []
    for i, e in enumerate(entries):
        kind, _, ch = str(e).partition(":")
        if kind not in BRANCH_KINDS or not ch.isdigit() or int(ch) < 1:
            raise ValueError(f"cnn.inception[{i}]={e!r}: expected {', '.join(BRANCH_KINDS)}, a "
                             "colon and the branch's output channels >= 1 (e.g. '3x3:16')")
        out.append((kind, int(ch)))
    if len(out) == 1:
        raise ValueError(f"cnn.inception={list(entries)}: an Inception block needs two or more "
                         "branches (or none)")
    return tuple(out)


@dataclass(frozen=True)
class BranchSpec:
    """One branch of an Inception block: ``kind`` (1x1, 3x3, 5x5, pool), output channels,
    parameters and forward FLOPs per sample (the pooling's comparisons not counted)."""

    kind: str
    c_out: int
    params: int
    flops: int


@dataclass(frozen=True)
class BlockSpec:
    """One block's sizes, per sample: what the cost model needs.

    kind: "conv", "inception" or "fc"; c_in, c_out: channels / features; in_elems,
    out_elems: elements of the block's input and output activation per sample (the output
    after pooling, as it leaves the block); params: parameter count; flops: forward FLOPs
    per sample (2 per multiply-add); kernel: a convolution's kernel size (square; 1 for a
    linear layer or an Inception block); branches: an Inception block's, in concatenation
    order."""

    name: str
    kind: str
    c_in: int
    c_out: int
    in_elems: int
    out_elems: int
    params: int
    flops: int
    kernel: int = 1
    branches: tuple[BranchSpec, ...] = ()


class Branch(nn.Module):
    """One branch: a convolution of kernel 1, 3 or 5 (padding keeps the side), or 3x3
    max-pooling (stride 1, padding 1) then a 1x1 convolution. (B, c_in, H, W) ->
    (B, c_out, H, W), before the block's ReLU."""

    def __init__(self, kind: str, c_in: int, c_out: int):
        super().__init__()
        k = 1 if kind == "pool" else int(kind[0])
        self.kind, self.conv = kind, nn.Conv2d(c_in, c_out, k, padding=k // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The branch's feature map ``(B, c_out, H, W)``."""
        if self.kind == "pool":
            x = F.max_pool2d(x, 3, stride=1, padding=1)
        return self.conv(x)


class Inception(nn.Module):
    """Independent ``branches`` on the same input, concatenated along the channels:
    (B, c_in, H, W) -> (B, sum c_j, H, W)."""

    def __init__(self, c_in: int, branches: tuple[tuple[str, int], ...]):
        super().__init__()
        self.c_in = c_in
        self.branches = nn.ModuleList(Branch(k, c_in, c) for k, c in branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every branch, joined along dim 1."""
        return torch.cat([b(x) for b in self.branches], dim=1)     # (B, C, H, W)


class Block(nn.Module):
    """``layer`` (Conv2d, Inception or Linear) then ReLU (unless ``last``) then 2x2
    max-pooling (conv)."""

    def __init__(self, layer: nn.Module, pool: bool, last: bool = False):
        super().__init__()
        self.layer, self.pool, self.last = layer, pool, last

    def tail(self, y: torch.Tensor) -> torch.Tensor:
        """The element-wise / per-sample part after the layer (works on any layout)."""
        if not self.last:
            y = F.relu(y)
        return F.max_pool2d(y, 2) if self.pool else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer then its tail (activation, pooling); a linear layer flattens a feature map
        ``(B, C, H, W)`` to ``(B, C H W)`` first."""
        if isinstance(self.layer, nn.Linear) and x.dim() > 2:
            x = x.flatten(1)                                   # (B, C H W)
        return self.tail(self.layer(x))


class CNN(nn.Module):
    """(B, in_channels, S, S) float images -> (B, classes) logits. Parameters are named
    ``blocks.{i}.layer.{weight,bias}``."""

    def __init__(self, cfg: CNNConfig):
        super().__init__()
        self.cfg = cfg
        blocks, c = [], cfg.in_channels
        for ch in cfg.channels:
            blocks.append(Block(nn.Conv2d(c, ch, cfg.kernel, padding=cfg.kernel // 2), pool=True))
            c = ch
        if cfg.inception:
            blocks.append(Block(Inception(c, cfg.inception), pool=False))
            c = sum(ch for _, ch in cfg.inception)
        width = c * (cfg.image_size >> len(cfg.channels)) ** 2
        widths = [width, *cfg.hidden, cfg.classes]
        for j in range(len(widths) - 1):
            blocks.append(Block(nn.Linear(widths[j], widths[j + 1]), pool=False,
                                last=j == len(widths) - 2))
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(B, in_channels, S, S)`` -> logits ``(B, classes)``, block by block."""
        for b in self.blocks:
            x = b(x)
        return x

    def specs(self) -> list[BlockSpec]:
        """Each block's ``BlockSpec``, in order."""
        out, side = [], self.cfg.image_size
        for i, b in enumerate(self.blocks):
            layer, params = b.layer, sum(p.numel() for p in b.parameters())
            if isinstance(layer, nn.Conv2d):
                k = layer.kernel_size[0] * layer.kernel_size[1]
                flops = 2 * layer.in_channels * k * layer.out_channels * side * side
                in_e = layer.in_channels * side * side
                side //= 2
                out.append(BlockSpec(f"conv{i + 1}", "conv", layer.in_channels,
                                     layer.out_channels, in_e, layer.out_channels * side * side,
                                     params, flops, layer.kernel_size[0]))
            elif isinstance(layer, Inception):
                br = tuple(BranchSpec(b.kind, b.conv.out_channels,
                                      sum(p.numel() for p in b.parameters()),
                                      2 * b.conv.weight.numel() * side * side)
                           for b in layer.branches)
                c_out = sum(x.c_out for x in br)
                out.append(BlockSpec("inception", "inception", layer.c_in, c_out,
                                     layer.c_in * side * side, c_out * side * side, params,
                                     sum(x.flops for x in br), branches=br))
            else:
                j = i - len(self.cfg.channels) - bool(self.cfg.inception) + 1
                out.append(BlockSpec(f"fc{j}", "fc", layer.in_features, layer.out_features,
                                     layer.in_features, layer.out_features, params,
                                     2 * layer.in_features * layer.out_features))
        return out
