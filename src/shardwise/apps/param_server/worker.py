"""A worker rank's side of the protocol: pull weights, push gradients, finish.

The model's parameters and gradients are views into two flat fp32 buffers in key order
(``partition.keys_of``), so a pull receives server i's range straight into the weights and
a push sends server i's slice of the gradients without copies.
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.apps.param_server import protocol as P
from shardwise.apps.param_server.partition import KeyRanges


class Worker:
    """Worker ``index`` talking to servers at global ranks ``server_ranks``.

    ``versions[i]`` is the version of server i's range held here (-1: none yet, so the
    first pull always fetches the weights, which is also how a new worker joins).
    """

    def __init__(self, index: int, model: torch.nn.Module, part: KeyRanges,
                 server_ranks: list[int]):
        self.index, self.part, self.server_ranks = index, part, list(server_ranks)
        params = list(model.parameters())
        device = params[0].device
        self.flat = torch.cat([p.detach().reshape(-1).float() for p in params])
        self.grad = torch.zeros_like(self.flat)
        for p, k in zip(params, part.keys):  # keys are in parameters() order
            p.data = self.flat[k.lo:k.hi].view(k.shape)
            p.grad = self.grad[k.lo:k.hi].view(k.shape)
        self.device = device
        self.versions = [-1] * len(self.server_ranks)
        self.pulled_bytes = 0

    def _slice(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        lo, hi = self.part.bounds(i)
        return buf[lo:hi]

    def pull(self, clock: int) -> int:
        """Ask every server for its range for ``clock``; block until all answered (under
        BSP/SSP a server answers once the rule allows). Returns how many ranges changed."""
        for i, dst in enumerate(self.server_ranks):
            P.send_header(dst, P.TAG_REQUEST, P.PULL, self.index, clock, self.versions[i],
                          self.device)
        changed = 0
        for i, src in enumerate(self.server_ranks):
            kind, _, _, version = P.recv_header(src, P.TAG_REPLY, self.device)
            if kind == P.WEIGHTS:
                comm.recv(self._slice(self.flat, i), src, tag=P.TAG_REPLY)
                changed += 1
            elif kind != P.UNCHANGED:
                raise RuntimeError(f"worker {self.index}: unexpected reply {kind} from rank {src}")
            self.versions[i] = version
        return changed

    def push(self, clock: int) -> None:
        """Send every server its slice of the gradient of ``clock``."""
        for i, dst in enumerate(self.server_ranks):
            P.send_header(dst, P.TAG_REQUEST, P.PUSH, self.index, clock, 0, self.device)
            comm.send(self._slice(self.grad, i), dst, tag=P.TAG_REQUEST)

    def finish(self, clocks: int, final: bool) -> None:
        """Tell the servers this worker is done; with ``final``, receive the final weights
        (every server sends them once all workers are done or dropped)."""
        for dst in self.server_ranks:
            P.send_header(dst, P.TAG_REQUEST, P.DONE, self.index, clocks, 0, self.device)
        if final:
            for i, src in enumerate(self.server_ranks):
                kind, _, _, version = P.recv_header(src, P.TAG_REPLY, self.device)
                if kind != P.FINAL:
                    raise RuntimeError(f"worker {self.index}: expected FINAL from rank {src}")
                comm.recv(self._slice(self.flat, i), src, tag=P.TAG_REPLY)
                self.versions[i] = version
