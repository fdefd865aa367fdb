"""A chunk's backward split in two: B, the gradient of its input, now; W, of its weights, later.

Zero-bubble schedules (Qi et al. 2023, arXiv:2401.10241) send the input gradient upstream as
soon as it exists and run the weight gradients where the pipeline would idle. ``backward_input``
walks the chunk's autograd graph from its output: the nodes from which the chunk's input is
reachable lie on the input-gradient path; a *frontier* node is one of them with an edge
leaving that path towards parameters (a matmul's weight side, a norm's scale). B runs autograd
to the input only (``torch.autograd.grad(..., retain_graph=True)``: the engine skips the
weight edges), and a pre-hook on each frontier node keeps the gradient that reached it.
``backward_weight`` restarts autograd at those nodes (``GradientEdge`` roots) with
``torch.autograd.backward(..., inputs=params)``, so each parameter's gradient accumulates in
``.grad`` through its ``AccumulateGrad`` node and its post-accumulate-grad hooks (DDP
buckets, ZeRO-2's reduce-scatter) fire exactly as under the fused backward. Frontier nodes
sharing a parameter run in one call (one accumulation, one hook); a parameter reachable from
a frontier node both off and along the input path (used at two depths of one chunk) would be
counted twice, so it is refused (``SplitBackwardError``). The idea is that of
``torch.distributed.pipelining``'s ``stage_backward_input`` / ``stage_backward_weight``.

Held between B and W: the graph (its saved tensors, metered by the executor's
``ActivationMeter`` like any activation) and the gradients at the frontier
(``WeightGrad.nbytes``, which the executor holds in its meter).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge


class SplitBackwardError(ValueError):
    """The chunk's graph cannot be split (a parameter used at two depths of the chunk)."""


@dataclass
class WeightGrad:
    """What B keeps for W: per call, root nodes and the parameters it differentiates; the
    gradients the roots received (``grads[node]``, filled during B); bytes of those."""

    calls: list = field(default_factory=list)  # [(nodes, params)]
    grads: dict = field(default_factory=dict)  # node -> tuple of gradients at its outputs
    whole: tuple | None = None  # (output, gradient, params): no input to split from
    nbytes: int = 0


def _walk(root, x):
    """Per node reachable from ``root``: whether ``x``'s accumulator is below it, and the
    ids of the leaf tensors (parameters) below it. Iterative post-order."""
    reach: dict = {}
    leaves: dict = {}
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if node in reach:
            continue
        kids = [c for c, _ in node.next_functions if c is not None]
        if not expanded:
            stack.append((node, True))
            stack += [(c, False) for c in kids if c not in reach]
            continue
        var = getattr(node, "variable", None)
        reach[node] = var is x or any(reach[c] for c in kids)
        own = {id(var)} if var is not None and var is not x else set()
        leaves[node] = own.union(*(leaves[c] for c in kids))
    return reach, leaves


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None,
                   params: list[torch.nn.Parameter]) -> tuple[torch.Tensor | None, WeightGrad]:
    """B: the gradient of ``out`` (a chunk's output, or its scaled loss when ``grad`` is None)
    w.r.t. ``x`` (its input, a leaf that requires grad; None for the first chunk, whose
    input is token ids: then B computes nothing and W runs the whole backward). Returns the
    input gradient (same shape as ``x``) and what W needs."""
    kept = WeightGrad()
    if x is None or not x.requires_grad or out.grad_fn is None:
        kept.whole = (out, grad, params)
        return None, kept
    reach, leaves = _walk(out.grad_fn, x)
    by_id = {id(p): p for p in params}
    frontier: dict = {}  # node -> (params off the input path, params along it)
    for node, on_path in reach.items():
        if not on_path:
            continue
        off, along = set(), set()
        for c, _ in node.next_functions:
            if c is not None:
                (along if reach[c] else off).update(leaves[c] & by_id.keys())
        if off:
            frontier[node] = (off, along)
    groups: list[list] = []  # frontier nodes that share a parameter run in one call
    for node, (off, _) in frontier.items():
        merged = [g for g in groups if g[1] & off]
        nodes, ps = [node], set(off)
        for g in merged:
            groups.remove(g)
            nodes, ps = nodes + g[0], ps | g[1]
        groups.append([nodes, ps])
    for nodes, ps in groups:
        twice = ps & set().union(*(frontier[n][1] for n in nodes))
        if twice:
            names = ", ".join(str(tuple(by_id[i].shape)) for i in sorted(twice))[:80]
            raise SplitBackwardError(
                f"a parameter of shape {names} is used at two depths of one pipeline chunk: "
                "its gradient cannot be split from the input's; use a fused schedule "
                "(parallel.schedule = 1f1b or interleaved)")
        kept.calls.append((nodes, [by_id[i] for i in sorted(ps)]))
    kept.calls.reverse()  # the output's side first, as the fused backward reaches it

    def keep(node):
        def hook(grad_outputs):
            kept.grads[node] = tuple(grad_outputs)
            kept.nbytes += sum(g.numel() * g.element_size() for g in grad_outputs
                               if g is not None)
        return hook

    handles = [n.register_prehook(keep(n)) for n in frontier]
    try:
        (dx,) = torch.autograd.grad(out, (x,), grad_outputs=grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return dx, kept


def backward_weight(kept: WeightGrad) -> None:
    """W: accumulate the parameters' gradients in ``.grad`` from what ``backward_input``
    kept, then free it (the graph goes with the last call)."""
    if kept.whole is not None:
        out, grad, params = kept.whole
        kept.whole = None
        torch.autograd.backward(out, grad, inputs=params)
        return
    calls, grads = kept.calls, kept.grads
    for k, (nodes, params) in enumerate(calls):
        edges, values = [], []
        for n in nodes:
            for i, g in enumerate(grads.get(n, ())):
                if g is not None:
                    edges.append(GradientEdge(n, i))
                    values.append(g)
        if edges:
            torch.autograd.backward(edges, values, inputs=params,
                                    retain_graph=k < len(calls) - 1)
    kept.calls, kept.grads = [], {}
