"""The mixture-of-experts block on one process (``models.moe``), against the formulas written
out token by token: routing (softmax and sigmoid gating), the grouped experts, capacity,
the auxiliary loss and its gradient, the per-step statistics, and the Llama built with it
(also on the meta device, as the engine builds it). No process group; a few seconds."""

import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.models.moe import (
    MoE,
    grouped_mm,
    keep_within_capacity,
    load_balancing_loss,
    route,
)


def naive_moe(m: MoE, x: torch.Tensor, keep=None) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * expert_{e[t, j]}(x[t]), one token and one expert at a time."""
    B, T, C = x.shape
    flat = x.reshape(-1, C)
    _, w, e = route(m.router(flat), m.top_k, m.gating, m.norm_topk, m.expert_bias)
    ex = m.experts
    out = []
    for t in range(flat.shape[0]):
        acc = torch.zeros(C, dtype=x.dtype)
        for j in range(m.top_k):
            if keep is not None and not keep[t, j]:
                continue
            i = int(e[t, j])
            h = F.silu(flat[t] @ ex.gate_proj[i]) * (flat[t] @ ex.up_proj[i])
            acc = acc + w[t, j] * (h @ ex.down_proj[i])
        out.append(acc)
    y = torch.stack(out).view(B, T, C)
    return y + m.shared_expert(x) if m.shared_expert is not None else y


def _moe(seed=0, **kw) -> MoE:
    torch.manual_seed(seed)
    m = MoE(dim=8, n_experts=4, hidden=12, **kw)
    m.experts.reset_parameters(std=0.3)
    return m


@pytest.mark.parametrize("gating,top_k,norm", [("softmax", 2, True), ("softmax", 1, False),
                                               ("sigmoid", 2, True), ("sigmoid", 3, False)])
def test_forward_and_gradients_equal_the_token_by_token_formula(gating, top_k, norm):
    m = _moe(gating=gating, top_k=top_k, norm_topk=norm, aux_loss_coef=0.0)
    x = torch.randn(3, 5, 8, requires_grad=True)
    g = torch.randn(3, 5, 8)
    y = m(x)
    grads = torch.autograd.grad(y, [x, *m.parameters()], g)
    y_ref = naive_moe(m, x)
    grads_ref = torch.autograd.grad(y_ref, [x, *m.parameters()], g)
    assert (y - y_ref).abs().max() <= 1e-5 * y_ref.abs().max()
    for a, b in zip(grads, grads_ref):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), (a - b).abs().max()


def test_routing_scores_and_gates():
    z = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    s, w, e = route(z, 2, "softmax", True)
    assert e.tolist() == [[0, 2]] and torch.allclose(s, z.softmax(-1))
    assert torch.allclose(w, z[:, [0, 2]].softmax(-1))                 # Mixtral's renormalised
    s, w, e = route(z, 2, "sigmoid", False)
    assert torch.allclose(w, z[:, [0, 2]].sigmoid())                    # raw (DeepSeek: + norm)
    assert torch.allclose(s, z.sigmoid() / z.sigmoid().sum())
    with pytest.raises(ValueError, match="model.moe_gating='relu'"):
        route(z, 2, "relu")


def test_a_routing_bias_chooses_the_experts_but_not_their_gates():
    """DeepSeek-V3 eq. 16: the bias is added to the scores for the top-k choice only; the
    gates are the chosen experts' unbiased scores (renormalised with norm_topk), and the
    scores the auxiliary loss averages ignore it. By hand, both gatings; then the block's
    forward and gradients with a bias against the token-by-token formula."""
    z = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    p = z.softmax(-1)                                    # ~ [.644, .087, .237, .032]
    s, w, e = route(z, 2, "softmax", True, torch.tensor([-0.5, 0.0, 0.0, 0.3]))
    assert e.tolist() == [[3, 2]]                        # p + b ~ [.144, .087, .237, .332]
    assert torch.allclose(w, p[:, [3, 2]] / (p[0, 3] + p[0, 2]))  # unbiased, renormalised
    assert torch.equal(s, p)
    g = z.sigmoid()                                      # ~ [.881, .5, .731, .269]
    s, w, e = route(z, 2, "sigmoid", True, torch.tensor([-0.5, 0.2, 0.0, 0.0]))
    assert e.tolist() == [[2, 1]]                        # g + b ~ [.381, .7, .731, .269]
    assert torch.allclose(w, g[:, [2, 1]] / (g[0, 2] + g[0, 1]))
    assert torch.equal(s, g / g.sum())
    s, w, e = route(z, 2, "sigmoid", False, torch.tensor([-0.5, 0.2, 0.0, 0.0]))
    assert torch.equal(w, g[:, [2, 1]])                  # without norm_topk: the raw sigmoids
    assert torch.equal(route(z, 2, "softmax", True, torch.zeros(4))[1],
                       route(z, 2, "softmax", True)[1])  # a zero bias changes nothing
    m = _moe(gating="sigmoid", bias_update_rate=0.1, aux_loss_coef=0.0)
    m.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    x = torch.randn(3, 5, 8, requires_grad=True)
    y, y_ref = m(x), naive_moe(m, x)
    assert (y - y_ref).abs().max() <= 1e-5 * y_ref.abs().max()
    gy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, [x, *m.parameters()], gy),
                    torch.autograd.grad(y_ref, [x, *m.parameters()], gy)):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_the_bias_update_rule_by_hand():
    """``update_bias(load)``: ``b += rate * sign(mean load - load)`` (DeepSeek-V3 sec. 2.1.2):
    down for an expert above the mean, up below it, unchanged at it. Rate 0: no buffer,
    nothing to update; a negative rate is refused."""
    m = _moe(bias_update_rate=0.01)
    assert m.expert_bias.dtype == torch.float32 and torch.equal(m.expert_bias, torch.zeros(4))
    assert "expert_bias" in m.state_dict()
    m.update_bias(torch.tensor([10, 2, 4, 4]))           # mean 5
    want = torch.tensor([-0.01, 0.01, 0.01, 0.01])
    assert torch.equal(m.expert_bias, want)
    m.update_bias(torch.tensor([5, 5, 5, 5]))            # balanced: no change
    assert torch.equal(m.expert_bias, want)
    m.update_bias(torch.tensor([0, 6, 5, 9]))            # mean 5
    assert torch.equal(m.expert_bias, want + torch.tensor([0.01, -0.01, 0.0, -0.01]))
    off = _moe()
    assert off.expert_bias is None and "expert_bias" not in off.state_dict()
    off.update_bias(torch.tensor([10, 2, 4, 4]))
    with pytest.raises(ValueError, match=r"^model.moe_bias_update_rate=-0.1: expected >= 0$"):
        _moe(bias_update_rate=-0.1)


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_the_bias_balances_a_skewed_router(gating):
    """A router skewed to expert 0 (top-1, 256 tokens a step, about 80% of them on expert 0):
    with rate 0.01 the load's max / mean, about 3.2 at first (E = 4 is all on one), falls
    below 1.5 on average over steps 60-80; with rate 0 (no bias) it stays above 3. Each
    step's load is ``pop_router_stats``' (what the engine sums over the ranks before
    ``update_bias``)."""
    def ratios(rate: float, steps: int) -> list[float]:
        m = _moe(seed=1, gating=gating, top_k=1, bias_update_rate=rate)
        with torch.no_grad():
            m.router.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
            m.router.weight[0] += 1.0
        g = torch.Generator().manual_seed(2)
        out = []
        for _ in range(steps):
            m(torch.randn(8, 32, 8, generator=g) + 0.5)
            load = m.pop_router_stats()["load"]
            m.update_bias(load)
            out.append(float(load.max() / load.float().mean()))
        if rate:
            assert int(m.expert_bias.argmin()) == 0 and m.expert_bias[0] < 0, m.expert_bias
        return out

    def mean(x):
        return sum(x) / len(x)

    off, on = ratios(0.0, 20), ratios(0.01, 80)
    assert mean(off[:5]) > 3 and mean(off[-5:]) > 3, off
    assert mean(on[:5]) > 2 and mean(on[-20:]) < 1.5, on


def test_load_balancing_loss_is_switch_per_sequence():
    """E sum_i f_i P_i per sequence, averaged: 1 when balanced, E when all on one expert."""
    E = 4
    scores = torch.full((8, E), 1 / E)
    experts = torch.tensor([[0], [1], [2], [3], [0], [1], [2], [3]])
    assert math.isclose(float(load_balancing_loss(scores, experts, n_seq=2)), 1.0, rel_tol=1e-6)
    skewed = torch.zeros(8, E)
    skewed[:, 0] = 1
    assert math.isclose(float(load_balancing_loss(skewed, torch.zeros(8, 1, dtype=torch.long), 2)),
                        E, rel_tol=1e-6)
    # by hand, two sequences of 2 tokens, top-2
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(4, E, generator=g).softmax(-1)
    experts = torch.tensor([[0, 1], [1, 2], [3, 0], [0, 2]])
    want = 0.0
    for s in range(2):
        f = torch.zeros(E)
        for t in (2 * s, 2 * s + 1):
            for i in experts[t]:
                f[i] += 1 / (2 * 2)
        want += float(E * (f * scores[2 * s:2 * s + 2].mean(0)).sum()) / 2
    assert math.isclose(float(load_balancing_loss(scores, experts, 2)), want, rel_tol=1e-6)


def test_cp_shards_average_to_the_whole_sequences_loss():
    """Under context parallelism (``models.sequence.SequenceShard.total``: here the sum of
    the cp ranks' counts, as the ring's all-reduce gives it) the mean over the cp ranks of
    their local auxiliary losses, and of its gradient, is the whole sequences' loss; with
    each rank's own counts (no total) it is not."""
    from shardwise.models import sequence
    from shardwise.parallel.context import local_positions, shard_sequence

    S, T, E, k, cp = 3, 16, 4, 2, 2
    logits = torch.randn(S * T, E, generator=torch.Generator().manual_seed(2)).requires_grad_()
    scores, _, chosen = route(logits, k)
    whole = load_balancing_loss(scores, chosen, S)
    (want,) = torch.autograd.grad(whole, logits, retain_graph=True)
    rows = [shard_sequence(torch.arange(S * T).view(S, T), cp, r, dim=1).reshape(-1)
            for r in range(cp)]
    counts = sum(F.one_hot(chosen[i], E).sum(1).view(S, T // cp, E).sum(1) for i in rows)

    def local(r: int, total) -> torch.Tensor:
        shard = sequence.SequenceShard(local_positions(T, cp, r), None, total)
        with sequence.use(shard):
            return load_balancing_loss(scores[rows[r]], chosen[rows[r]], S)

    mean = sum(local(r, lambda t: counts.clone()) for r in range(cp)) / cp
    (got,) = torch.autograd.grad(mean, logits)
    assert math.isclose(mean.item(), whole.item(), rel_tol=1e-6)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-9)
    alone = sum(local(r, None) for r in range(cp)) / cp  # each rank's own chunks
    assert not math.isclose(alone.item(), whole.item(), rel_tol=1e-3)


def test_the_auxiliary_loss_enters_the_gradient_once():
    """Training: grad(output . g) = grad of (output . g + coef * aux) with the aux loss
    written out; the scale multiplies the aux loss's share only; stats: the aux value and
    the load (B T k assignments), nothing in eval or no_grad."""
    x = torch.randn(2, 6, 8)
    g = torch.randn(2, 6, 8)
    coef = 0.5
    m = _moe(aux_loss_coef=coef)
    base = torch.autograd.grad((m(x) * g).sum(), m.router.weight)[0]
    stats = m.pop_router_stats()
    scores, _, chosen = route(m.router(x.reshape(-1, 8)), 2)
    aux = coef * load_balancing_loss(scores, chosen, 2)
    m_free = _moe(aux_loss_coef=0.0)
    free = torch.autograd.grad((m_free(x) * g).sum(), m_free.router.weight)[0]
    want = free + torch.autograd.grad(aux, m.router.weight)[0]
    assert torch.allclose(base, want, rtol=1e-5, atol=1e-7)
    assert math.isclose(float(stats["aux_loss"]), aux.item(), rel_tol=1e-6)
    assert stats["load"].sum() == 2 * 6 * 2 and stats["calls"] == 1 and stats["dropped"] == 0
    m.aux_grad_scale = 3.0
    scaled = torch.autograd.grad((m(x) * g).sum(), m.router.weight)[0]
    assert torch.allclose(scaled, free + 3 * (want - free), rtol=1e-5, atol=1e-7)
    m.pop_router_stats()
    with torch.no_grad():
        m(x)
    m.eval()
    m(x)
    assert m.pop_router_stats() is None


def test_capacity_drops_second_choices_first():
    m = _moe(top_k=2, capacity_factor=0.5, aux_loss_coef=0.0)
    x = torch.randn(1, 16, 8)
    _, _, e = route(m.router(x.reshape(-1, 8)), 2)
    cap = math.ceil(0.5 * 16 * 2 / 4)
    keep = keep_within_capacity(e, 4, cap)
    for i in range(4):  # never more than cap per expert; first choices taken before second
        assert int(((e == i) & keep).sum()) == min(cap, int((e == i).sum()))
        if int((e[:, 0] == i).sum()) >= cap:
            assert not ((e[:, 1] == i) & keep[:, 1]).any()
    y = m(x)
    assert (y - naive_moe(m, x, keep)).abs().max() <= 1e-5 * y.abs().max()
    assert int(m.pop_router_stats()["dropped"]) == int((~keep).sum()) > 0


def test_grouped_mm_padded_bmm_fallback(monkeypatch):
    """The padded batched product (torch without a CPU grouped GEMM) equals the grouped one,
    forward and backward, an empty group included."""
    from shardwise.models import moe

    x = torch.randn(9, 8, requires_grad=True)
    w = torch.randn(3, 8, 4, requires_grad=True)
    counts = torch.tensor([4, 0, 5])
    y = grouped_mm(x, w, counts)
    ref = torch.cat([x[:4] @ w[0], x[4:] @ w[2]])
    assert torch.allclose(y, ref, atol=1e-6)
    monkeypatch.setattr(moe, "_GROUPED_MM", None)
    y2 = grouped_mm(x, w, counts)
    assert torch.allclose(y2, ref, atol=1e-6)
    ga = torch.autograd.grad(y.sum(), [x, w])
    gb = torch.autograd.grad(y2.sum(), [x, w])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ga, gb))
    assert grouped_mm(x[:0], w, torch.zeros(3, dtype=torch.long)).shape == (0, 4)
    monkeypatch.undo()  # rows of 20 bytes: torch's grouped GEMM refuses them, bmm runs
    assert torch.allclose(grouped_mm(x[:, :5], w[:, :5], counts),
                          torch.cat([x[:4, :5] @ w[0, :5], x[4:, :5] @ w[2, :5]]), atol=1e-6)


