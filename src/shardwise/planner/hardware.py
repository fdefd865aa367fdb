"""Clusters the planner prices layouts on: GPU speed and memory, links within and across
nodes, each link a ``comm.cost.LinkParams`` so every collective is priced by the same
alpha-beta model (Thakur et al. 2005) as ``shardwise.comm``'s own algorithms.

Presets (``PRESETS``, ``FIXED_PRESETS``), from the vendors' published specs:

=============  ==========================  =======  ===============  =====================
preset         GPU (dense bf16 peak)        memory   intra-node link  inter-node link/GPU
=============  ==========================  =======  ===============  =====================
dgx-a100-40gb  A100 SXM4 312 TFLOP/s [1]    40 GiB   NVLink3 300 GB/s  HDR IB 200 Gb/s [2]
dgx-a100-80gb  A100 SXM4 312 TFLOP/s [1]    80 GiB   NVLink3 300 GB/s  HDR IB 200 Gb/s [2]
dgx-h100       H100 SXM5 989 TFLOP/s [3]    80 GiB   NVLink4 450 GB/s  NDR IB 400 Gb/s [4]
               (FP8: 1,979 TFLOP/s [3])
dgx-h200       H200 SXM  989 TFLOP/s [5]   141 GiB   NVLink4 450 GB/s  NDR IB 400 Gb/s [5]
               (FP8: 1,979; HBM3e 4.8 TB/s, the H100's 3.35 [5])
local          this machine, measured       RAM      comm profile (``profiles/default.json``)
=============  ==========================  =======  ===============  =====================

A plan on a GPU preset fills at most its memory less ``GPU_RESERVED`` (2 GiB, stated: the
CUDA context, NCCL's buffers, fragmentation), e.g. 78 of the H100's 80 GiB.

[1] NVIDIA A100 Tensor Core GPU datasheet (2021); [2] NVIDIA DGX A100 datasheet: 8 GPUs,
8 single-port HDR 200 Gb/s HCAs for compute; [3] NVIDIA H100 Tensor Core GPU datasheet
(SXM5); [4] NVIDIA DGX H100 datasheet: 8 GPUs, 8 x 400 Gb/s ConnectX-7; [5] NVIDIA H200
Tensor Core GPU datasheet (2024: H200 SXM, 141 GB HBM3e at 4.8 TB/s, the H100's compute) and
NVIDIA DGX H200 datasheet (8 GPUs, NVLink4, 8 x 400 Gb/s ConnectX-7). NVLink bandwidths
are per direction (600 / 900 GB/s bidirectional). Latencies are NCCL-typical, stated not
measured: 5 us per step inside a node, 10 us across.

Compute, two models:

- per operation (``PRESETS``, the default; ``per_op``, ``OpModel``): each GEMM of a block at
  the efficiency its size gets in Calculon's A100/H100 table (Isaev et al. SC 2023), times
  ``GEMM_SCALE`` (one constant, calibrated on one published Megatron-LM run and stated
  below), each memory-bound kernel (norms, softmax, dropout, activations, residual adds) by
  the bytes it moves at Calculon's memory efficiency, attention by its kernel (flash for
  shardwise, unfused for Megatron-LM 2021: ``KERNELS``); links at Calculon's efficiency
  (NVLink 0.6, InfiniBand 0.9 of the datasheet bandwidth); on the presets, the overheads
  this repository's H100 measurements show (``per_op(measured=True)``: ``FLASH_BACKWARD``,
  ``H100_GEMM_SCALE``, ``COMPILED_MEM``, ``STEP_S``, ``FP8_CAST``, ``ZERO3_EXPOSED``;
  ``benchmarks/planner_measured.py``);
- fixed (``FIXED_PRESETS``, ``--compute fixed``): every matmul at ``EFFICIENCY`` = 50% of
  the dense bf16 peak (Narayanan et al. 2021 report 44-52% of peak end to end), links at
  the datasheet bandwidth. The model before the per-operation one.

``benchmarks/planner_published.py`` compares both with Megatron-LM's published runs.

``local``: the compute rate is measured (``calibrate_local``: one rank's matmul FLOP/s with
one thread, and the fixed per-layer overhead of running a block, forward and backward; the
block is one of the planned model's own, GPT, Llama or a registered kind, built as the
engine builds it; a named size's narrowed to about 256 wide, ``calibration_spec``),
divided among the ranks that share the cores; links are the calibrated comm profile at the
group's size, with the algorithm ``auto`` picks (``comm.cost``).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache

from shardwise.comm import cost
from shardwise.comm.cost import LinkParams
from shardwise.perf.gpus import gpu_peak
from shardwise.planner.specs import ModelSpec, SpecError

EFFICIENCY = 0.5
MEMCPY_LOCAL = 15e9  # bytes/s, memcpy on the development machine (docs/architecture.md)
GiB = 1 << 30


@dataclass(frozen=True)
class Link:
    """One kind of link. ``fixed``: the same constants at every group size (a cluster
    fabric), else the profile's constants measured at the group's size (this machine)."""

    name: str
    fixed: LinkParams | None = None
    profile: cost.Profile | None = None
    algorithm: str = "ring"  # "auto": the cheapest of comm.cost.AUTO_CANDIDATES and ``extra``
    extra: tuple[str, ...] = ()  # more "auto" candidates ("shm": every rank on one host)
    tp_algorithm: str | None = None  # what tensor-parallel layers call (None: ``algorithm``)

    def params(self, n: int) -> LinkParams:
        """Link parameters (alpha, beta, gamma: seconds and seconds per byte) for a group of ``n``
        ranks."""
        return self.fixed if self.fixed is not None else self.profile.params(n)

    def all_reduce(self, n: int, nbytes: float, tp: bool = False) -> float:
        """Predicted seconds of an all-reduce of ``nbytes`` over ``n`` ranks on this link (the
        cheapest candidate under ``auto``, as ``comm.api.choose`` picks; ``tp``: a tensor-
        parallel layer's, ``tp_algorithm``); 0 for one rank or no bytes."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        prm = self.params(n)
        alg = self.tp_algorithm if tp and self.tp_algorithm else self.algorithm
        algs = cost.AUTO_CANDIDATES + self.extra if alg == "auto" else (alg,)
        return min(cost.predict(a, n, nbytes, prm) for a in algs)

    def reduce_scatter(self, n: int, nbytes: float) -> float:
        """Ring reduce-scatter of ``nbytes`` (the whole vector): the first half of ring."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        prm = self.params(n)
        return (n - 1) * prm.a(n) + (n - 1) / n * nbytes * (prm.b(n) + prm.g(n))

    def all_gather(self, n: int, nbytes: float) -> float:
        """Ring all-gather producing ``nbytes`` on every rank."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        prm = self.params(n)
        return (n - 1) * prm.a(n) + (n - 1) / n * nbytes * prm.b(n)

    def all_to_all(self, n: int, nbytes: float) -> float:
        """All-to-all of ``nbytes`` per rank (its whole send buffer), (n - 1) / n of it to
        the n - 1 others, pairwise: n - 1 steps of one message each way."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        prm = self.params(n)
        return (n - 1) * prm.a(n) + (n - 1) / n * nbytes * prm.b(n)

    def p2p(self, nbytes: float) -> float:
        """One message alone on its link (a pipeline send)."""
        prm = self.params(2)
        return prm.a(1) + nbytes * prm.b(1)


def fabric(name: str, bytes_per_s: float, latency_s: float) -> Link:
    """A switched fabric: every rank sends and receives at ``bytes_per_s`` at once."""
    return Link(name, LinkParams(alpha=latency_s, beta_link=1 / bytes_per_s, beta_host=0.0,
                                 gamma=0.0, gamma_host=0.0, native_alpha=latency_s,
                                 native_beta=2 / bytes_per_s))


@dataclass(frozen=True)
class Cluster:
    """``flops``: dense peak per GPU at the compute dtype; ``efficiency``: fraction of it
    the matmuls reach; ``overhead_s``: fixed seconds per block pass (kernel launches,
    Python); ``memory``: bytes per GPU; ``reserved``: bytes of each GPU a plan leaves free
    (``GPU_RESERVED`` on the GPU presets; 0 on ``local``); ``share``: ranks per compute
    unit (local: ranks per core, compute slows by it); ``fp8_flops``: dense FP8 tensor-core
    peak per GPU (None: the GPU has no FP8 tensor cores, as the A100)."""

    name: str
    gpu: str
    flops: float
    memory: float
    gpus_per_node: int
    intra: Link
    inter: Link
    efficiency: float = EFFICIENCY
    mem_bw: float = 1.5e12  # bytes/s of device memory (the optimizer step is bound by it)
    overhead_s: float = 0.0
    precision: str = "bf16"
    source: str = ""
    cores: int = 0
    meta: dict = field(default_factory=dict)
    ops: OpModel | None = None  # per-operation compute model; None: flops x efficiency
    kernels: str = "shardwise"  # which kernels a block runs (KERNELS), for ``ops``
    zero3_overlap: bool = True  # ZeRO-3 gathers overlap compute (``simulate.zero3_seconds``)
    blocking_sends: bool = False  # pipeline sends block compute (``simulate.blocking_p2p``)
    fp8_flops: float | None = None
    reserved: float = 0.0
    step_s: float = 0.0  # host seconds per optimizer step (``STEP_S``; 0: not modelled)
    zero3_exposed: float = 0.0  # ZeRO-3 collectives' share prefetch cannot hide (GPUs)
    compiled: bool = False  # blocks and loss under torch.compile (per_op): activations as
    # compiled blocks keep them (``memory.compiled_model``); ``plan --emit-toml`` sets compile
    optimizer_param_s: float = 0.0  # host optimizer seconds per parameter on one core
    # (local: measured, ``calibrate_local``; 0: 40 bytes of memory traffic at ``mem_bw``)
    micro_batch_s: float = 0.0  # host seconds per micro-batch on a rank beyond its layers'
    # priced work (local: measured, ``host_seconds``; 0: not modelled)
    contention: float = 1.0  # local: how much longer a rank's work takes while more ranks
    # than cores share them than alone (caches, context switches, the comm thread and gloo's
    # CPU): measured at the planned world size (``shared_seconds``); 1 on a GPU
    ring_message_s: float = 0.0  # local: seconds per message of the cp ring, transfer and
    # host work together (the exchange through the comm thread, the merge of its block),
    # measured (``shared_seconds``); it replaces the profile's transfer price for the ring,
    # and the profile's latency of each step of ZeRO-1/2's ring (``comm_price.sharded_seconds``)

    def link(self, span: int) -> Link:
        """The link a group whose ranks lie within ``span`` consecutive ranks crosses."""
        return self.intra if span <= self.gpus_per_node else self.inter

    def sharing(self, world_size: int) -> float:
        """How much slower a rank's CPU work runs when ``world_size`` ranks run at once:
        ranks per core (at least 1), times the ``contention`` measured at that world size
        (local); 1 on a GPU cluster and for one rank (a dedicated core's price)."""
        if not self.cores or world_size <= 1:
            return 1.0
        return max(1.0, world_size / self.cores) * self.contention

    def rate(self, world_size: int) -> float:
        """FLOP/s one rank's matmuls reach when ``world_size`` ranks run at once."""
        return self.flops * self.efficiency / self.sharing(world_size)

    def comm_stretch(self, n: int, world_size: int) -> float:
        """How much longer than its comm-profile price a collective of ``n`` ranks takes
        while ``world_size`` ranks share the cores (local): the profile timed it with its
        ranks alone, each on ``core_share(n)`` of a core, and gloo's collectives here are
        CPU work (copies, reductions, loopback's kernel work, each step's peer to be
        scheduled) that gets cores / world_size of a core like compute:
        core_share(n) x max(1, world_size / cores). Measured: replayed on the last quiet
        ``benchmarks/planner_local.py`` run (load 0.47), dp1 tp4 at world size 4 ran at its
        profile price (stretch 1: 137-148 ms measured, 147-155 predicted), dp2 tp4 at 8 at
        about twice it (213-220, 256-271), dp2 tp2 at 4 twice (77-97, 84-86). 1 where every
        rank has a device."""
        share = max(1.0, world_size / self.cores) if self.cores else 1.0
        return self.core_share(n) * share

    def core_share(self, n: int) -> float:
        """The share of a core each rank had when the comm profile timed a collective of
        ``n`` ranks: min(1, cores / m), m the world size it measured for n (the profile of
        this machine has 2 and 4: 8 ranks are priced at 4's constants, timed on half a core
        each); 1 on a GPU cluster."""
        if not self.cores or n <= 0:
            return 1.0
        prof = self.intra.profile
        m = prof.measured_size(n) if prof is not None else n
        return min(1.0, self.cores / m)

    def memory_per_rank(self, world_size: int) -> float:
        """Bytes one rank's plan may fill: a GPU's memory less ``reserved``, or this
        machine's RAM shared by its ranks."""
        return self.memory / world_size if self.cores else self.memory - self.reserved

    def rank_overhead(self, world_size: int) -> float:
        """Fixed seconds per block pass (``overhead_s``), stretched when ``world_size`` ranks share
        fewer cores (``sharing``)."""
        return self.overhead_s * self.sharing(world_size)


NVLINK3, NVLINK4 = fabric("NVLink3", 300e9, 5e-6), fabric("NVLink4", 450e9, 5e-6)
HDR, NDR = fabric("HDR IB 200 Gb/s", 25e9, 10e-6), fabric("NDR IB 400 Gb/s", 50e9, 10e-6)

@dataclass(frozen=True)
class OpModel:
    """Per-operation compute model of one GPU (``Cluster.ops``; ``simulate.block_ops`` lists
    the operations). A GEMM of F FLOPs takes F / (``matrix_flops`` x the efficiency of the
    first row of ``gemm_eff`` whose GFLOP threshold F reaches); a memory-bound operation
    moving B bytes takes B / (``mem_bw`` x the efficiency of the first row of ``mem_eff``
    whose MB threshold B reaches). The tables are documented, not fitted (``source``)."""

    name: str
    matrix_flops: float
    gemm_eff: tuple[tuple[float, float], ...]  # (GFLOP threshold, efficiency), descending
    mem_bw: float
    mem_eff: tuple[tuple[float, float], ...]   # (MB threshold, efficiency), descending
    source: str = ""
    fp8_flops: float | None = None  # FP8 tensor-core peak (None: none on this GPU)
    mem_scale: float = 1.0  # memory-bound seconds x this (``COMPILED_MEM``: fused kernels)
    attn_backward: float = 2.0  # attention kernel's backward / forward (``FLASH_BACKWARD``)
    fp8_cast_bytes: float = 0.0  # FP8 casts' bytes per linear in/out value (``FP8_CAST``)

    def gemm(self, flops: float, fp8: bool = False) -> float:
        """Seconds of a GEMM of ``flops``; ``fp8``: at the FP8 peak where the GPU has one,
        the same efficiency table (Calculon's has none for FP8)."""
        if flops <= 0:
            return 0.0
        g = flops / 1e9
        peak = self.fp8_flops if fp8 and self.fp8_flops else self.matrix_flops
        return flops / (peak * next(e for t, e in self.gemm_eff if g >= t))

    def memory(self, nbytes: float) -> float:
        """Seconds of a memory-bound operation moving ``nbytes`` (``mem_bw`` times the efficiency of
        the first ``mem_eff`` row it reaches); 0 for no bytes."""
        if nbytes <= 0:
            return 0.0
        mb = nbytes / 1e6
        return self.mem_scale * nbytes / (self.mem_bw * next(e for t, e in self.mem_eff
                                                             if mb >= t))


# Calculon (Isaev et al., SC 2023, "Calculon: a methodology and tool for high-level
# co-design of systems and large language models"; its repository's systems/a100_80g.json
# and systems/h100_80g_nvl8.json): matrix efficiency by the GEMM's GFLOPs (>= 128: 0.95,
# >= 16: 0.9, >= 1: 0.6, below: 0.1) and device-memory efficiency by the bytes an operation
# moves (>= 100 MB: 0.9, >= 10 MB: 0.75, >= 1 MB: 0.6, below: 0.3), the same for A100 and
# H100; network efficiency 0.6 of NVLink's bandwidth and 0.9 of InfiniBand's.
CALCULON_GEMM = ((128.0, 0.95), (16.0, 0.9), (1.0, 0.6), (0.0, 0.1))
CALCULON_MEM = ((100.0, 0.9), (10.0, 0.75), (1.0, 0.6), (0.0, 0.3))
CALCULON_NVLINK_EFF, CALCULON_IB_EFF = 0.6, 0.9
CALCULON = "Calculon (Isaev et al. SC 2023), systems/a100_80g.json and h100_80g_nvl8.json"

# Kernels a block runs (``Cluster.kernels``; ``simulate.block_ops``):
# - "shardwise": this engine on a GPU: F.scaled_dot_product_attention (flash: no s x s
#   scores in memory), no dropout, GELU or SwiGLU unfused from the bias;
# - "megatron-2021": Megatron-LM as Narayanan et al. 2021 ran it: attention unfused (Q K^T
#   and P V batched GEMMs, a fused scale-mask-softmax and a dropout on the s x s scores),
#   fused bias + GELU, fused bias + dropout + residual add.
KERNELS = ("shardwise", "megatron-2021")


def _bf16_peak(gpu: str) -> float:
    """The dense bf16 peak of ``perf.gpus``' table: one table of GPUs for MFU and the planner."""
    return gpu_peak(gpu, "bf16").flops


# Dense FP8 tensor-core peak of the H100 SXM5: 3,958 TFLOP/s with 2:4 sparsity in the
# NVIDIA H100 datasheet, 1,979 dense: twice the bf16 peak. The A100 has no FP8 (its
# datasheet lists FP16/BF16, TF32, INT8, INT4): the A100 presets have ``fp8_flops`` None.
H100_FP8 = 1978.9e12


# Bytes of each GPU a plan leaves free (``Cluster.reserved``): memory the caching allocator
# never hands to tensors, so ``planner.memory`` does not count it. The CUDA context and the
# kernels' module images (about 0.5 GiB on an H100 under CUDA 12-13), cuBLAS workspaces,
# NCCL's buffers (NCCL_BUFFSIZE, 4 MiB by default, per channel, peer and protocol, in each
# communicator: dp, tp, pp, cp and ep groups each have one) and the allocator's
# fragmentation. Stated, not measured: 2 GiB is a margin, not a figure from a run
# (``benchmarks/gpu_memory.py`` records what a rank really holds outside the allocator,
# ``outside_allocator_mib``, to check it against). ``--memory-gib`` sets the limit instead.
GPU_RESERVED = 2 * GiB


# The presets with one efficiency for every matmul (``EFFICIENCY``), the model before the
# per-operation one: ``--compute fixed``, and what tests/data/planner_baseline.json recorded.
FIXED_PRESETS: dict[str, Cluster] = {
    "dgx-a100-40gb": Cluster("dgx-a100-40gb", "A100-SXM4-40GB", _bf16_peak("A100"), 40 * GiB, 8,
                             NVLINK3, HDR, mem_bw=1.555e12,
                             source="NVIDIA A100 and DGX A100 datasheets", reserved=GPU_RESERVED),
    "dgx-a100-80gb": Cluster("dgx-a100-80gb", "A100-SXM4-80GB", _bf16_peak("A100"), 80 * GiB, 8,
                             NVLINK3, HDR, mem_bw=2.039e12,
                             source="NVIDIA A100 and DGX A100 datasheets", reserved=GPU_RESERVED),
    "dgx-h100": Cluster("dgx-h100", "H100-SXM5-80GB", _bf16_peak("H100 SXM"), 80 * GiB, 8,
                        NVLINK4, NDR,
                        mem_bw=3.35e12, source="NVIDIA H100 and DGX H100 datasheets",
                        fp8_flops=H100_FP8, reserved=GPU_RESERVED),
    # The H200 is the H100 SXM's GH100 die (the same bf16 and FP8 peaks, links and node)
    # with 141 GB of HBM3e at 4.8 TB/s. The datasheet's 141 GB read as GiB, as dgx-h100
    # reads its 80 GB: torch.cuda.mem_get_info's total on the H200 this project is lent is
    # stated as about 139 GiB (not measured in this change; benchmarks/gpu_memory.py on the
    # next lent GPU checks it), so a plan's 139 GiB (GPU_RESERVED off) is about all of it,
    # a thinner margin than dgx-h100's; 141e9 bytes (131 GiB) would refuse layouts that fit.
    "dgx-h200": Cluster("dgx-h200", "H200-SXM-141GB", _bf16_peak("H200 SXM"), 141 * GiB, 8,
                        NVLINK4, NDR,
                        mem_bw=4.8e12, source="NVIDIA H200 and DGX H200 datasheets",
                        fp8_flops=H100_FP8, reserved=GPU_RESERVED),
}


# One constant of the per-operation model is calibrated, and on one published run only:
# Calculon's GEMM efficiencies times GEMM_SCALE make Megatron-LM's 22B full-recomputation
# iteration on 8 A100s (Korthikanti et al. 2022, Table 5: 1.42 s) come out exactly
# (``benchmarks/planner_published.py`` solves for it again and checks this value). The
# largest GEMMs then run at 0.95 x 0.803 = 76% of the A100's peak. Every other published
# run (Korthikanti's 7 others, Narayanan et al.'s 10) is a prediction, not a fit. It is
# applied to the H100 as well, where no run has checked it.
GEMM_SCALE = 0.803


# What the GPU measurements of this repository show (benchmarks/gpu_results/, one H100 SXM,
# torch 2.11, blocks and loss compiled; ``benchmarks/planner_measured.py`` solves the fitted
# ones again and checks these values). Every GPU preset carries them (the A100's measured
# only through llm-foundry's A100 rows, within 8%), but H100_GEMM_SCALE, the GH100's alone.
# Measured, not fitted:
# - FLASH_BACKWARD: the attention kernel's backward over its forward, 42.48 / 13.34 ms per
#   step (cuDNN's fused SDPA, logs/profile_llama1b.log), where the GEMM count says 2.
FLASH_BACKWARD = 3.18
# Fitted (five constants with ZERO3_EXPOSED below, each on one row; the other rows are
# predictions):
# - H100_GEMM_SCALE: Calculon's H100 GEMM efficiencies times this, solved on the Llama-1B
#   bf16 step (cuda_llama1b.md: 530.8 ms, 16 x 2048 tokens in 4 micro-batches); the A100
#   presets keep GEMM_SCALE (Megatron-LM's run).
# - COMPILED_MEM: the memory-bound kernels' seconds (norms, activations, residual adds, the
#   loss) times this: torch.compile fuses what the planner prices kernel by kernel; solved
#   on GPT-2 small's compiled step (cuda.md "+ compile": 71.3 ms, 32 x 1024 in 2).
# - STEP_S: host seconds per optimizer step beyond the AdamW bytes (Python of the step,
#   the clip's norm, zero_grad, launches), solved on the Llama-1B step with one
#   micro-batch of 4 (memory.json: 148.5 ms), against the 4-micro-batch step above.
# - FP8_CAST: bytes moved per value of each linear layer's input and output by torchao's
#   tensorwise FP8 (the casts, the amax reductions, the transposed copies backward), solved
#   on the Llama-1B fp8 tensorwise step (cuda_llama1b.md: 476.9 ms).
H100_GEMM_SCALE = 0.6407
# The GPUs H100_GEMM_SCALE applies to: the H100 SXM and the H200, one die (GH100), so the
# H100's measured GEMM efficiencies carry over; the H200's memory-bound kernels run at its
# own bandwidth through ``OpModel.memory`` (``Cluster.mem_bw``). No H200 run has checked it.
GH100 = ("H100", "H200")
COMPILED_MEM = 0.3668
STEP_S = 0.00631
FP8_CAST = 13.93
# - ZERO3_EXPOSED: the share of ZeRO-3's all-gathers and reduce-scatters prefetch does not
#   hide on a GPU when the group stays inside a node (NCCL's NVLink kernels take SMs and
#   memory bandwidth from the compute they overlap; across nodes the NIC moves the bytes and
#   llm-foundry's MPT-3B on 16 H100s shows them hidden): a chunk's forward waits at least
#   this share of its gathers, its backward of its gathers and reduce-scatters; solved on MosaicML llm-foundry's MPT-13B FSDP
#   FULL_SHARD row on 8 H100s (scripts/train/benchmarking/README.md: 4,792 tokens/s a
#   GPU, benchmarks/planner_measured.py); its other FULL_SHARD rows are predictions.
ZERO3_EXPOSED = 0.8261


def per_op(cluster: Cluster, kernels: str = "shardwise", gemm_scale: float = 1.0,
           measured: bool = False, compiled: bool = True) -> Cluster:
    """``cluster`` with the per-operation compute model (``OpModel``, Calculon's documented
    A100/H100 tables over the preset's datasheet peak and memory bandwidth) and links at
    Calculon's efficiencies (NVLink 0.6, InfiniBand 0.9 of the datasheet bandwidth, the
    same latencies), running ``kernels`` (Megatron-LM 2021's with its blocking pipeline
    sends: ``Cluster.blocking_sends``). ``gemm_scale`` multiplies every GEMM efficiency
    of the table (1: Calculon's as documented; ``benchmarks/planner_published.py``
    calibrates it on one published run and says so). ``measured``: with the overheads the
    GPU measurements show (``FLASH_BACKWARD``, ``COMPILED_MEM``, ``STEP_S``, ``FP8_CAST``:
    shardwise's compiled blocks; the presets ``plan`` uses; ``compiled=False``: eager
    blocks, the memory-bound kernels unfused), and ZeRO-3's exposed share
    (``ZERO3_EXPOSED``)."""
    if cluster.cores:
        raise SpecError("the per-operation model is for GPU presets; local is measured")
    if kernels not in KERNELS:
        raise SpecError(f"kernels {kernels!r}: expected one of {', '.join(KERNELS)}")
    gemm = tuple((t, min(1.0, e * gemm_scale)) for t, e in CALCULON_GEMM)
    ops = OpModel(f"{cluster.gpu} per-op" + (f", GEMMs x {gemm_scale:.3g}"
                                              if gemm_scale != 1.0 else ""),
                  cluster.flops, gemm, cluster.mem_bw, CALCULON_MEM, CALCULON,
                  fp8_flops=cluster.fp8_flops,
                  mem_scale=COMPILED_MEM if measured and compiled else 1.0,
                  attn_backward=FLASH_BACKWARD if measured else 2.0,
                  fp8_cast_bytes=FP8_CAST if measured else 0.0)

    def derate(link: Link, eff: float) -> Link:
        p = link.fixed
        return fabric(f"{link.name} x {eff:g}", eff / p.beta_link, p.alpha)

    return replace(cluster, ops=ops, kernels=kernels,
                   blocking_sends=kernels == "megatron-2021",
                   intra=derate(cluster.intra, CALCULON_NVLINK_EFF),
                   inter=derate(cluster.inter, CALCULON_IB_EFF),
                   step_s=STEP_S if measured else 0.0,
                   zero3_exposed=ZERO3_EXPOSED if measured else 0.0,
                   compiled=measured and compiled,
                   source=f"{cluster.source}; per-op: {CALCULON}")


# The presets ``plan`` uses: the per-operation model, shardwise's own (compiled) kernels,
# with the overheads the GPU measurements show.
PRESETS: dict[str, Cluster] = {
    k: per_op(c, "shardwise", H100_GEMM_SCALE if c.gpu.startswith(GH100) else GEMM_SCALE,
              measured=True)
    for k, c in FIXED_PRESETS.items()}
COMPUTE_MODELS = ("per-op", "fixed")


def get_cluster(name: str, spec=None, world_size: int = 1, compute: str = "per-op") -> Cluster:
    """A preset by name (``local``: measured now, on a block of ``spec``'s sizes, for
    ``world_size`` ranks), with the per-operation compute model or the ``fixed`` efficiency.
    ``SpecError`` for an unknown one."""
    if compute not in COMPUTE_MODELS:
        raise SpecError(f"--compute {compute!r}: expected one of {', '.join(COMPUTE_MODELS)}")
    if name == "local":
        if spec is None:
            return local_cluster(world_size=world_size)
        return local_cluster(spec.n_embd, min(spec.block_size, 256), spec.n_head, world_size,
                             spec=spec)
    if name not in PRESETS:
        raise SpecError(f"--cluster {name!r}: unknown preset; expected one of "
                        f"{', '.join(list(PRESETS) + ['local'])}")
    return PRESETS[name] if compute == "per-op" else FIXED_PRESETS[name]


CALIBRATION_WIDTH = 256  # a named size's block is timed at most this wide (see calibration_spec)


def calibration_spec(spec: ModelSpec, seq: int) -> ModelSpec:
    """One block of a named size's family to time on this machine: its own when at most
    ``CALIBRATION_WIDTH`` wide, else the same shape narrowed to about that width (the same
    heads and key/value heads, an even head dimension; the MLP and expert widths scaled
    by the same factor), so that ``shardwise plan --cluster local`` answers in seconds for
    any named size (Llama-3-8B's own block, 218M weights, took minutes at one thread;
    ``benchmarks/planner_local.py`` calibrates on the planned config's own block)."""
    spec = replace(spec, n_layer=1, block_size=max(seq, 1), n_params=None)
    if spec.n_embd <= CALIBRATION_WIDTH:
        return spec
    head = max(2, 2 * round(CALIBRATION_WIDTH / spec.n_head / 2))  # rotary pairs: even
    width = head * spec.n_head
    scale = width / spec.n_embd

    def narrowed(f: int | None) -> int | None:
        return None if f is None else max(1, round(f * scale))

    return replace(spec, n_embd=width, ffn_hidden=narrowed(spec.ffn_hidden),
                   moe_ffn_hidden=narrowed(spec.moe_ffn_hidden),
                   moe_shared_ffn=narrowed(spec.moe_shared_ffn) if spec.moe_shared_ffn else 0,
                   attention_width=None)


def calibration_block(width: int, seq: int, heads: int, spec: ModelSpec | None = None):
    """``(block, width, attention width)``: the first block of ``spec``'s model (its
    description's, or its family's built from the sizes with one layer), on the CPU with
    normal(0, 0.02) values from a private generator (timing only); without ``spec``, a
    block of shardwise's GPT of width ``width`` and ``heads`` heads."""
    import torch

    from shardwise.models.meta_init import materialise

    if spec is None:
        spec = ModelSpec("calibration", 1, width, heads, 65, seq)
    elif spec.description is None:  # a named size: one block of its family, scaled down
        spec = calibration_spec(spec, seq)
    d = spec.model()
    with torch.device("meta"):
        model = d.build()
    blk = d.layers(model)[1][1]
    materialise([blk], torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(0.0, 0.02, generator=g)
    return blk, d.hidden_size, d.attention_width


# The calibration's clock: this thread's CPU seconds (CLOCK_THREAD_CPUTIME_ID), so that the
# time other processes of a shared machine take from the core is not counted; one torch
# thread runs its CPU kernels, forward and backward, on the calling thread.
cpu_clock = time.thread_time


@lru_cache(maxsize=8)
def calibrate_local(width: int = 128, seq: int = 64, heads: int = 4,
                    spec: ModelSpec | None = None) -> dict:
    """Measure, with one torch thread (its CPU seconds, ``cpu_clock``), one block of the
    planned model (``calibration_block``: ``spec``'s, else shardwise's GPT of width
    ``width``; ``seq`` tokens per sequence),
    forward + backward at 1 and 8 sequences: the effective FLOP/s (the slope: matmuls and
    the memory-bound operations around them) and the fixed seconds per block pass (the
    intercept: dispatch, Python), the host optimizer step's seconds per parameter
    (``optimizer_seconds``: the engine's ``parallel.precision.fp32_step`` over the block's
    parameters, AdamW as the engine builds it on the CPU, its float64 norm and clipping
    included) and the raw matmul FLOP/s."""
    import torch
    from torch import nn

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        blk, width, attn = calibration_block(width, seq, heads, spec)
        matmul_params = sum(m.weight.numel() for m in blk.modules() if isinstance(m, nn.Linear))

        def timed(b: int) -> float:
            x = torch.randn(b, seq, width, requires_grad=True)
            times = []
            for _ in range(15):
                t0 = cpu_clock()
                blk(x).sum().backward()
                times.append(cpu_clock() - t0)
            return min(times)  # the undisturbed time: other processes only add to it

        timed(1)
        small, big = timed(1), timed(8)
        # per sequence, forward + backward: 2 per weight per token, Q K^T and P V (GPT: 24 s h^2)
        fl = 3 * (2 * seq * matmul_params + 4 * seq * seq * attn)
        rate = 7 * fl / max(big - small, 1e-9)
        overhead = max(0.0, small - fl / rate) / 3  # per pass (forward = 1, backward = 2)
        a, b = torch.randn(512, width), torch.randn(width, 4 * width)
        t0 = cpu_clock()
        for _ in range(10):
            a @ b
        matmul = 10 * 2 * 512 * width * 4 * width / (cpu_clock() - t0)
        opt = optimizer_step_seconds(list(blk.parameters()))
    finally:
        torch.set_num_threads(threads)
    return {"block_flops": rate, "overhead_s": overhead, "matmul_flops": matmul,
            "optimizer_param_s": opt / sum(p.numel() for p in blk.parameters()),
            "seq_flops": fl, "width": width, "seq": seq}


def optimizer_step_seconds(params: list) -> float:
    """The fastest of 7 host optimizer steps over copies of ``params`` (seconds, one
    thread): the engine's step on a rank's masters (``parallel.precision.fp32_step``: the
    float64 squared norm, clipping to 1.0, the engine's AdamW on the CPU:
    ``engine.optimizer.build_adamw``)."""
    import torch

    from shardwise.engine.optimizer import build_adamw
    from shardwise.parallel.precision import fp32_step

    masters = [torch.nn.Parameter(p.detach().clone()) for p in params]
    grads = [torch.randn_like(p) * 1e-3 for p in masters]
    opt = build_adamw(masters, [p.dim() >= 2 for p in masters], lr=1e-4)
    times = []
    for _ in range(8):
        t0 = cpu_clock()
        fp32_step(opt, masters, grads, "local", 1.0, None)
        times.append(cpu_clock() - t0)
    return min(times[1:])  # the first creates the moments


HOST_STEPS = ((2, 1), (2, 2))  # (sequences, micro-batches): the same tokens, one more pass
HOST_REPEATS = 16  # steps timed at each (the per-micro-batch seconds are a difference of two)


@lru_cache(maxsize=8)
def host_step_seconds(spec: ModelSpec, seq: int) -> dict:
    """The fastest of ``HOST_REPEATS`` training steps (this thread's CPU seconds, one torch
    thread) of a one-layer model of ``spec``'s family (``calibration_spec``: narrowed like the block
    timed) in one process, at each ``HOST_STEPS`` (sequences, micro-batches), on the CPU:
    ``({(b, m): seconds}, parameters of the model)``. The engine's whole step: the
    executor, embedding, head and loss, the block, the optimizer."""
    import torch

    from shardwise.base.topology import Topology
    from shardwise.engine import Engine, EngineConfig

    small = calibration_spec(spec, seq)
    out, n_params = {}, 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank runs (and no other thread's spinning counted)
    try:
        for b, m in HOST_STEPS:
            engine = Engine(small.model(), Topology.build(1, 1, 1, rank=0, world_size=1),
                            EngineConfig(seq_len=small.block_size,
                                         parallel={"micro_batches": m},
                                         training={"seed": 0, "global_batch_size": b}))
            g = torch.Generator().manual_seed(0)
            x = torch.randint(0, small.vocab_size, (b, small.block_size), generator=g)
            times = []
            for _ in range(HOST_REPEATS + 1):
                t0 = cpu_clock()
                engine.train_step(x, x)
                times.append(cpu_clock() - t0)
            out[(b, m)] = min(times[1:])  # the first creates the optimizer's moments
            n_params = sum(p.numel() for _, p in engine.named_parameters())
    finally:
        torch.set_num_threads(threads)
    return out, n_params


def host_seconds(spec: ModelSpec, seq: int, cal: dict) -> tuple[float, float]:
    """``(step_s, micro_batch_s)``: host seconds per step and per micro-batch that the
    block's and the optimizer's calibration (``cal``: ``calibrate_local``'s) do not hold,
    measured on this machine: one process's steps of a one-layer model of ``spec``'s family
    (``host_step_seconds``) on the same tokens in 1 and 2 micro-batches. Per micro-batch:
    the second less the first, less the one more pass of the block's fixed seconds the
    planner prices (forward and backward: 3 ``overhead_s``): the executor, the embedding's,
    the head's and the loss's dispatch. Per step: the first less the block's priced
    seconds (``seq_flops`` per sequence at ``block_flops``, and its fixed seconds), the
    optimizer's (``optimizer_param_s`` per parameter) and one micro-batch's: the step's
    Python, zeroing the gradients. Neither below 0."""
    got, n_params = host_step_seconds(spec, seq)
    (b, m1), (_, m2) = HOST_STEPS
    per_mb = max(0.0, (got[(b, m2)] - got[(b, m1)]) / (m2 - m1) - 3 * cal["overhead_s"])
    priced = (b * cal["seq_flops"] / cal["block_flops"] + m1 * 3 * cal["overhead_s"]
              + n_params * cal["optimizer_param_s"])
    return max(0.0, got[(b, m1)] - priced - m1 * per_mb), per_mb


SHARED_STEPS = 16  # timed steps per spawn of ``shared_seconds`` (after 2 untimed)
PROBE_QUANTILE = 5  # ``shared_seconds`` reads the step 1 / 5 of the way up the sorted steps
PROBE_LAYERS = 4  # the most blocks ``probe_spec``'s model has (its steps' seconds: ~0.1 s at 8)


def _probe_cp(world_size: int, seq: int) -> int:
    """The ring ``shared_seconds`` times: 4 ranks (10 messages a block's step), else 2 (4),
    where they divide ``world_size`` and ``seq`` cuts into 2 cp chunks; else 1 (none)."""
    return next((cp for cp in (4, 2) if world_size % cp == 0 and seq % (2 * cp) == 0), 1)


def _shared_probe(small: ModelSpec, cp: int) -> tuple[list[float], int]:
    """One spawned rank of ``shared_seconds``: the engine's steps of ``small`` (2 sequences
    a rank, one micro-batch) as dp = world size / ``cp`` and cp = ``cp`` (2 cp sequences a
    rank of 1 / cp the tokens: the same tokens), every rank at once: ``(the wall seconds
    of each step (all ranks start it together), the model's parameters)``."""
    import torch
    import torch.distributed as dist

    from shardwise import comm
    from shardwise.base.topology import Topology, init_process_groups
    from shardwise.engine import Engine, EngineConfig

    torch.set_num_threads(1)
    ws, rank = dist.get_world_size(), dist.get_rank()
    topo = init_process_groups(Topology.build(dp=ws // cp, cp=cp, rank=rank, world_size=ws))
    engine = Engine(small.model(), topo,
                    EngineConfig(seq_len=small.block_size,
                                 parallel={"micro_batches": 1, "dp": ws // cp, "cp": cp},
                                 training={"seed": 0, "global_batch_size": 2 * ws}))
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, small.vocab_size, (2 * cp, small.block_size), generator=g)
    walls = []
    for i in range(2 + SHARED_STEPS):
        comm.barrier()
        t0 = time.perf_counter()
        engine.train_step(x, x)
        if i >= 2:  # the first two create the optimizer's moments and warm the caches
            walls.append(time.perf_counter() - t0)
    return walls, sum(p.numel() for _, p in engine.named_parameters())


def probe_spec(spec: ModelSpec, seq: int) -> ModelSpec:
    """The model ``shared_seconds`` spawns: ``calibration_spec``'s block (narrowed where
    wide), ``spec``'s depth up to ``PROBE_LAYERS``. How much the ranks' sharing slows them
    depends on how much of a step is the block's compute: on the 4 x 128 GPT of
    ``benchmarks/layouts.py`` at 8 ranks on 2 cores the one-layer model's ratio (dp step
    over alone x ranks per core) was 1.97-2.39, the 4-layer model's 1.70-1.89
    (docs/planner.md), and the layouts trained ran as the latter predicted."""
    return replace(calibration_spec(spec, seq), n_layer=max(1, min(spec.n_layer,
                                                                   PROBE_LAYERS)))


def _probe_steps(small: ModelSpec, world_size: int, cp: int) -> tuple[list[float], int]:
    """``world_size`` ranks of ``_shared_probe`` spawned: per step the slowest rank's
    seconds, and the model's parameters."""
    from shardwise.launch import spawn

    # its ranks outnumber the cores on purpose: no warning that they do
    res = spawn(_shared_probe, world_size, (small, cp), threads=1, warn_shared_cores=False)
    return [max(r[0][i] for r in res) for i in range(len(res[0][0]))], res[0][1]


def shared_seconds(spec: ModelSpec, seq: int, cluster: "Cluster",
                   world_size: int) -> tuple[float, float]:
    """``(contention, ring_message_s)`` of ``world_size`` ranks on ``cluster`` (local),
    measured: gloo ranks (``launch.spawn``) each train ``probe_spec``'s model of ``spec``
    on 2 sequences, all at once (``_shared_probe``), in a spawn per layout: dp = world
    size three times, cp once (``_probe_cp``), and where the ranks outnumber the cores one
    rank alone twice. A layout's step: the steps' slowest rank, a fifth of the way up them
    sorted (``PROBE_QUANTILE``; a layout's spawns together).

    ``contention``: the dp step less the planner's price of its gradient all-reduce (the
    cluster's link, stretched by ``Cluster.comm_stretch``), over what the ranks' work
    alone would take on the shared cores (the one rank's step, times world size /
    cores); 1 where the ranks do not outnumber the cores.
    ``ring_message_s``: the cp step less the dp one, as dedicated-core seconds (times
    cores / world size, over ``contention``), over the ring's 3 cp - 2 messages a block's
    step (forward cp - 1, backward cp - 1 + cp; ``comm_price.ring_messages``) times the
    blocks; 0 where neither 4 nor 2 ranks divide the world size and the sequence.
    Neither below its floor (1, 0)."""
    small = probe_spec(spec, seq)
    share = world_size / cluster.cores
    # each layout in a spawn of its own, as a run is (ranks that also hold another layout's
    # process groups run 13-23% slower: benchmarks/local_probe.py); dp three times and the
    # rank alone twice, each beside the other, around cp: how a spawn's ranks happen to
    # share the cores moves its steps by several percent, and a burst of load that slows
    # one spawn seldom slows the next
    cp = _probe_cp(world_size, small.block_size)
    alone_too = share > 1  # contention: the same model's step with one rank alone
    order = [("dp", world_size, 1), ("alone", 1, 1), ("cp", world_size, cp),
             ("dp", world_size, 1), ("alone", 1, 1), ("dp", world_size, 1)]
    steps: dict[str, list[float]] = {}
    n_params = 0
    for name, ranks, c in order:
        if (name == "cp" and c == 1) or (name == "alone" and not alone_too):
            continue
        got, n_params = _probe_steps(small, ranks, c)
        steps.setdefault(name, []).extend(got)
    # per layout the steps' slowest rank, at the fifth of them that ran fastest (about the
    # fastest of 5: the statistic benchmarks/planner_local.py measures, steadier than the min)
    wall = {k: sorted(v)[len(v) // PROBE_QUANTILE] for k, v in steps.items()}
    contention = 1.0
    if alone_too:
        sync = (cluster.comm_stretch(world_size, world_size)
                * cluster.intra.all_reduce(world_size, 4 * n_params))
        contention = max(1.0, (wall["dp"] - sync) / (wall["alone"] * share))
    ring = 0.0
    if "cp" in wall:  # a block's messages, forward cp - 1, backward cp - 1 + cp
        ring = max(0.0, (wall["cp"] - wall["dp"]) / max(1.0, share) / contention
                   / ((3 * cp - 2) * small.n_layer))
    return contention, ring


def family_sized(spec: ModelSpec) -> ModelSpec | None:
    """A described ``spec`` as its family's sizes (``description`` dropped, so that
    ``ModelSpec.model`` builds it from them, one layer at a time where narrowed), where
    those build the model it describes: the spec of the model the sizes build
    (``ModelSpec.from_description``) equals ``spec`` (a TOML's plain ``[model]``); None
    where it does not (sandwich norms, latent attention, windows... that the sizes do not
    hold) or the sizes build nothing."""
    sized = replace(spec, description=None)
    try:
        rebuilt = ModelSpec.from_description(sized.model(), name=spec.name)
    except (ValueError, KeyError, TypeError):  # SpecError is a ValueError
        return None
    return sized if replace(rebuilt, n_params=None) == replace(spec, n_params=None) else None


def local_cluster(width: int = 128, seq: int = 64, heads: int = 4,
                  world_size: int = 1, spec: ModelSpec | None = None) -> Cluster:
    """This machine: compute and the optimizer step measured on a block of the planned
    model (``spec``'s, else a GPT's of the planned width; ranks sharing the cores equally),
    the host's seconds per step and micro-batch measured on a one-layer model of its family
    (``host_seconds``), the comm profile's links (gloo over loopback; one "node"; their
    prices stretched where ranks share the cores: ``Cluster.comm_stretch``), and at
    ``world_size`` > 1 how the ranks' sharing of the cores slows their work and what each
    message of the cp ring costs (``shared_seconds``: ``world_size`` ranks spawned for a
    few steps)."""
    cal = dict(calibrate_local(width, seq, heads, spec))
    prof = cost.active_profile()
    from shardwise.comm import shm

    # what the engine calls here: tensor-parallel layers gloo's own all-reduce
    # (tensor_parallel.RankGroup's "native"); the gradient sync parallel.allreduce = "auto",
    # which comm.api.choose makes the cheapest by the profile, shared memory among them when
    # the ranks share a host (shm.available)
    link = Link("loopback (comm profile)", profile=prof, algorithm="auto",
                extra=("shm",) if shm.available() else (), tp_algorithm="native")
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 8 * GiB
    cores = os.cpu_count() or 1
    out = Cluster("local", f"CPU ({cores} cores)", cal["block_flops"], float(mem), 1 << 20,
                  link, link, efficiency=1.0, mem_bw=MEMCPY_LOCAL, overhead_s=cal["overhead_s"],
                  precision="fp32",
                  source=f"measured now; comm profile {prof.name}", cores=cores,
                  zero3_overlap=False, optimizer_param_s=cal["optimizer_param_s"], meta=cal)
    if spec is None:
        spec = ModelSpec("calibration", 1, width, heads, 65, seq)
    sized = spec if spec.description is None else family_sized(spec)
    if sized is not None:  # a family's sizes: its one-layer model is built here
        cal["step_s"], cal["micro_batch_s"] = host_seconds(sized, seq, cal)
        out = replace(out, step_s=cal["step_s"], micro_batch_s=cal["micro_batch_s"])
        if world_size > 1:  # the ranks' sharing of the cores, and the ring's messages
            cal["contention"], cal["ring_message_s"] = shared_seconds(sized, seq, out,
                                                                      world_size)
            out = replace(out, contention=cal["contention"],
                          ring_message_s=cal["ring_message_s"])
    return out


def check_finite(value: float, what: str) -> float:
    """``value`` when it is a finite number above 0; raises SpecError naming ``what`` otherwise."""
    if not math.isfinite(value) or value <= 0:
        raise SpecError(f"{what}: expected a finite number > 0, got {value!r}")
    return value
