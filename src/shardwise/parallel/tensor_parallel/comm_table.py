"""Communication per step of data and tensor parallelism for one linear layer, measured.

Seed 000 ("Comparing Data and Tensor Model Parallelism") compares, for ``y = W x`` with a
batch of B rows, C_in inputs and C_out outputs, the elements each strategy moves per step:
data parallelism C_in * C_out (the gradient of W), tensor parallelism that partitions the
output B * C_out, tensor parallelism that reduces the output B * C_in. Here each strategy
runs on a real group through ``shardwise.comm`` with our ring collectives, whose byte
counters see every payload byte, and the table is read from ``comm.accounting``'s records
(forward and backward apart), not computed from formulas.

Measured, the reduction of B * C_in elements belongs to the layer whose *output* is
partitioned: its backward all-reduces the input gradient (Megatron's f), while reducing the
output itself moves B * C_out in forward (Megatron's g). The table lists both variants of
both strategies so the seed's figures can be read off it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from shardwise import comm
from shardwise.comm.accounting import recording
from shardwise.parallel.tensor_parallel import mappings
from shardwise.parallel.tensor_parallel.group import RankGroup
from shardwise.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

COLUMNS = ("strategy", "formula", "formula_elements", "forward_elements", "backward_elements",
           "measured_elements", "bytes_sent_this_rank")


def _counts(records) -> tuple[int, int]:
    """(elements in the collectives' messages, bytes this rank sent), leaving out comm's
    argument-agreement rounds ("check"), which carry no payload of the strategy."""
    records = [r for r in records if r.collective != "check"]
    elements = sum(r.nbytes // torch.empty(0, dtype=getattr(torch, r.dtype)).element_size()
                   for r in records)
    return elements, sum(r.bytes_sent or 0 for r in records)


def measure_linear(batch: int, c_in: int, c_out: int, dp_group, tp: RankGroup,
                   seed: int = 31) -> list[dict]:
    """One training step of ``y = W x`` (no bias) per strategy on this rank. ``dp_group``
    and ``tp`` span the same ranks; ``tp`` should use a counted algorithm (e.g. "ring").
    Returns one dict per strategy (``COLUMNS``, plus the collectives' names)."""
    n = tp.size
    if batch % n:
        raise ValueError(f"batch={batch} is not divisible by the group size {n}")
    torch.manual_seed(seed)
    lin = nn.Linear(c_in, c_out, bias=False)
    x = torch.randn(batch, c_in, generator=torch.Generator().manual_seed(seed + 1))
    x_split = x[:, tp.rank * (c_in // n):(tp.rank + 1) * (c_in // n)]

    def dp_step():
        rows = batch // n
        y = lin(x[tp.rank * rows:(tp.rank + 1) * rows])  # this rank's share of the batch
        return y, lambda: (y.sum().backward(),
                           comm.all_reduce(lin.weight.grad, group=dp_group,
                                           algorithm=tp.all_reduce, check=False))

    def tp_step(layer, inp):
        y = layer(inp)
        return y, lambda: y.sum().backward()

    cases = [
        ("data parallel (all-reduce dW)", "C_in*C_out", c_in * c_out, dp_step),
        ("TP partition output, output gathered, x data", "B*C_out", batch * c_out,
         lambda: tp_step(ColumnParallelLinear(c_in, c_out, tp, False, gather_output=True,
                                              master=lin), x)),
        ("TP partition output, output kept split (f)", "B*C_in", batch * c_in,
         lambda: tp_step(ColumnParallelLinear(c_in, c_out, tp, False, master=lin),
                         x.clone().requires_grad_(True))),
        ("TP reduce output, input already split (g)", "B*C_out", batch * c_out,
         lambda: tp_step(RowParallelLinear(c_in, c_out, tp, False, input_is_parallel=True,
                                           master=lin), x_split.clone().requires_grad_(True))),
        ("TP reduce output, x replicated and split here", "B*C_out + B*C_in",
         batch * (c_out + c_in),
         lambda: tp_step(RowParallelLinear(c_in, c_out, tp, False, master=lin),
                         x.clone().requires_grad_(True))),
    ]
    rows = []
    for name, formula, expected, make in cases:
        lin.zero_grad()
        with recording() as fwd:
            _, backward = make()
        with recording() as bwd:
            backward()
        fe, fb = _counts(fwd.records)
        be, bb = _counts(bwd.records)
        rows.append({"strategy": name, "formula": formula, "formula_elements": expected,
                     "forward_elements": fe, "backward_elements": be,
                     "measured_elements": fe + be, "bytes_sent_this_rank": fb + bb,
                     "collectives": [r.collective for r in fwd.records + bwd.records
                                     if r.collective != "check"]})
    return rows


def measure_gpt_layers(loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                       x: torch.Tensor, y: torch.Tensor) -> list[dict]:
    """Per-layer communication of one forward + backward of a TP model (rows of
    ``mappings.per_layer_table``): ``loss_of(x, y)`` runs the forward of ids ``x`` (B, T)
    against targets ``y`` (B, T) and returns the scalar loss, which is then backpropagated.
    Use counted algorithms in the model's ``RankGroup`` for bytes."""
    mappings.layer_log.clear()
    with recording():
        loss_of(x, y).backward()
    rows = mappings.per_layer_table()
    mappings.layer_log.clear()
    return rows