def test_grouped_mm_compiles_in_fp32():
    """Under ``torch.compile`` the fp32 grouped GEMM runs eagerly (the traced form of
    ``F.grouped_mm`` takes bf16 only: compiling a fp32 MoE raised): same values and
    gradients as eager."""
    torch._dynamo.reset()
    x = torch.randn(9, 16, requires_grad=True)
    w = torch.randn(3, 16, 8, requires_grad=True)
    counts = torch.tensor([4, 0, 5])
    f = torch.compile(lambda a, b: torch.relu(grouped_mm(a, b, counts)).sum())
    ref = torch.relu(torch.cat([x[:4] @ w[0], x[4:] @ w[2]])).sum()
    got = f(x, w)
    assert torch.allclose(got, ref, atol=1e-5)
    ga = torch.autograd.grad(got, [x, w])
    gb = torch.autograd.grad(ref, [x, w])
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ga, gb))


def _llama_cfg(**kw):
    from shardwise.models.llama import LlamaConfig

    return LlamaConfig(**{"vocab_size": 32, "block_size": 16, "n_layer": 2, "n_head": 4,
                          "n_embd": 32, "n_experts": 4, "top_k": 2, "moe_ffn_hidden": 24, **kw})


def test_llama_with_experts_trains_and_is_built_alike_on_meta():
    from shardwise.engine.model import build_local_model
    from shardwise.models.llama import Llama, describe
    from shardwise.parallel.tensor_parallel.group import RankGroup

    cfg = _llama_cfg(moe_shared_expert=True)
    torch.manual_seed(3)
    model = Llama(cfg)
    names = dict(model.named_parameters())
    assert names["blocks.0.mlp.experts.gate_proj"].shape == (4, 32, 24)
    assert names["blocks.1.mlp.experts.down_proj"].shape == (4, 24, 32)
    assert names["blocks.0.mlp.router.weight"].shape == (4, 32)
    assert "blocks.0.mlp.shared_expert.up_proj.weight" in names
    local = build_local_model(cfg, pp=1, pp_rank=0, chunk_ids=[0], n_chunks=1, tp=RankGroup(),
                              seed=3, dropout_seed=0, device=torch.device("cpu"))
    for n, p in local.named_parameters():
        assert torch.equal(p, names[n]), n
    # FLOPs count a token's top_k of E experts
    d = describe(cfg)
    expert = sum(p.numel() for n, p in names.items() if ".experts." in n)
    dense = d.flops_per_token(model) - 6 * expert * 2 / 4
    assert dense == 6 * (sum(p.numel() for p in model.parameters()) - expert - 32 * 32) \
        + 12 * 2 * 32 * 16
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 32, (4, 16), generator=g)
    losses = []
    for _ in range(8):
        _, loss = model(idx, idx.roll(-1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        stats = [b.mlp.pop_router_stats() for b in model.blocks]
        assert all(int(s["load"].sum()) == 4 * 16 * 2 for s in stats)
    assert losses[-1] < losses[0], losses


def test_config_refusals_are_one_line():
    from shardwise.base.config import Config, ConfigError

    with pytest.raises(ConfigError, match=r"^model.top_k=5 is more than model.n_experts=4$"):
        Config.from_dict({"model": {"kind": "llama", "n_experts": 4, "top_k": 5}})
    with pytest.raises(ConfigError, match="model.n_experts=4 with model.kind=gpt"):
        Config.from_dict({"model": {"n_experts": 4}})
    with pytest.raises(ConfigError, match="model.moe_gating='relu'"):
        Config.from_dict({"model": {"kind": "llama", "n_experts": 4, "moe_gating": "relu"}})
    with pytest.raises(ValueError, match="model.top_k=0"):
        _llama_cfg(top_k=0)
    with pytest.raises(ConfigError, match=r"^model.moe_bias_update_rate: .*greater than or "
                                          r"equal to 0 \(got -1\)$"):
        Config.from_dict({"model": {"kind": "llama", "n_experts": 4, "moe_bias_update_rate": -1}})
    with pytest.raises(ValueError, match=r"^model.moe_bias_update_rate=-1: expected >= 0$"):
        _llama_cfg(moe_bias_update_rate=-1)


def test_engine_reports_drops_as_the_description_declares():
    """``expert_dropped`` follows the description's ``capacity_factor``, whatever the model's
    own config holds: a model described under another kind, with no config of the Llama's
    (``config=None``), reports the assignments its layers dropped (the single-process
    model's count on the same batch); the dropless Llama reports none. A description whose
    ``capacity_factor`` or ``n_experts`` disagrees with what its layers state is refused."""
    import dataclasses

    from shardwise.base.topology import Topology
    from shardwise.engine import Engine, EngineConfig
    from shardwise.models.description import ModelDescription
    from shardwise.models.llama import describe

    d = describe(_llama_cfg(moe_capacity_factor=0.5))
    assert d.capacity_factor == 0.5 and describe(_llama_cfg()).capacity_factor == 0.0
    own = dataclasses.replace(d, kind="own-moe", config=None)
    idx = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(0))
    settings = EngineConfig(
        seq_len=16, optimizer={"grad_clip": 0.0}, training={"global_batch_size": 4, "seed": 3})
    info = Engine(own, Topology.build(1, 1, 1), settings).train_step(idx, idx.roll(-1, 1))
    torch.manual_seed(3)
    model = own.build()
    model(idx, idx.roll(-1, 1))
    dropped = sum(int(b.mlp.pop_router_stats()["dropped"]) for b in model.blocks)
    assert dropped > 0 and info["expert_dropped"] == dropped
    info = Engine(describe(_llama_cfg()), Topology.build(1, 1, 1),
                  settings).train_step(idx, idx.roll(-1, 1))
    assert "expert_dropped" not in info and "expert_load" in info
    with pytest.raises(ValueError, match="capacity_factor=0.5 needs experts"):
        dataclasses.replace(own, n_experts=0)
    # a description that disagrees with its layers (they drop, it says dropless; or another
    # number of experts) is one line naming the layer, before anything is built
    for field, value, said in (("capacity_factor", 0.0, "0.5"), ("n_experts", 8, "4")):
        wrong = dataclasses.replace(own, **{field: value})
        with pytest.raises(ValueError, match=rf"^own-moe: blocks\.0\.mlp\.{field} is {said} "
                                             rf"but the description's {field} is {value};"):
            Engine(wrong, Topology.build(1, 1, 1), settings)
    with pytest.raises(ValueError, match="capacity_factor=-1; expected >= 0"):
        ModelDescription(kind="x", config=None, build=own.build, tp_plan={}, hidden_size=32,
                         vocab_size=32, block_size=16, n_layer=2, attention_width=32,
                         n_experts=4, capacity_factor=-1)


def test_engine_moves_each_layers_bias_by_the_steps_load():
    """The engine builds ``expert_bias`` as zeros (on the meta device first, like every
    tensor) and after each step calls ``update_bias`` with the step's ``expert_load`` of
    that layer: after two steps each bias is rate x the sum of the two steps' signs."""
    from shardwise.base.topology import Topology
    from shardwise.engine import Engine, EngineConfig
    from shardwise.models.llama import describe

    rate = 0.01
    engine = Engine(describe(_llama_cfg(moe_bias_update_rate=rate)), Topology.build(1, 1, 1),
                    EngineConfig(
                        seq_len=16, optimizer={"grad_clip": 0.0},
                        training={"global_batch_size": 4, "seed": 3}))
    biases = engine.local.named_buffers()
    assert [n for n, _ in biases] == ["blocks.0.mlp.expert_bias", "blocks.1.mlp.expert_bias"]
    assert all(torch.equal(b, torch.zeros(4)) for _, b in biases)
    want = torch.zeros(2, 4)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        idx = torch.randint(0, 32, (4, 16), generator=g)
        load = torch.tensor(engine.train_step(idx, idx.roll(-1, 1))["expert_load"]).float()
        want += rate * (load.mean(dim=1, keepdim=True) - load).sign()
    assert want.abs().sum() > 0
    for (n, b), w in zip(biases, want):
        assert torch.allclose(b, w, rtol=0, atol=1e-7), (n, b, w)
    # any other buffer is still refused, named: it would have no value on the meta device
    import dataclasses

    from shardwise.models.llama import Llama

    def build():
        model = Llama(_llama_cfg())
        model.blocks[1].self_attn.register_buffer("mask", torch.ones(4))
        return model

    d = dataclasses.replace(describe(_llama_cfg()), build=build)
    with pytest.raises(ValueError, match=r"^llama: buffer blocks\.1\.self_attn\.mask has no "
                                         r"value when built on the meta device"):
        Engine(d, Topology.build(1, 1, 1), EngineConfig(
            seq_len=16, optimizer={"grad_clip": 0.0}, training={"global_batch_size": 4, "seed": 3}))


def test_mixed_dense_and_moe_blocks():
    """``dense_layers``: those blocks hold the dense SwiGLU of width ``ffn_hidden`` (no
    router, no routing bias), the others the mixture; the engine builds it alike on meta,
    reports the load of the mixtures only and moves their biases only; the FLOP count takes
    a token's top_k of E experts in the mixtures only; the tp plan styles the dense MLPs as
    the Llama's; bad indices are one line naming the field."""
    from shardwise.base.config import Config, ConfigError
    from shardwise.base.topology import Topology
    from shardwise.engine import Engine, EngineConfig
    from shardwise.models.llama import Llama, describe

    cfg = _llama_cfg(n_layer=3, ffn_hidden=40, dense_layers=(0,), moe_bias_update_rate=0.01)
    torch.manual_seed(3)
    model = Llama(cfg)
    names = dict(model.named_parameters())
    assert names["blocks.0.mlp.gate_proj.weight"].shape == (40, 32)
    assert not any(n.startswith("blocks.0.mlp.") and ("router" in n or "experts" in n)
                   for n in names)
    assert names["blocks.2.mlp.experts.gate_proj"].shape == (4, 32, 24)
    assert [n for n, _ in model.named_buffers()] == ["blocks.1.mlp.expert_bias",
                                                     "blocks.2.mlp.expert_bias"]
    d = describe(cfg)
    assert [d.style_of(f"blocks.{i}.mlp") for i in range(3)] == ["shared_input", "moe", "moe"]
    assert d.style_of("blocks.0.mlp.down_proj") == "row"
    assert d.tp_divides["model.ffn_hidden (dense layers' SwiGLU width)"] == 40
    expert = sum(p.numel() for n, p in names.items() if ".experts." in n)
    assert d.flops_per_token(model) == 6 * (sum(p.numel() for p in model.parameters())
                                            - expert / 2 - 32 * 32) + 12 * 3 * 32 * 16
    engine = Engine(d, Topology.build(1, 1, 1), EngineConfig(
        seq_len=16, optimizer={"grad_clip": 0.0}, training={"global_batch_size": 4, "seed": 3}))
    for n, p in engine.local.named_parameters():
        assert torch.equal(p, names[n]), n
    idx = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(0))
    info = engine.train_step(idx, idx.roll(-1, 1))
    assert len(info["expert_load"]) == 2 and all(sum(r) == 4 * 16 * 2
                                                 for r in info["expert_load"])
    assert all(b.abs().sum() > 0 for _, b in engine.local.named_buffers())
    assert Config.from_dict({"model": {"kind": "llama", "n_experts": 4, "n_layer": 3,
                                       "dense_layers": [0, 1]}}).model.dense_layers == [0, 1]
    for bad, msg in (({"dense_layers": (3,)}, r"^model.dense_layers: 3 is not a block index "
                                               r"from 0 to model.n_layer - 1 = 2$"),
                     ({"dense_layers": (0, 1, 2)}, r"^model.dense_layers names every block"),
                     ({"dense_layers": (0,), "n_experts": 0},
                      r"^model.dense_layers=\[0\] with model.n_experts=0")):
        with pytest.raises(ValueError, match=msg):
            _llama_cfg(n_layer=3, **bad)
    with pytest.raises(ConfigError, match=r"^model.dense_layers: 5 is not a block index"):
        Config.from_dict({"model": {"kind": "llama", "n_experts": 4, "n_layer": 3,
                                    "dense_layers": [5]}, "training": {"global_batch_size": 8}})


