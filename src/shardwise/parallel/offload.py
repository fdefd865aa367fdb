"""Host <-> device copies of ``training.offload``, on a side stream on CUDA.

ZeRO-Offload (Ren et al. 2021) moves gradients device to host and parameters host to
device while the device computes. On CUDA every ``Transfers`` of a device queues its copies
on one side stream, ordered against the compute stream (the current one) by torch's rules
(docs: "CUDA semantics", stream semantics): a stream reads what another wrote only after
waiting for it (``wait_stream``); a tensor made on one stream and used on another is
``record_stream``ed, so the caching allocator does not reuse its memory while the other may
still use it; the host reads or writes the pinned memory of a copy only after
``synchronize``. Elsewhere (CPU, meta) the same calls are plain copies, or nothing when the
tensor is already where it is asked for, and ``wait`` does nothing: the CPU tests run this
code, without the stream.
"""

from __future__ import annotations

import functools

import torch

# Host memory: the CPU by definition, whatever the run's device.
HOST = torch.device("cpu")


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per CUDA device for the whole process, so every copy of the run is
    ordered on it (a host wait on it covers them all)."""
    return torch.cuda.Stream(device)


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index ("cuda" is the current CUDA device)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Transfers:
    """Copies between host memory and ``device`` (module docstring)."""

    def __init__(self, device: torch.device):
        self.device = _indexed(torch.device(device))

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The side stream (CUDA), made on first use; None elsewhere."""
        return _side_stream(self.device) if self.device.type == "cuda" else None

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the device (itself when it is there already), same shape and dtype.
        CUDA: copied on the side stream, overlapping the work the compute stream has queued;
        what the compute stream queues after this call runs after the copy."""
        if _indexed(host.device) == self.device:
            return host
        if self.stream is None:
            return host.to(self.device)
        compute, side = torch.cuda.current_stream(self.device), self.stream
        with torch.cuda.stream(side):  # its memory from the side stream's pool
            out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            out.copy_(host, non_blocking=host.is_pinned())
        out.record_stream(compute)  # read there (and by the collective's own stream)
        compute.wait_stream(side)
        return out

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` copied into host memory (pinned on CUDA; ``t`` itself when it is on the host);
        read the result only after ``wait()``. CUDA: on the side stream, after what the
        compute stream has queued (which writes ``t``), overlapping what it queues next."""
        if t.device == HOST:
            return t
        if t.device.type != "cuda":
            return t.to(HOST)
        side = self.stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            out = torch.empty(t.shape, dtype=t.dtype, device=HOST, pin_memory=True)
            out.copy_(t, non_blocking=True)
        t.record_stream(side)  # t may be freed on the compute stream before the copy ran
        return out

    def wait(self) -> None:
        """The host waits for every copy queued on the side stream so far (before it reads
        what ``to_host`` returned or writes host memory ``to_device`` read)."""
        if self.device.type == "cuda":
            self.stream.synchronize()
