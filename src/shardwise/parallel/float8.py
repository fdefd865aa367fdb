"""FP8 training (``training.precision = "fp8"``): the Linear layers' matmuls in float8
through torchao's float8 training (``torchao.float8.convert_to_float8_training``), everything
else as ``precision = "bf16"`` (bf16 parameters and activations, fp32 masters and moments).

Each converted ``nn.Linear`` becomes a ``torchao.float8.Float8Linear`` holding the *same*
``weight`` / ``bias`` Parameters (``Float8Linear.from_float`` reassigns them), so the
gradient syncs, masters, checkpoints and parameter names are those of bf16. In forward and
backward it casts its bf16 input, weight and output gradient to float8 (e4m3 forward, e5m2
for gradients in ``tensorwise``) with dynamic scales, multiplies with ``torch._scaled_mm``
and returns bf16; it saves the bf16 input and weight for backward (activations as bf16).
Recipes (``training.fp8_recipe``, ``Float8LinearConfig.from_recipe_name``; Micikevicius et
al., "FP8 Formats for Deep Learning", arXiv:2209.05433):

- ``tensorwise``: one scale per tensor (amax of the whole tensor), the fastest;
- ``rowwise``: one scale per row of each operand, all e4m3 (more accurate, a little slower).

Which layers (torchtitan's choice, ``components/quantization/float8.py``): every
``nn.Linear`` whose in and out features are multiples of 16 (``torch._scaled_mm``'s
requirement), except the output head (tp style ``vocab_head``: the logits stay bf16) and the
modules the model's description keeps in high precision (``ModelDescription.keep_high_precision``:
the Llama's mixture-of-experts routers, so routing decisions stay bf16).

What composes (torchao 0.18):

- ZeRO-1/2 and pipelines: yes (the weights are bf16 Parameters as usual).
- ZeRO-3: yes, but the gathers stay bf16. torchao's float8 all-gather
  (``Float8LinearConfig.enable_fsdp_float8_all_gather``) wraps the weight in
  ``WeightWithDynamicFloat8CastTensor``, whose ``fsdp_pre_all_gather`` /
  ``fsdp_post_all_gather`` hooks only FSDP2's ``fully_shard`` calls (with DTensor shards);
  our ZeRO-3 gathers flat bf16 buffers through ``shardwise.comm``, so the option is left off.
- Tensor parallelism: no. torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel``
  are DTensor ``ParallelStyle`` s; our tp layers are our own modules (not ``nn.Linear``), so
  the config refuses fp8 with ``parallel.tp > 1``.

Devices: float8 matmuls need CUDA compute capability >= 8.9 (Ada, Hopper and later);
elsewhere (the CPU, A100) fp8 is refused in one line before any rank starts
(``check_fp8``). torchao is an optional dependency: ``pip install 'shardwise[fp8]'``.
"""

from __future__ import annotations

import importlib.util
from typing import Callable, Sequence

import torch.nn as nn

from shardwise.base.config import FP8_RECIPES

RECIPES = FP8_RECIPES  # training.fp8_recipe's choices
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x)
_INSTALL = "pip install 'shardwise[fp8]' (or pip install torchao)"


def fp8_refusal(device_type: str, capabilities: Sequence[tuple[int, int]],
                torchao_found: bool) -> str | None:
    """Why ``training.precision = "fp8"`` cannot run on ``device_type`` ("cpu" / "cuda")
    whose local GPUs have compute ``capabilities`` ([(major, minor), ...]), with or without
    torchao installed: one line naming the field, or None when it can. Pure: the door check
    (``check_fp8``) and the engine pass what they read; tests pass made-up devices."""
    if device_type != "cuda":
        return ("training.precision=fp8 needs a CUDA GPU of compute capability >= 8.9 (Ada, "
                f"Hopper or later); this run is on the {device_type.upper()}: use "
                "training.precision = bf16")
    low = [c for c in capabilities if tuple(c) < MIN_CAPABILITY]
    if low or not capabilities:
        cap = ".".join(map(str, low[0])) if low else "unknown"
        return (f"training.precision=fp8 needs CUDA compute capability >= 8.9 (Ada, Hopper or "
                f"later) for float8 matmuls; this GPU has {cap}: use training.precision = bf16")
    if not torchao_found:
        return f"training.precision=fp8 needs torchao, which is not installed: {_INSTALL}"
    return None