def _hf_moe_into_ours(hf, bias_rate: float, **kw) -> MoE:
    """Our ``MoE`` holding ``hf``'s weights (a transformers ``DeepseekV3MoE`` /
    ``DeepseekV2Moe``): the router, the experts (their fused (E, 2F, C) gate_up and (E, C, F)
    down as our stacked (E, C, F) / (E, F, C)), the shared experts' SwiGLU and, with
    ``bias_rate``, the routing bias (``gate.e_score_correction_bias``)."""
    from shardwise.models.llama import MLP, LlamaConfig

    e, f2, c = hf.experts.gate_up_proj.shape
    f = f2 // 2
    shared_f = hf.shared_experts.gate_proj.weight.shape[0]
    shared = MLP(LlamaConfig(vocab_size=8, n_embd=c, n_head=1, ffn_hidden=shared_f), shared_f)
    m = MoE(c, e, f, shared_expert=shared, bias_update_rate=bias_rate, aux_loss_coef=0.0, **kw)
    with torch.no_grad():
        m.router.weight.copy_(hf.gate.weight)
        m.experts.gate_proj.copy_(hf.experts.gate_up_proj[:, :f].transpose(1, 2))
        m.experts.up_proj.copy_(hf.experts.gate_up_proj[:, f:].transpose(1, 2))
        m.experts.down_proj.copy_(hf.experts.down_proj.transpose(1, 2))
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(shared, name).weight.copy_(getattr(hf.shared_experts, name).weight)
        if bias_rate:
            m.expert_bias.copy_(hf.gate.e_score_correction_bias)
    return m


