"""Planner and simulator: choose the layout for a model and a cluster, predict its memory
per GPU and its step time (``shardwise plan``).

- ``specs``: model sizes (named GPT-2 ... 1T, Llama, Mixtral 8x7B, or a TOML ``[model]``
  table);
- ``hardware``: cluster presets (DGX A100 40/80 GB, DGX H100, this machine calibrated), the
  per-operation compute model (``per_op``) and the fixed-efficiency one (``FIXED_PRESETS``);
- ``memory``: the one memory model (static bytes exact or closed form, activations after
  Korthikanti et al. 2022), shared with ``shardwise memory``;
- ``simulate``: step time by walking the pipeline schedule's instruction lists (dp, tp, pp,
  cp, ep, ZeRO, recomputation, FP8);
- ``search``: enumerate, prune with reasons, rank; ``cli``: the command line and the TOML.
"""

from shardwise.planner.hardware import FIXED_PRESETS, PRESETS, Cluster, get_cluster, per_op
from shardwise.planner.search import Candidate, Pruned, plan
from shardwise.planner.simulate import Layout, simulate
from shardwise.planner.specs import NAMED, ModelSpec, SpecError, load_model

__all__ = ["FIXED_PRESETS", "NAMED", "PRESETS", "Candidate", "Cluster", "Layout", "ModelSpec",
           "Pruned", "SpecError", "get_cluster", "load_model", "per_op", "plan", "simulate"]
