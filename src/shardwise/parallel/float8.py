"""FP8 training (``training.precision = "fp8"``): the Linear layers' matmuls in float8
through torchao's float8 training (``torchao.float8.convert_to_float8_training``), everything
else as ``precision = "bf16"`` (bf16 parameters and activations, fp32 masters and moments).

Each converted ``nn.Linear`` becomes a ``torchao.float8.Float8Linear`` holding the *same*
``weight`` / ``bias`` Parameters, so gradient syncs, masters, checkpoints and names are
bf16's; it casts its input, weight and output gradient to float8 with dynamic scales and
multiplies with ``torch._scaled_mm``. Recipes (``training.fp8_recipe``): ``tensorwise`` and
``rowwise`` (Micikevicius et al., "FP8 Formats for Deep Learning", arXiv:2209.05433). Which
layers (torchtitan's choice, ``components/quantization/float8.py``): in and out features
multiples of 16, not the output head, not ``ModelDescription.keep_high_precision``. ZeRO-3's
gathers stay bf16; tp > 1 is refused; the device needs CUDA compute capability >= 8.9
(``check_fp8``, one line before any rank starts). Why, and what composes: docs/fp8.md.
torchao is an optional dependency: ``pip install 'shardwise[fp8]'``.
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
