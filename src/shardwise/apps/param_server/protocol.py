"""Messages between workers and servers: a fixed header, then an optional fp32 payload.

Every message is sent with ``shardwise.comm.send`` / ``recv`` (so its bytes are counted).
A header is 4 int64: ``(kind, worker, clock, version)``. Requests (worker -> server) use tag
``TAG_REQUEST``, replies (server -> worker) ``TAG_REPLY``; messages between one pair match
in posting order, so a header and its payload always arrive together.

Requests:
  PULL (worker, clock, version): the weights, once the consistency rule lets a worker at
      ``clock`` read; ``version`` is the server version the worker holds, and an unchanged
      range is answered without payload.
  PUSH (worker, clock, -): followed by the gradient of the server's range (fp32).
  DONE (worker, clocks, -): the worker has finished; worker 0 then receives FINAL.
Replies:
  WEIGHTS (-, clock, version) + the range's weights; UNCHANGED (-, clock, version);
  FINAL (-, applied, version) + the final weights.
"""

from __future__ import annotations

import torch

from shardwise import comm

PULL, PUSH, DONE = 1, 2, 3
WEIGHTS, UNCHANGED, FINAL = 11, 12, 13
TAG_REQUEST, TAG_REPLY = 71, 72
HEADER_NUMEL = 4


def header(kind: int, worker: int, clock: int, version: int,
           device: torch.device | None = None) -> torch.Tensor:
    """A header tensor, shape (4,) int64, on ``device``."""
    return torch.tensor([kind, worker, clock, version], dtype=torch.int64, device=device)


def send_header(dst: int, tag: int, kind: int, worker: int, clock: int, version: int,
                device: torch.device | None = None) -> None:
    """Send the header (``kind``, ``worker``, ``clock``, ``version``) to rank ``dst`` with ``tag``.
    """
    comm.send(header(kind, worker, clock, version, device), dst, tag=tag)


def recv_header(src: int, tag: int, device: torch.device | None = None) -> tuple[int, ...]:
    """Block until the next header from global rank ``src``; returns its 4 ints."""
    buf = torch.empty(HEADER_NUMEL, dtype=torch.int64, device=device)
    comm.recv(buf, src, tag=tag)
    return tuple(int(v) for v in buf.tolist())
