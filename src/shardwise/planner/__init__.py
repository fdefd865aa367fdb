"""Planner and simulator: choose the layout for a model and a cluster, predict its memory
per GPU and its step time (``shardwise plan``).

- ``specs``: model sizes (named GPT-2 ... 1T, Llama, Mixtral 8x7B, or a TOML ``[model]``
  table);
- ``hardware``: cluster presets (DGX A100 40/80 GB, DGX H100, this machine calibrated), the
  per-operation compute model (``per_op``) and the fixed-efficiency one (``FIXED_PRESETS``);
- ``memory``: the one memory model (static bytes exact or closed form, activations after
  Korthikanti et al. 2022), shared with ``shardwise memory``;
- ``layout``: ``Layout``, one point of the search;
- ``compute``: FLOPs and seconds of a block, the attention core, the head, the optimizer;
- ``comm_price``: bytes and seconds of the collectives and transfers (tp, cp ring, ep
  all-to-all, dp, tied embedding, pipeline sends, Megatron's blocking ones);
- ``costs``: a chunk's forward and backward seconds (recomputation, ZeRO-3 inside);
- ``schedule_walk``: the step's timeline from the schedule's instruction lists, on the
  pipeline's timer (``parallel.pipeline.schedules.time_lists``);
- ``simulate``: step time and its split (dp, tp, pp, cp, ep, ZeRO, recomputation, FP8);
- ``search``: enumerate, prune with reasons, rank; ``cli``: the command line and the TOML;
- ``kernel_bench``: a block's kernels timed on a device (``shardwise bench calibrate``);
  ``kernels``: that profile read, a GPU preset priced from it (``plan --kernels-profile``).
"""

from shardwise.planner.hardware import FIXED_PRESETS, PRESETS, Cluster, get_cluster, per_op
from shardwise.planner.search import Candidate, Pruned, plan
from shardwise.planner.simulate import Layout, simulate
from shardwise.planner.specs import NAMED, ModelSpec, SpecError, load_model

__all__ = ["FIXED_PRESETS", "NAMED", "PRESETS", "Candidate", "Cluster", "Layout", "ModelSpec",
           "Pruned", "SpecError", "get_cluster", "load_model", "per_op", "plan", "simulate"]
