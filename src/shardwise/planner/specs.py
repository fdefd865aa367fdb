"""What the planner plans for: a decoder-only transformer's sizes, named or read from a TOML.

``ModelSpec`` holds the sizes the memory and time formulas need (layers L, width h, heads
a, vocabulary V, sequence s, tied embeddings, biases; key/value heads and the MLP width).
Two families:

- ``"gpt"``: shardwise's own GPT (``models.gpt``): pre-LayerNorm blocks with separate Q, K,
  V, output projections (no key bias), a 4h GELU MLP and learned positions;
- ``"llama"``: ``models.llama``: pre-RMSNorm blocks, grouped-query attention (``n_kv_heads``
  K and V heads of width h / a), a SwiGLU MLP of width f (gate, up, down: 3 h f), rotary
  positions (no parameters), no biases, head untied unless said.

Named sizes:

- GPT-2 (Radford et al. 2019, Table 2; vocab 50257, context 1024);
- GPT-3 (Brown et al. 2020, Table 2.1; context 2048; 13B's width 5140 rounded to 5120 so
  that the 40 heads divide it);
- Megatron-LM's weak-scaling series (Narayanan et al. SC 2021, Table 1: 1.7B ... 1T,
  vocab 51200, context 2048), which ``benchmarks/planner_published.py`` predicts;
- Llama: TinyLlama 1.1B (Zhang et al. 2024, arXiv:2401.02385, sec. 2.2), Llama 2 7B/13B/70B
  (Touvron et al. 2023, arXiv:2307.09288, Table 1; sizes of the released config.json),
  Llama 3 8B/70B/405B (Grattafiori et al. 2024, arXiv:2407.21783, Table 3; context 8192, the
  pre-training length: Llama 3.1's 128K is ``--seq 131072``).

A TOML model file has the ``[model]`` table of a ``shardwise train`` config (``n_layer``,
``n_head``, ``n_embd``, ``block_size``, ``vocab_size``, ``tie_weights``, ``bias``), so a
run's own config is a valid model file.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path


class SpecError(ValueError):
    """A model or cluster description the planner cannot use; one line naming the field."""


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of one GPT or Llama. ``params`` is the exact parameter count of shardwise's
    model of that family. ``n_kv_heads`` None: ``n_head`` (multi-head attention);
    ``ffn_hidden`` None: 4h (the GPT's MLP)."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    block_size: int
    tie_weights: bool = True
    bias: bool = True
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    family: str = "gpt"  # "gpt" or "llama" (module docstring)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_head

    @property
    def ffn(self) -> int:
        """MLP width f: ``ffn_hidden``, or 4h."""
        return self.ffn_hidden or 4 * self.n_embd

    @property
    def gated(self) -> bool:
        """SwiGLU (three h x f matrices) rather than GELU (two)."""
        return self.family == "llama"

    @property
    def pos_params(self) -> int:
        """Learned position embedding (GPT: s h); rotary positions have none."""
        return 0 if self.family == "llama" else self.block_size * self.n_embd

    @property
    def params(self) -> int:
        """Parameters of the unsharded model (tied head counted once)."""
        L, h, V = self.n_layer, self.n_embd, self.vocab_size
        return V * h + self.pos_params + L * block_params(h, self.bias, self) + head_params(self)

    def with_seq(self, seq: int) -> "ModelSpec":
        return replace(self, block_size=seq)


def block_matmul_params(spec: "ModelSpec") -> int:
    """Weights of one block's matrices: Q and output h^2 each, K and V h * kv_heads * h/a
    each, the MLP 2 h f (GELU) or 3 h f (SwiGLU). GPT: 12 h^2."""
    h = spec.n_embd
    kv = spec.kv_heads * (h // spec.n_head)
    return 2 * h * h + 2 * h * kv + (3 if spec.gated else 2) * h * spec.ffn


def block_params(h: int, bias: bool = True, spec: "ModelSpec | None" = None) -> int:
    """One transformer block. GPT (``spec`` None or a GPT spec with a 4h MLP): Q, K, V,
    output (4h^2; biases on Q, V, out), MLP (8h^2; biases 4h + h), two LayerNorms (2h each
    with bias, h without). Otherwise ``block_matmul_params`` + the biases (Q, V, out; the
    MLP's f, or 2f gated, + h) when ``bias`` + two norms."""
    b = 1 if bias else 0
    if spec is None or (not spec.gated and spec.ffn == 4 * h and spec.kv_heads == spec.n_head):
        return 12 * h * h + b * (3 * h + 5 * h) + 2 * (2 * h if bias else h)
    kv = spec.kv_heads * (h // spec.n_head)
    biases = b * (h + kv + h + (2 if spec.gated else 1) * spec.ffn + h)
    return block_matmul_params(spec) + biases + 2 * (2 * h if bias else h)


def head_params(spec: ModelSpec) -> int:
    """Final norm, plus the projection when it is not tied to the embedding."""
    ln = 2 * spec.n_embd if spec.bias else spec.n_embd
    return ln + (0 if spec.tie_weights else spec.vocab_size * spec.n_embd)


def _m(name, L, h, a, V, s) -> ModelSpec:
    return ModelSpec(name, L, h, a, V, s)


def _llama(name, L, h, a, kv, f, V, s) -> ModelSpec:
    return ModelSpec(name, L, h, a, V, s, tie_weights=False, bias=False, n_kv_heads=kv,
                     ffn_hidden=f, family="llama")


NAMED: dict[str, ModelSpec] = {m.name: m for m in [
    _m("gpt2-124m", 12, 768, 12, 50257, 1024),
    _m("gpt2-350m", 24, 1024, 16, 50257, 1024),
    _m("gpt2-774m", 36, 1280, 20, 50257, 1024),
    _m("gpt2-1.5b", 48, 1600, 25, 50257, 1024),
    _m("gpt3-2.7b", 32, 2560, 32, 50257, 2048),
    _m("gpt3-6.7b", 32, 4096, 32, 50257, 2048),
    _m("gpt3-13b", 40, 5120, 40, 50257, 2048),
    _m("gpt3-175b", 96, 12288, 96, 50257, 2048),
    # Narayanan et al. 2021, Table 1 (heads, hidden, layers)
    _m("megatron-1.7b", 24, 2304, 24, 51200, 2048),
    _m("megatron-3.6b", 30, 3072, 32, 51200, 2048),
    _m("megatron-7.5b", 36, 4096, 32, 51200, 2048),
    _m("megatron-18b", 40, 6144, 48, 51200, 2048),
    _m("megatron-39b", 48, 8192, 64, 51200, 2048),
    _m("megatron-76b", 60, 10240, 80, 51200, 2048),
    _m("megatron-146b", 80, 12288, 96, 51200, 2048),
    _m("megatron-310b", 96, 16384, 128, 51200, 2048),
    _m("megatron-530b", 105, 20480, 128, 51200, 2048),
    _m("megatron-1t", 128, 25600, 160, 51200, 2048),
    # name, layers, hidden, heads, kv heads, FFN width, vocab, context
    _llama("tinyllama-1.1b", 22, 2048, 32, 4, 5632, 32000, 2048),
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
]}

_FIELDS = {"n_layer": int, "n_head": int, "n_embd": int, "block_size": int, "vocab_size": int,
           "tie_weights": bool, "bias": bool}


def from_dict(name: str, table: dict, where: str = "model") -> ModelSpec:
    """A ``ModelSpec`` from a ``[model]`` table; ``SpecError`` naming the bad field."""
    vals = {"tie_weights": True, "bias": True, "block_size": 128, "vocab_size": 65}
    for key, value in table.items():
        if key in ("dropout",):
            continue
        if key not in _FIELDS:
            raise SpecError(f"{where}.{key}: unknown key; expected {', '.join(_FIELDS)}")
        want = _FIELDS[key]
        if want is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SpecError(f"{where}.{key}: expected a whole number >= 1, got {value!r}")
        if want is bool and not isinstance(value, bool):
            raise SpecError(f"{where}.{key}: expected true or false, got {value!r}")
        vals[key] = value
    for key in ("n_layer", "n_head", "n_embd"):
        if key not in vals:
            raise SpecError(f"{where}.{key}: missing")
    if vals["n_embd"] % vals["n_head"]:
        raise SpecError(f"{where}.n_embd={vals['n_embd']} is not divisible by "
                        f"{where}.n_head={vals['n_head']}")
    return ModelSpec(name, vals["n_layer"], vals["n_embd"], vals["n_head"], vals["vocab_size"],
                     vals["block_size"], vals["tie_weights"], vals["bias"])


def load_model(text: str) -> ModelSpec:
    """A named size (``NAMED``), or a TOML file whose ``[model]`` table gives the sizes."""
    if text in NAMED:
        return NAMED[text]
    path = Path(text)
    if not path.is_file():
        raise SpecError(f"--model {text!r}: neither a named size ({', '.join(NAMED)}) nor a "
                        "TOML file")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: not valid TOML: {exc}") from None
    table = data.get("model", data)
    if not isinstance(table, dict):
        raise SpecError(f"{path}: expected a [model] table")
    table = {k: v for k, v in table.items() if not isinstance(v, dict)}
    if table.get("vocab_size", 0) == 0:  # a train config: vocabulary from the tokenizer
        table["vocab_size"] = 65
    return from_dict(path.stem, table, where=f"{path}: model")


def positive_number(text: str, flag: str, integer: bool = False) -> float:
    """Parse a size given on the command line: finite, > 0 (whole with ``integer``)."""
    try:
        value = float(text)
    except ValueError:
        raise SpecError(f"{flag} {text!r}: expected a number") from None
    if not math.isfinite(value) or value <= 0 or (integer and value != int(value)):
        raise SpecError(f"{flag} {text!r}: expected a finite {'whole ' if integer else ''}"
                        "number > 0")
    return int(value) if integer else value