@pytest.mark.parametrize("version", ["v3", "v3-no-bias", "v2"])
def test_group_limited_routing_equals_transformers_deepseek(version):
    """DeepSeek's routing against transformers' ``DeepseekV3TopkRouter`` / ``DeepseekV3MoE``
    (sigmoid gating, 8 experts in 4 groups of 2, each group scored by the sum of its top 2
    biased scores, the best 2 groups kept, top 3 among them, renormalised, times
    ``routed_scaling_factor`` 2.5; a random ``e_score_correction_bias`` as our routing
    bias, and none) and ``DeepseekV2Moe`` (softmax, ``group_limited_greedy``: a group's
    best score, no renormalisation, scaling 1.5), on random tokens: the same experts per
    token, the same gates (fp32) and the block's output within 1e-5 (with the shared
    experts: one SwiGLU of n_shared x moe_intermediate_size). Then the refusals."""
    import transformers

    torch.manual_seed(0)
    c = 16
    if version.startswith("v3"):
        cfg = transformers.DeepseekV3Config(
            hidden_size=c, moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=3,
            n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
            n_shared_experts=2)
        hf = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(cfg)
        kw = dict(gating="sigmoid", norm_topk=True, n_group=4, topk_group=2,
                  group_score="top2", routed_scaling=2.5, top_k=3)
        rate = 0.0 if version == "v3-no-bias" else 0.01
    else:
        cfg = transformers.DeepseekV2Config(
            hidden_size=c, moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=3,
            n_group=4, topk_group=2, topk_method="group_limited_greedy",
            routed_scaling_factor=1.5, n_shared_experts=2, num_attention_heads=4,
            num_key_value_heads=4)
        hf = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe(cfg)
        kw = dict(gating="softmax", norm_topk=False, n_group=4, topk_group=2,
                  group_score="top1", routed_scaling=1.5, top_k=3)
        rate = 0.0
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.5)
        if rate:
            hf.gate.e_score_correction_bias.normal_(0, 0.3)
    hf.eval()
    m = _hf_moe_into_ours(hf, rate, **kw).eval()
    x = torch.randn(4, 9, c)
    _, w_hf, e_hf = hf.gate(x)
    _, w, e = route(m.router(x.reshape(-1, c)), 3, kw["gating"], kw["norm_topk"],
                    m.expert_bias, 4, 2, kw["group_score"], kw["routed_scaling"])
    order, order_hf = e.sort(dim=-1), e_hf.sort(dim=-1)
    assert torch.equal(order.values, order_hf.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_hf.gather(1, order_hf.indices),
                               rtol=1e-6, atol=1e-7)
    assert all(len(set(r)) <= 2 for r in (e // 2).tolist())  # within 2 groups of 2
    free = route(m.router(x.reshape(-1, c)), 3, kw["gating"], kw["norm_topk"], m.expert_bias)
    assert not torch.equal(free[2].sort(dim=-1).values, order.values)  # the groups decide
    with torch.no_grad():
        torch.testing.assert_close(m(x), hf(x), rtol=1e-5, atol=1e-5)
    for bad, msg in (({"n_group": 3}, r"^model.moe_n_group=3: expected a divisor"),
                     ({"n_group": 8}, r"^model.moe_n_group=8: .* >= 2 experts per group"),
                     ({"n_group": 4, "topk_group": 1}, r"^model.moe_topk_group=1: expected"),
                     ({"routed_scaling": 0.0}, r"^model.moe_routed_scaling=0.0: expected > 0"),
                     ({"group_score": "mean"}, r"^model.moe_group_score='mean'")):
        with pytest.raises(ValueError, match=msg):
            MoE(c, 8, 8, top_k=3, **bad)
