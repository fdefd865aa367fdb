"""All-to-all with uneven splits: every rank sends a block of rows to every other.

``all_to_all_single(output, input, output_split_sizes, input_split_sizes)`` has
``torch.distributed.all_to_all_single``'s semantics: ``input`` is cut along dim 0 into N
blocks of ``input_split_sizes[j]`` rows (even blocks when None), block j goes to group rank
j, and ``output`` receives, along dim 0, group rank i's block for this rank in rank order
(``output_split_sizes[i]`` rows). The rows' other dims (the "row width") must agree on
every rank. ``all_to_all(output_list, input_list)`` is the list form: ``input_list[j]`` to
rank j, ``output_list[i]`` from rank i, any sizes (it runs as one ``all_to_all_single`` on
the flattened tensors).

This is the token dispatch and combine of expert parallelism (GShard, Lepikhin et al. 2020,
arXiv:2006.16668, section 3; DeepSpeed-MoE, Rajbhandari et al. 2022; Megatron-Core's
``MoEAlltoAllTokenDispatcher``): with dropless routing the splits are the token counts per
expert, known only at run time, hence uneven.

Algorithms (``ALL_TO_ALL_ALGORITHMS``): ``pairwise`` (N-1 steps, step s sending to
(r + s) mod N while receiving from (r - s) mod N: Thakur, Rabenseifner & Gropp 2005, section
3.5), ``linear`` (every message posted at once, MPICH's medium-message all-to-all) and
``native`` (the backend's). Ours send exactly ``sum_{j != r} b_j`` bytes per rank (b_j: the
bytes r sends to j; the own block is copied locally and counted nowhere); ``X`` (the
record's ``nbytes``) is the input's size in bytes. With the argument check
(``settings.check``) the ranks swap their split sizes first: a mismatch raises the same
``CommError`` on every rank naming a pair (gloo would abort the process). Table and
measurements: docs/comm.md, "Algorithms and their costs".
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.base.config import ALL_TO_ALL_ALGORITHMS  # one list, read by the config too
from shardwise.comm import check as _check
from shardwise.comm.api import _agree, _call, _Flat, _launch, _pick, _tensor
from shardwise.comm.primitives import (
    Call,
    CommError,
    GroupInfo,
    group_info,
    native_buffer,
    settings,
)


def _offsets(sizes: list[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def _splits(sizes, rows: int, n: int, what: str) -> list[int]:
    """Split sizes in rows: ``sizes`` checked (N non-negative ints summing to ``rows``), or
    even blocks when None."""
    if sizes is None:
        if rows % n:
            raise ValueError(f"all_to_all: dim 0 of {what} ({rows} rows) is not divisible by "
                             f"the group size {n}; give {what}_split_sizes")
        return [rows // n] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or min(sizes, default=0) < 0 or sum(sizes) != rows:
        raise ValueError(f"all_to_all: {what}_split_sizes={sizes} must be {n} sizes >= 0 "
                         f"summing to dim 0 of {what} ({rows} rows)")
    return sizes


def pairwise(call: Call, src: torch.Tensor, s_off: list[int], dst: torch.Tensor,
             d_off: list[int]) -> int:
    """Pairwise exchange (see module docstring) on flat buffers: rank j's block of ``src`` is
    ``src[s_off[j]:s_off[j+1]]``, rank i's block of ``dst`` is ``dst[d_off[i]:d_off[i+1]]``.
    Returns the number of steps."""
    n, r = call.size, call.rank
    dst[d_off[r]:d_off[r + 1]].copy_(src[s_off[r]:s_off[r + 1]])
    for s in range(1, n):
        to, frm = (r + s) % n, (r - s) % n
        call.exchange(s, sends=[(to, src[s_off[to]:s_off[to + 1]])],
                      recvs=[(frm, dst[d_off[frm]:d_off[frm + 1]])])
    return n - 1


def linear(call: Call, src: torch.Tensor, s_off: list[int], dst: torch.Tensor,
           d_off: list[int]) -> int:
    """Every block posted at once, one round (see module docstring)."""
    n, r = call.size, call.rank
    dst[d_off[r]:d_off[r + 1]].copy_(src[s_off[r]:s_off[r + 1]])
    others = [p for p in range(n) if p != r]
    call.exchange(1, sends=[(p, src[s_off[p]:s_off[p + 1]]) for p in others],
                  recvs=[(p, dst[d_off[p]:d_off[p + 1]]) for p in others])
    return 1


_ALGORITHMS = {"pairwise": pairwise, "linear": linear}


def agree_splits(info: GroupInfo, where: str, send_rows: list[int], recv_rows: list[int],
                 device) -> None:
    """Raise the same ``CommError`` on every rank unless, for every pair (i, j), the rows i
    sends to j are the rows j expects from i. One pairwise swap of the sizes (accounted as
    "check"), then ``check.agree`` on the verdict, so a mismatch seen by one rank stops all."""
    n, r = info.size, info.rank
    mine = torch.tensor(send_rows, dtype=torch.int64, device=device)
    theirs = torch.empty(n, dtype=torch.int64, device=device)
    call = Call("check", "pairwise", info, 8 * n, torch.int64, label=f"{where} split check")
    pairwise(call, mine, list(range(n + 1)), theirs, list(range(n + 1)))
    call.close()
    got = theirs.tolist()
    bad = [i for i in range(n) if got[i] != recv_rows[i]]
    verdict = [0 if not bad else 1 + bad[0], 0 if not bad else got[bad[0]]]
    verdict += [0] * (len(_check.FIELDS) - len(verdict))  # agree's fixed message shape
    try:
        _check.agree(info, where, verdict, device=device)
    except CommError:
        bad = bad or [-1]
    if bad:
        i = bad[0]
        detail = (f"rank {info.ranks[i]} sends {got[i]} rows to rank {info.global_rank}, "
                  f"which expects {recv_rows[i]}" if i >= 0 else
                  "another rank's split sizes disagree with its peer's")
        raise CommError(f"{where} on rank {info.global_rank} (group rank {r} of {n}): split "
                        f"sizes disagree: {detail}")


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group=None,
                      async_op: bool = False, algorithm: str = "native",
                      check: bool | None = None):
    """Scatter ``input``'s dim-0 blocks to the group's ranks and gather theirs into ``output``
    (see module docstring). ``input`` (S, *w) and ``output`` (R, *w): the same row shape
    ``w`` and dtype; S = sum of ``input_split_sizes``, R = sum of ``output_split_sizes``
    (None: even blocks of S / N and R / N rows). ``output`` is overwritten in place.
    Raises ``ValueError`` / ``TypeError`` for bad arguments on this rank, ``CommError`` when
    ranks disagree (argument check on), ``CommTimeoutError`` after the configured timeout.
    ``check`` overrides ``settings.check`` for this call."""
    _tensor(output, "all_to_all", "output")
    _tensor(input, "all_to_all", "input")
    info = group_info(group, "all_to_all")
    algo = _pick(algorithm, ALL_TO_ALL_ALGORITHMS, "all_to_all")
    if input.dim() == 0 or output.dim() == 0:
        raise ValueError("all_to_all: input and output need a dim 0 to split")
    if tuple(input.shape[1:]) != tuple(output.shape[1:]) or input.dtype != output.dtype:
        raise ValueError(f"all_to_all: input {tuple(input.shape)} {input.dtype} and output "
                         f"{tuple(output.shape)} {output.dtype} need the same row shape and "
                         "dtype")
    n = info.size
    s_rows = _splits(input_split_sizes, input.shape[0], n, "input")
    d_rows = _splits(output_split_sizes, output.shape[0], n, "output")
    width = torch.Size(input.shape[1:]).numel()  # elements per row
    do_check = _check_enabled(check)

    def run() -> None:
        _agree(info, "all_to_all", algo, "-", input, width, enabled=do_check)
        if do_check and n > 1:
            agree_splits(info, f"all_to_all({algo})", s_rows, d_rows, input.device)
        out = _Flat(output)
        src = input.detach().contiguous().view(-1)
        if n == 1:
            out.flat.copy_(src)
        elif width:
            call = _call("all_to_all", algo, info, input)
            if algo == "native":
                sbuf, _ = native_buffer(group, src)
                dbuf, done = native_buffer(group, out.flat, fill=False)
                call.wait_native(dist.all_to_all_single(
                    dbuf.view(output.shape[0], width), sbuf.view(input.shape[0], width),
                    d_rows, s_rows, group=group, async_op=True))
                done()
            else:
                _ALGORITHMS[algo](call, src, _offsets([s * width for s in s_rows]), out.flat,
                                  _offsets([d * width for d in d_rows]))
            call.close()
        out.done()

    return _launch(run, async_op, "all_to_all", (output,))


def _check_enabled(check: bool | None) -> bool:
    return settings.check if check is None else bool(check)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group=None, async_op: bool = False, algorithm: str = "native",
               check: bool | None = None):
    """``output_tensor_list[i]`` receives group rank i's ``input_tensor_list[this rank]``;
    any sizes, one dtype. Runs as one ``all_to_all_single`` on the flattened tensors (gloo's
    own list all-to-all takes equal sizes only), then copies each block into its tensor."""
    info = group_info(group, "all_to_all")
    n = info.size
    for what, lst in (("input_tensor_list", input_tensor_list),
                      ("output_tensor_list", output_tensor_list)):
        if len(lst) != n:
            raise ValueError(f"all_to_all: {what} must hold {n} tensors, got {len(lst)}")
        for i, t in enumerate(lst):
            _tensor(t, "all_to_all", f"{what}[{i}]")
    dtypes = {t.dtype for t in (*input_tensor_list, *output_tensor_list)}
    if len(dtypes) != 1:
        raise ValueError(f"all_to_all: every tensor needs one dtype, got {sorted(map(str, dtypes))}")
    flat_in = torch.cat([t.detach().reshape(-1) for t in input_tensor_list])
    flat_out = torch.empty(sum(t.numel() for t in output_tensor_list), dtype=flat_in.dtype,
                           device=flat_in.device)
    handle = all_to_all_single(flat_out, flat_in, [t.numel() for t in output_tensor_list],
                               [t.numel() for t in input_tensor_list], group, True, algorithm,
                               check)

    def unpack() -> None:
        handle.wait()
        off = 0
        for t in output_tensor_list:
            t.copy_(flat_out[off:off + t.numel()].view_as(t))
            off += t.numel()

    if async_op:
        from shardwise.comm.async_ import executor
        return executor.submit(unpack)
    unpack()
    return None
