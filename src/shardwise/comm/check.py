"""Cross-rank argument check run before a collective moves any data.

Every rank contributes a fingerprint (collective, algorithm, op, dtype, numel, root, group,
call number). A dissemination pattern (Hensgen, Finkel & Manber 1988: in round k rank r
sends to r + 2^k and receives from r - 2^k, mod N) spreads, for each field, the smallest and
the largest value and the lowest rank holding each. Min and max are idempotent, so after
ceil(log2 N) rounds every rank holds the global extremes, every rank sees the same verdict,
and either all proceed or all raise the same ``CommError`` naming two ranks that disagree.

Every message is the same 4 x 9 int64 tensor whatever the group, so even ranks that disagree
on the group size never send a message larger than its receive buffer (which would make gloo
abort the process); they at worst wait for each other until the timeout.
"""

from __future__ import annotations

import torch

from shardwise.comm.primitives import Call, CommError, GroupInfo

FIELDS = ("call", "collective", "algorithm", "op", "dtype", "numel", "root", "group_size",
          "group")

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather",
               "scatter", "barrier", "all_to_all")
ALGORITHM_CODES = ("native", "naive", "sequential", "ring", "halving_doubling", "tree",
                   "parallel", "recursive_doubling", "recursive_halving", "linear",
                   "dissemination", "shm", "hierarchical", "pairwise")
OPS = ("sum", "mean", "max", "min", "-")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
          torch.complex128)

_calls: dict[tuple[int, ...], int] = {}


def group_device(group) -> torch.device:
    """The device a tensor must be on to cross ``group``: the current CUDA device for NCCL,
    the CPU otherwise."""
    import torch.distributed as dist

    try:
        backend = dist.get_backend(group)
    except (RuntimeError, ValueError):
        backend = "gloo"
    if "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")  # call counter per group (keyed by its global ranks)


def _code(table, value) -> int:
    return table.index(value) if value in table else len(table) + hash(value) % 1000


def _show(name: str, value: int) -> str:
    table = {"collective": COLLECTIVES, "algorithm": ALGORITHM_CODES, "op": OPS,
             "dtype": DTYPES}.get(name)
    if table is not None and 0 <= value < len(table):
        return str(table[value]).replace("torch.", "")
    return str(value)


def fingerprint(info: GroupInfo, collective: str, algorithm: str, op: str,
                dtype: torch.dtype | None, numel: int, root: int) -> list[int]:
    """The integers every rank of the group compares before a checked collective: this group's call
    count, the collective, algorithm, op and dtype codes, ``numel``, ``root``, the group's size and
    a hash of its global ranks. Ranks that disagree are calling different collectives."""
    key = info.ranks
    call = _calls.get(key, 0)
    _calls[key] = call + 1
    group_hash = 0
    for r in info.ranks:
        group_hash = (group_hash * 1000003 + r + 1) % (1 << 61)
    return [call, _code(COLLECTIVES, collective), _code(ALGORITHM_CODES, algorithm),
            _code(OPS, op), -1 if dtype is None else _code(DTYPES, dtype), numel, root,
            info.size, group_hash]


def agree(info: GroupInfo, where: str, values: list[int], device=None) -> None:
    """Raise ``CommError`` on every rank unless all ranks of ``info`` passed equal ``values``.

    ``device``: where the check's tensors live, the device of the data the collective
    moves (NCCL carries CUDA tensors only); None: the group's device (``group_device``)."""
    n, r = info.size, info.rank
    if n == 1:
        return
    vals = torch.tensor(values, dtype=torch.int64,
                        device=device if device is not None else group_device(info.group))
    rank = torch.full_like(vals, info.global_rank)
    state = torch.stack([vals, rank, vals.clone(), rank.clone()])  # min, who, max, who
    other = torch.empty_like(state)
    call = Call("check", "dissemination", info, state.numel() * state.element_size(),
                torch.int64, label=f"{where} argument check")
    k, step = 1, 1
    while k < n:
        call.exchange(step, sends=[((r + k) % n, state)], recvs=[((r - k) % n, other)])
        lower = (other[0] < state[0]) | ((other[0] == state[0]) & (other[1] < state[1]))
        state[0] = torch.where(lower, other[0], state[0])
        state[1] = torch.where(lower, other[1], state[1])
        higher = (other[2] > state[2]) | ((other[2] == state[2]) & (other[3] < state[3]))
        state[2] = torch.where(higher, other[2], state[2])
        state[3] = torch.where(higher, other[3], state[3])
        k, step = 2 * k, step + 1
    call.close()
    bad = [i for i in range(len(FIELDS)) if state[0, i] != state[2, i]]
    if bad:
        parts = []
        for i in bad:
            name = FIELDS[i]
            lo, hi = _show(name, int(state[0, i])), _show(name, int(state[2, i]))
            parts.append(f"{name}: rank {int(state[1, i])} has {lo}, "
                         f"rank {int(state[3, i])} has {hi}")
        raise CommError(f"{where} on rank {info.global_rank} (group rank {r} of {n}): ranks "
                        f"called it with different arguments: {'; '.join(parts)}")
