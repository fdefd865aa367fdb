"""Helpers of the safety and fault tests: rank functions and process / socket inspection."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket process ``pid`` listens on (Linux /proc)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            f = line.split()
            local, state, inode = f[1], f[3], f[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            out.append((_address(hex_addr, width), int(hex_port, 16)))
    return out


def _address(hex_addr: str, width: int) -> str:
    if width == 8:  # little-endian IPv4
        return ".".join(str(int(hex_addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
    words = [hex_addr[i:i + 8] for i in range(0, 32, 8)]
    raw = b"".join(bytes.fromhex(w)[::-1] for w in words)
    if raw[:12] == b"\0" * 10 + b"\xff\xff":
        return ".".join(str(b) for b in raw[12:])
    import ipaddress

    return str(ipaddress.IPv6Address(raw))


def rank_sockets() -> dict:
    """Rank function: after the process group is up (and a collective ran), what this rank
    listens on."""
    import torch

    from shardwise import comm

    t = torch.ones(1)
    comm.all_reduce(t)
    return {"rank": dist.get_rank(), "sum": t.item(),
            "listening": [list(a) for a in listening_sockets(os.getpid())]}


def children_of(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc/*/stat)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out.append(int(d.name))
    return out


def descendants_of(pid: int) -> list[int]:
    """Pids below ``pid``: its children, theirs, and so on."""
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def trainer_for(cfg_dict: dict):
    """A single-process ``Trainer`` (no torch.distributed) for ``cfg_dict``."""
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.base.config import Config

    return build_trainer(Config.from_dict(cfg_dict))


def train_saving(cfg_dict: dict, at: tuple[int, ...]) -> dict:
    """Train ``training.steps`` steps in one process, saving after each step in ``at``;
    return the final parameters."""
    trainer = trainer_for(cfg_dict)
    while trainer.step < trainer.cfg.training.steps:
        trainer.train_step()
        if trainer.step in at:
            trainer.save_checkpoint()
    return {n: p.detach().clone() for n, p in trainer.engine.named_parameters()}


def raise_run_error() -> None:
    """Rank function: fail the way a NaN loss does (a ``RunError``)."""
    from shardwise.base.errors import NonFiniteLossError

    raise NonFiniteLossError(f"training loss is nan at step 3 (rank {dist.get_rank()})")


def where_am_i(tag: str) -> dict:
    """Rank function: this rank's parent and its view of ``$SHARDWISE_TEST_MARK``, after one
    line printed to standard output and one to standard error (with a ``tag``)."""
    if tag:
        print(f"rank {dist.get_rank()} stdout {tag}", flush=True)
        print(f"rank {dist.get_rank()} stderr {tag}", file=sys.stderr, flush=True)
    return {"ppid": os.getppid(), "mark": os.environ.get("SHARDWISE_TEST_MARK", "")}
