"""Your own decoder, registered with shardwise and trained at dp=2 x pp=2 x tp=2.

The model below is defined here, in plain PyTorch, and is none of shardwise's: Meta-style
names (``tok_embeddings``, ``layers``, ``norm``, ``output``), GPT-J / PaLM parallel blocks
(``x + attention(norm(x)) + feed_forward(norm(x))``, one norm for both branches; Wang &
Komatsuzaki 2021, Chowdhery et al. 2022), grouped-query attention (Ainslie et al. 2023)
with rotary embeddings in the interleaved-pairs layout of Meta's reference code (complex
numbers; Su et al. 2021), a squared-ReLU MLP (So et al. 2021, "Primer"), no biases, an
untied head. What makes it trainable in every layout is three small things:

- ``describe(cfg)``: a ``shardwise.ModelDescription``: how to build it (``torch.manual_seed``
  then ``OwnDecoder(cfg)`` is the single-process model every layout equals), its pipeline
  layers in order (``pipeline_layers``: here the embedding, each block, the final norm and
  the head, five for two blocks), and ``TP_PLAN``, the tensor-parallel style of each
  submodule (``docs/models.md`` lists the styles);
- ``from_section(model_section, vocab_size)``: the config from a run's ``[model]`` section,
  so ``shardwise train`` can build it;
- ``shardwise.register_model("own-decoder", ...)`` at import time.

The engine builds the model on the meta device and replays its initialisation, so the
model keeps three rules (``docs/models.md``): every parameter gets its value from an
``nn.init`` in-place write (``normal_``, ``uniform_``, ``trunc_normal_``, ``zeros_``,
``ones_``, ...), there are no buffers (the rotary angles are computed in ``forward``),
and attention reshapes with ``-1`` heads (``view(B, T, -1, head_dim)``), so a
tensor-parallel rank computes on its share of the heads.

Run it (8 gloo ranks on the CPU, about half a minute on 2 cores)::

    PYTHONPATH=src python examples/own_decoder.py

It trains 6 AdamW steps on random windows of the Shakespeare text (its first 200,000
characters) at dp=2 x pp=2 (1F1B, 2 micro-batches) x tp=2 with sequence parallelism and
ZeRO-1, then the same model in this one process with plain PyTorch on the same batches,
and prints both runs' losses and the largest relative difference of losses and parameters
(fp32: <= 1e-5; what is left is the order of floating-point sums).

From the command line, ``model.module`` imports this file on the launcher and on every
rank (it runs the file's code: that is how the kind gets registered; ``__main__`` below
does not run), and ``model.kind`` picks the registered name; the [model] fields map as in
``from_section`` (``n_kv_heads`` 0 means ``n_head``)::

    shardwise train --model.module examples/own_decoder.py --model.kind own-decoder \\
        --config configs/tiny.toml --model.n_kv_heads 2 --parallel.dp 2 --parallel.pp 2 \\
        --parallel.tp 2 --parallel.micro_batches 2

(``shardwise`` is ``python -m shardwise`` with ``PYTHONPATH=src``; a module name on
``sys.path``, ``--model.module mypkg.models``, works the same way.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise


# -- the model: plain PyTorch ---------------------------------------------------------------
@dataclass(frozen=True)
class OwnDecoderConfig:
    """Sizes. ``n_kv_heads`` must divide ``n_heads`` (grouped-query attention: each key/value
    head serves ``n_heads / n_kv_heads`` query heads); ``ffn_dim`` None means ``4 * dim``."""

    vocab_size: int
    block_size: int = 64
    n_layers: int = 2
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.ffn_dim is None:
            object.__setattr__(self, "ffn_dim", 4 * self.dim)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_head={self.n_heads} is not divisible by "
                             f"model.n_kv_heads={self.n_kv_heads}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"model.n_embd={self.dim} is not divisible by "
                             f"2 * model.n_head={2 * self.n_heads} (rotary pairs per head)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rotary(T: int, head_dim: int, theta: float, device) -> torch.Tensor:
    """(T, head_dim / 2) complex unit rotations ``exp(i t theta^(-2j/d))``, computed in every
    forward (a buffer would have no value on the meta device)."""
    inv = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Rotate (B, T, H, D) queries or keys: pairs (x[2j], x[2j+1]) as complex numbers."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * rot[None, :, None, :]).flatten(3).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention. (B, T, dim) -> (B, T, dim)."""

    def __init__(self, cfg: OwnDecoderConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.cfg.head_dim
        # -1 heads: all of them in one process, this rank's share under tensor parallelism
        q, k, v = (w(x).view(B, T, -1, hd) for w in (self.wq, self.wk, self.wv))
        rot = rotary(T, hd, self.cfg.rope_theta, x.device)
        q, k = apply_rotary(q, rot), apply_rotary(k, rot)
        rep = q.shape[2] // k.shape[2]  # query heads per key/value head (local = global)
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)  # (B, H, T, D)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """``w2(relu(w1 x)^2)``: squared ReLU. (B, T, dim) -> (B, T, dim)."""

    def __init__(self, cfg: OwnDecoderConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x)).square())


