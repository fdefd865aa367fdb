"""A layout: one point of the planner's search (sizes, micro-batching, schedule, memory
options), as ``simulate`` prices it and ``shardwise plan`` prints and emits it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """One point of the search: sizes, micro-batching, schedule and memory options."""

    dp: int
    tp: int
    pp: int
    micro_batch_size: int  # sequences per micro-batch
    micro_batches: int     # micro-batches per step (per dp replica)
    schedule: str = "1f1b"
    chunks_per_rank: int = 1  # model chunks per pipeline rank (interleaved: v)
    zero: int = 0
    # True: the executor's per stage; "full": the engine's per block; "selective": op-level
    recompute: bool | str = False
    sp: bool = False
    partition: str = "layers"  # how the engine cuts layers into chunks: layers or params
    selective: bool = False  # recompute only the attention core (Korthikanti et al. 2022)
    cp: int = 1  # context-parallel ranks per sequence (s / cp tokens each)
    ep: int = 1  # expert-parallel ranks, folded over dp (ep divides dp)
    fp8: bool = False  # linear-layer GEMMs in FP8 (Cluster.fp8_flops; bf16 where None)
    dp_replicate: int = 1  # HSDP replicas: ZeRO over dp / dp_replicate, a mean across them
    cp_a2a: int = 1  # cp's all-to-all degree A (parallel.cp_heads): 1 ring, cp all-to-all

    @property
    def cp_comm(self) -> str:
        """``parallel.cp_comm`` of the layout: ring, all_to_all or hybrid."""
        return ("ring" if self.cp_a2a == 1 else "all_to_all" if self.cp_a2a == self.cp
                else "hybrid")

    @property
    def cp_ring(self) -> int:
        """Ranks of the ring across the all-to-all's head groups (cp / cp_a2a)."""
        return self.cp // self.cp_a2a

    @property
    def world(self) -> int:
        """Ranks the layout uses: dp x tp x pp x cp (ep is folded over dp)."""
        return self.dp * self.tp * self.pp * self.cp

    def label(self) -> str:
        """The short name ``shardwise plan`` prints (``dp2 tp4 pp2 mb1 m8 1f1b z1 sp``)."""
        v = self.chunks_per_rank
        sched = "" if self.pp == 1 else (f" {self.schedule}" + (f" v{v}" if v > 1 else ""))
        rc = {"selective": " rc=sel", "full": " rc=blk"}.get(self.recompute,
                                                         " rc" if self.recompute else "")
        extra = rc + (" rc=attn" if self.selective else "") + (
            "" if not self.sp else " sp") + (
            " cut=params" if self.partition == "params" and self.pp > 1 else "") + (
            " fp8" if self.fp8 else "")
        ep = (f" hsdp{self.dp_replicate}" if self.dp_replicate > 1 else "") + (
            f" ep{self.ep}" if self.ep > 1 else "")
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        if self.cp_a2a > 1:
            cp += " a2a" if self.cp_a2a == self.cp else f"=a2a{self.cp_a2a}xring{self.cp_ring}"
        return (f"dp{self.dp}{ep} tp{self.tp} pp{self.pp}{cp} mb{self.micro_batch_size} "
                f"m{self.micro_batches}{sched} z{self.zero}{extra}")