def check_fp8(device_type: str, devices: Sequence[int] | None = None) -> None:
    """Raise ``ValueError`` (one line, ``fp8_refusal``) unless fp8 can run on
    ``device_type`` ("cpu" / "cuda"): torchao importable, every CUDA device in ``devices``
    (default: all visible) of capability >= 8.9. Reads the devices, imports nothing."""
    import torch

    caps: list[tuple[int, int]] = []
    if device_type == "cuda" and torch.cuda.is_available():
        ids = range(torch.cuda.device_count()) if devices is None else devices
        caps = [torch.cuda.get_device_capability(i) for i in ids]
    why = fp8_refusal(device_type, caps, importlib.util.find_spec("torchao") is not None)
    if why:
        raise ValueError(why)


def _none(name: str) -> bool:
    return False


def float8_filter(style_of: Callable[[str], str], prefix: str = "", *,
                  high_precision: Callable[[str], bool] = _none,
                  ) -> Callable[[nn.Module, str], bool]:
    """``module_filter_fn`` for ``convert_to_float8_training``: True for an ``nn.Linear``
    (named ``fqn`` under ``prefix``, the layer's full model name) to be converted: in and
    out features multiples of 16, not the output head (``style_of(full name) ==
    "vocab_head"``), not a module ``high_precision(full name)`` keeps (the description's
    ``is_high_precision``: its routers; default: none)."""
    def keep(module: nn.Module, fqn: str) -> bool:
        name = f"{prefix}.{fqn}" if prefix and fqn else (prefix or fqn)
        if not isinstance(module, nn.Linear):
            return False
        if module.in_features % 16 or module.out_features % 16:
            return False
        return style_of(name) != "vocab_head" and not high_precision(name)
    return keep


def convert_layers(named_layers: Sequence[tuple[str, nn.Module]],
                   style_of: Callable[[str], str], recipe: str = "tensorwise", *,
                   high_precision: Callable[[str], bool] = _none) -> list[str]:
    """Swap, in place, the eligible ``nn.Linear`` of each ``(full model name, layer)``
    (``float8_filter``: ``style_of`` and ``high_precision`` read the model's description) for
    torchao's ``Float8Linear`` with ``recipe`` (``RECIPES``); the Parameters are kept (same
    objects, names and dtypes). Returns the full names of the converted modules. Raises
    ``ValueError`` (one line) for an unknown recipe or a missing torchao. Call it on the
    materialised, tp-sharded layers before the gradient sync wraps them (the engine's step
    3d) and before ``torch.compile``."""
    if recipe not in RECIPES:
        raise ValueError(f"training.fp8_recipe={recipe!r}: expected one of {', '.join(RECIPES)}")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ValueError(f"training.precision=fp8 needs torchao: {_INSTALL}") from None
    config = Float8LinearConfig.from_recipe_name(recipe)
    converted: list[str] = []
    for prefix, layer in named_layers:
        keep = float8_filter(style_of, prefix, high_precision=high_precision)

        def record(module: nn.Module, fqn: str, keep=keep, prefix=prefix) -> bool:
            if keep(module, fqn):
                converted.append(f"{prefix}.{fqn}" if fqn else prefix)
                return True
            return False

        if isinstance(layer, nn.Linear):  # a root Linear cannot be swapped in place
            continue
        convert_to_float8_training(layer, module_filter_fn=record, config=config)
    return converted