class ParallelBlock(nn.Module):
    """``x + attention(n) + feed_forward(n)`` with ``n = attention_norm(x)``: both branches
    read one normalised input and are summed into the residual together."""

    def __init__(self, cfg: OwnDecoderConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, bias=False)
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.attention_norm(x)
        return x + self.attention(n) + self.feed_forward(n)


class OwnDecoder(nn.Module):
    """``tok_embeddings -> layers[i] -> norm -> output``; ``forward(tokens (B, T))`` returns
    logits (B, T, vocab_size)."""

    def __init__(self, cfg: OwnDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(ParallelBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, bias=False)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # every value by an nn.init in-place write (the engine replays them on each rank);
        # torchtitan's choices: normal embeddings, truncated-normal matrices (within 2 std
        # by default, 3 std for the head), residual outputs scaled down (GPT-2)
        nn.init.normal_(self.tok_embeddings.weight)
        for name, p in self.named_parameters():
            if name.endswith(("wo.weight", "w2.weight")):
                nn.init.trunc_normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))
            elif name.startswith("layers.") and p.dim() == 2:
                nn.init.trunc_normal_(p, std=0.02)
        std = cfg.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


# -- what shardwise needs: layers, plan, description, registration --------------------------
def pipeline_layers(model: OwnDecoder) -> list[tuple[str, nn.Module]]:
    """The pipeline layers in order, under their names in the model: the first takes token
    ids, each passes (B, T, dim), the last returns logits. The final norm is a layer of its
    own (a stage boundary may fall between it and the head)."""
    return ([("tok_embeddings", model.tok_embeddings)]
            + [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
            + [("norm", model.norm), ("output", model.output)])


# Megatron's splits (Shoeybi et al. 2019): Q, K, V by heads (column), wo by its input (row);
# w1 column, w2 row; the vocabulary split in the embedding and the head; the norms
# token-wise (under sequence parallelism on this rank's slice of the sequence). The
# attention module enters the tensor-parallel region once for its three projections; w1
# enters on its own: both read the same normalised input.
TP_PLAN = {
    "tok_embeddings": "vocab_embedding",
    "layers.*.attention_norm": "sequence_parallel",
    "layers.*.attention": "attention",
    "layers.*.attention.w[qkv]": "column",
    "layers.*.attention.wo": "row",
    "layers.*.feed_forward.w1": "column",
    "layers.*.feed_forward.w2": "row",
    "norm": "sequence_parallel",
    "output": "vocab_head",
}


def describe(cfg: OwnDecoderConfig) -> shardwise.ModelDescription:
    return shardwise.ModelDescription(
        kind="own-decoder", config=cfg, build=lambda: OwnDecoder(cfg), layers=pipeline_layers,
        tp_plan=TP_PLAN, hidden_size=cfg.dim, vocab_size=cfg.vocab_size,
        block_size=cfg.block_size, n_layer=cfg.n_layers,
        attention_width=cfg.n_heads * cfg.head_dim,
        # tp splits whole heads, and each rank keeps the key/value heads its queries read
        tp_divides={"model.n_head (query heads)": cfg.n_heads,
                    "model.n_kv_heads (key/value heads)": cfg.n_kv_heads,
                    "model.ffn_hidden (MLP width)": cfg.ffn_dim})


def from_section(m, vocab_size: int) -> OwnDecoderConfig:
    """The config of a run's ``[model]`` section: n_layer, n_embd, n_head, n_kv_heads (0:
    n_head), ffn_hidden (0: 4 n_embd), block_size, norm_eps, rope_theta, vocab_size (0: the
    tokenizer's). The head is never tied and there are no biases: tie_weights and bias
    are not read."""
    if m.dropout:
        raise ValueError(f"model.dropout={m.dropout}: own-decoder has no dropout")
    return OwnDecoderConfig(vocab_size=m.vocab_size or vocab_size, block_size=m.block_size,
                            n_layers=m.n_layer, dim=m.n_embd, n_heads=m.n_head,
                            n_kv_heads=m.n_kv_heads or m.n_head, ffn_dim=m.ffn_hidden or None,
                            norm_eps=m.norm_eps, rope_theta=m.rope_theta)


shardwise.register_model("own-decoder", OwnDecoderConfig, describe, from_section)


# -- the demonstration: dp=2 x pp=2 x tp=2 against one process ------------------------------
SEED, STEPS, BATCH, LR, WEIGHT_DECAY = 0, 6, 16, 3e-3, 0.1
DP, PP, TP, MICRO_BATCHES = 2, 2, 2, 2
TOLERANCE = 1e-5  # fp32


def shakespeare_batches(cfg_block: int) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(vocab size, STEPS global batches (x, y) of (BATCH, block) token ids, y = x shifted)."""
    text = shardwise.load_text()  # the Shakespeare package's texts
    tokenizer = shardwise.CharTokenizer.from_text(text)
    ids = tokenizer.encode(text[:200_000])
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        start = torch.randint(len(ids) - cfg_block - 1, (BATCH,), generator=g)
        rows = torch.stack([ids[s:s + cfg_block + 1] for s in start.tolist()])
        out.append((rows[:, :-1], rows[:, 1:]))
    return tokenizer.vocab_size, out


def settings(cfg: OwnDecoderConfig) -> shardwise.EngineConfig:
    return shardwise.EngineConfig(
        seq_len=cfg.block_size,
        parallel={"schedule": "1f1b", "micro_batches": MICRO_BATCHES, "sequence_parallel": True,
                  "zero": 1},
        optimizer={"lr": LR, "weight_decay": WEIGHT_DECAY, "grad_clip": 0.0},
        training={"seed": SEED, "global_batch_size": BATCH})


def train_rank(cfg: OwnDecoderConfig, batches: list) -> dict:
    """One of the DP * PP * TP ranks: its dp replica's rows of every global batch."""
    import torch.distributed as dist

    topology = shardwise.init_process_groups(shardwise.Topology.build(
        dp=DP, pp=PP, tp=TP, rank=dist.get_rank(), world_size=dist.get_world_size()))
    engine = shardwise.Engine(describe(cfg), topology, settings(cfg))
    rows = BATCH // DP
    mine = slice(topology.dp_rank * rows, (topology.dp_rank + 1) * rows)
    losses = [engine.train_step(x[mine], y[mine])["loss"] for x, y in batches]
    return {"losses": losses, "params": engine.full_tensors()}


def one_process(cfg: OwnDecoderConfig, batches: list) -> dict:
    """The reference: the same model and AdamW (decay on matrices) in plain PyTorch."""
    torch.manual_seed(SEED)
    model = OwnDecoder(cfg)
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=LR, betas=(settings(cfg).optimizer.beta1, settings(cfg).optimizer.beta2),
        foreach=False)
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def main() -> None:
    probe = OwnDecoderConfig(vocab_size=1)
    vocab, batches = shakespeare_batches(probe.block_size)
    cfg = OwnDecoderConfig(vocab_size=vocab)
    with torch.device("meta"):
        n = sum(p.numel() for p in OwnDecoder(cfg).parameters())
    print(f"own-decoder: {n / 1e6:.2f}M parameters, vocab {vocab}; dp={DP} x pp={PP} (1f1b, "
          f"m={MICRO_BATCHES}) x tp={TP} (sequence parallel), ZeRO-1, {DP * PP * TP} gloo ranks")
    ranks = shardwise.spawn(train_rank, DP * PP * TP, (cfg, batches))
    ref = one_process(cfg, batches)
    for step, (a, b) in enumerate(zip(ranks[0]["losses"], ref["losses"]), 1):
        print(f"step {step}  loss {a:.6f}  (one process: {b:.6f})")
    loss_err = max(abs(a - b) / abs(b) for r in ranks for a, b in zip(r["losses"], ref["losses"]))
    param_err, covered = 0.0, set()
    for r in ranks:  # each rank holds its stage's parameters; every replica equals one process
        for name, t in r["params"].items():
            param_err = max(param_err, rel(t, ref["params"][name]))
            covered.add(name)
    assert covered == set(ref["params"]), set(ref["params"]) ^ covered
    print(f"max relative difference vs one process: loss {loss_err:.2e}, "
          f"parameters {param_err:.2e} (tolerance {TOLERANCE:g}; final loss "
          f"{ref['losses'][-1]:.4f}, from {ref['losses'][0]:.4f})")
    if max(loss_err, param_err) > TOLERANCE:
        raise SystemExit("parity failed")


if __name__ == "__main__":
    main()
