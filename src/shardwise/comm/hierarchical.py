"""Where the ranks of a group live, and the hierarchical all-reduce for groups that span hosts.

Host of a rank: ``$SHARDWISE_HOST_ID`` if set (any string; set it per rank to fake hosts on
one machine, as the tests do), else torchrun's node rank ``$GROUP_RANK`` (with
``$TORCHELASTIC_RUN_ID``, so it is torchrun's), else the machine's host name. The group's
layout is exchanged once per group (a ring all-gather of one int64 per rank) and cached.

Hierarchical all-reduce (the two-level scheme of NCCL / Horovod's hierarchical allreduce,
Sergeev & Del Balso 2018): with H hosts of L ranks each, group ranks on one host in group
order get local index l = 0..L-1.

    1. reduce-scatter inside the host on shared memory: local rank l holds slice l of the
       host's sum (``balanced_bounds(numel, L)``), reduced in local order;
    2. ring reduce-scatter + all-gather of slice l across the H ranks with local index l
       (Patarasuk & Yuan 2009; "mean" divides once, by N = H L, on the owner);
    3. all-gather of the slices inside the host on shared memory.

Bytes: those of the shared-memory steps (see ``shm``) plus the ring's on the host's slice:
2 (H-1)/H X/L sent per rank across hosts, where a flat ring sends 2 (N-1)/N X. All ranks end
bitwise identical (every element is reduced once and copied). Hosts must hold equally many
ranks of the group; otherwise ``layout(...).uniform`` is False and ``auto`` does not pick it.
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass

import torch

from shardwise.comm import ring, shm
from shardwise.comm.primitives import Call, CommError, GroupInfo, balanced_bounds, finish_
from shardwise.comm.shm_segment import backend_group


def host_id() -> str:
    """This process's host, as the layout sees it (see the module docstring)."""
    env = os.environ.get("SHARDWISE_HOST_ID")
    if env:
        return env
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("GROUP_RANK"):
        return f"node{os.environ['GROUP_RANK']}"
    return socket.gethostname()


def _key(s: str) -> int:
    return int.from_bytes(hashlib.sha1(s.encode()).digest()[:7], "little")


@dataclass(frozen=True)
class Layout:
    """Group ranks per host, hosts in order of their first group rank."""

    hosts: tuple[tuple[int, ...], ...]  # group ranks of each host
    host: int                           # this rank's host index
    local: int                          # this rank's index among its host's ranks

    @property
    def one_host(self) -> bool:
        """True when every rank of the group is on one host."""
        return len(self.hosts) == 1

    @property
    def uniform(self) -> bool:
        """True when every host holds the same number of the group's ranks."""
        return len({len(h) for h in self.hosts}) == 1


_layouts: dict[tuple[int, ...], tuple[object, Layout]] = {}


def layout(info: GroupInfo) -> Layout:
    """The hosts of ``info``'s ranks (collective on first use per group, then cached)."""
    pg = backend_group(info)
    entry = _layouts.get(info.ranks)
    lay = entry[1] if entry is not None and entry[0] is pg else None
    if lay is None:
        n = info.size
        keys = torch.zeros(n, dtype=torch.int64)
        keys[info.rank] = _key(host_id())
        if n > 1:
            call = Call("host_layout", "ring", info, keys.numel() * 8, torch.int64)
            ring.all_gather(call, keys, list(range(n + 1)))
            call.close()
        order: dict[int, list[int]] = {}
        for g, k in enumerate(keys.tolist()):
            order.setdefault(k, []).append(g)
        hosts = tuple(tuple(v) for v in order.values())
        h = next(i for i, v in enumerate(hosts) if info.rank in v)
        lay = Layout(hosts, h, hosts[h].index(info.rank))
        _layouts[info.ranks] = (pg, lay)
    return lay


def subgroups(info: GroupInfo, lay: Layout) -> tuple[GroupInfo, GroupInfo]:
    """(this host's ranks, the ranks with this local index on every host) as GroupInfos of
    the parent's ProcessGroup (p2p and setup take global ranks)."""
    local = tuple(info.ranks[g] for g in lay.hosts[lay.host])
    cross = tuple(info.ranks[h[lay.local]] for h in lay.hosts)
    return (GroupInfo(info.group, local, lay.local), GroupInfo(info.group, cross, lay.host))


def all_reduce(call: Call, buf: torch.Tensor, op: str) -> int:
    """Hierarchical all-reduce of the flat ``buf`` in place (see the module docstring)."""
    info = call.info
    lay = layout(info)
    if not lay.uniform:
        raise CommError(f"{call._where()}: hosts hold different numbers of the group's ranks "
                        f"({[len(h) for h in lay.hosts]}); use another algorithm")
    local, cross = subgroups(info, lay)
    seg = shm.segment(local) if local.size > 1 else None
    red = "sum" if op == "mean" else op
    bounds = balanced_bounds(buf.numel(), local.size)
    step = shm.reduce_scatter(seg, call, buf, bounds, red) if seg else 0
    mine = buf[bounds[local.rank]:bounds[local.rank + 1]]
    if cross.size > 1:
        sub = Call(call.name, call.algorithm, cross, 0, account=False)
        sub.record, sub.deadline, sub.label = call.record, call.deadline, call.label
        cb = balanced_bounds(mine.numel(), cross.size)
        step = ring.reduce_scatter(sub, mine, cb, red, step, finish=False)
        finish_(mine[cb[cross.rank]:cb[cross.rank + 1]], op, info.size)
        step = ring.all_gather(sub, mine, cb, step)
        sub.record = None
    else:
        finish_(mine, op, info.size)
    return shm.all_gather(seg, call, buf, bounds, step) if seg else step
