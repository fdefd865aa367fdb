"""Our forward, gradients and export against ``transformers``, one row per Hugging Face
checkpoint shardwise reads and writes: every architecture of ``models.hf.ARCHS`` (GPT-2,
Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Mixtral, Phi-3, Gemma, Gemma 2, Gemma 3,
Gemma 3 multimodal, DeepSeek-V2, DeepSeek-V3) and the variants ``tests/test_hf.py`` checks
(a Qwen3-MoE whose top k is not renormalised; a Mistral, a Qwen2, a Qwen2-MoE and a Phi-3
with a sliding window of 8 tokens). The checkpoints are ``tests/hf_models.py``'s, the tests'
own: 2 layers of 64 wide (the DeepSeeks 3 of 32), random weights, fp32, saved with
``save_pretrained``.

Each is loaded through shardwise's own checkpoint path (``model.init_from = "hf:DIR"``: the
config read at the door, ``Engine`` reading each rank's slice of the safetensors), fed the
same 2 x 32 tokens as transformers' ``AutoModelForCausalLM`` of the same directory, and:

- ``tp1``: the engine's logits in one process, SDPA (``model.attention = "sdpa"``, the
  default): the largest |difference| from transformers' logits, and the relative error
  ``||ours - theirs|| / ||theirs||`` (Frobenius, over all 2 x 32 x 97 logits);
- ``math``: the same weights with the scores written out (``model.attention = "math"``);
- ``tp2``: the engine at tp = 2 (2 gloo ranks, each loading its slices), the logits gathered
  over tp; ``ep2``: a mixture of experts at dp2 x ep2, each rank loading its two experts;
  one spawn of 2 ranks for every checkpoint (``tests/hf_workers.py``'s ``imported_logits``);
- ``grad``: the cross-entropy's gradient of every parameter in one process (our model
  holding the engine's imported weights) against transformers' (written by transformers'
  own ``save_pretrained`` so that its tensors carry the on-disk names ours export to): the
  largest ``max |g_ours - g_theirs| / max |g_theirs|`` over the tensors. A mixture's
  auxiliary loss is set to 0 here: transformers adds its own only with
  ``output_router_logits``;
- ``export``: the engine's tensors saved as a run's checkpoint (with its source
  config.json) and ``shardwise export``ed (``export_hf``): "bit-exact" when
  ``from_pretrained`` of the export holds every tensor of the source bit for bit (the
  multimodal Gemma 3: its language model's, exported as a text-only ``Gemma3ForCausalLM``)
  and its logits equal the source's exactly.

The tests bound all of these at 1e-5 (``tests/test_hf.py``); this prints what they are.
fp32, seeded tokens and weights, so a rerun on the same machine, threads and versions
prints the same table. Writes ``OUT/hf_parity.md`` and ``OUT/hf_parity.json``.

    OMP_NUM_THREADS=2 python benchmarks/hf_parity.py      # 1-1.5 min on 2 shared cores
    python benchmarks/hf_parity.py --only gemma gemma3 --no-spawn
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from hf_models import BUILDERS, VOCAB, save  # noqa: E402

from shardwise.models.hf import ARCHS  # noqa: E402

OUT = REPO / "benchmarks" / "hf_parity_results"
MIXTURES = ("mixtral", "qwen3moe", "qwen3moe_raw", "qwen2moe", "qwen2moe_swa", "deepseek_v3",
            "deepseek_v2")  # the rows with an ep2 column (DeepSeek's too: routed experts)
SEQ = 32


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """The batch every row is fed, and the targets of its cross-entropy: (2, 32) each."""
    g = torch.Generator().manual_seed(2)
    return (torch.randint(0, VOCAB, (2, SEQ), generator=g),
            torch.randint(0, VOCAB, (2, SEQ), generator=g))


def machine() -> dict:
    """The CPU, its cores, the threads, the versions and the load: the table's context."""
    from shardwise.perf.peak import cpu_name

    cpu = cpu_name()
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "rank_threads": 1, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "load_average": round(os.getloadavg()[0], 2)}


def _diff(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, float]:
    """(max |ours - theirs|, ||ours - theirs|| / ||theirs||), in float64."""
    a, b = ours.detach().double(), theirs.detach().double()
    return float((a - b).abs().max()), float((a - b).norm() / b.norm())


def _description(section: dict, source: dict, **changes):
    from shardwise.base.config import ModelConfig
    from shardwise.models.description import describe_section

    cfg = ModelConfig(**{**section, **changes})
    return describe_section(cfg, VOCAB).with_checkpoint_arch(source)


def _their_grads(theirs, logits: torch.Tensor, targets: torch.Tensor, work: Path) -> dict:
    """transformers' gradients of the cross-entropy under the names its ``save_pretrained``
    writes (the on-disk names, which ``to_hf_tensors`` writes ours under: transformers 5
    fuses some tensors in memory, the experts among them)."""
    from safetensors.torch import load_file

    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    with torch.no_grad():
        for p in theirs.parameters():
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
    theirs.save_pretrained(work)
    out = {}
    for f in sorted(work.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def measure(name: str, src: Path, work: Path) -> dict:
    """One row without the spawned columns: ``tp1``, ``math``, ``grad`` and ``export`` of
    the checkpoint at ``src`` (``work``: an empty directory for the run, the export and the
    gradients)."""
    from shardwise import checkpoint
    from shardwise.apps.lm.export import export_hf
    from shardwise.apps.lm.hf import check_init_from, resolve_init_from
    from shardwise.base.config import Config
    from shardwise.base.topology import Topology
    from shardwise.checkpoint.hf import read_config
    from shardwise.engine import Engine, EngineConfig
    from shardwise.engine.state import logical_tensors, model_tensors
    from shardwise.models.description import describe_section
    from shardwise.models.hf import section_of, to_hf_tensors

    idx, targets = tokens()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        want = theirs(idx).logits
    row = {"name": name, "architecture": type(theirs).__name__}

    # shardwise's door and loader: init_from = hf:DIR, as `shardwise train` reads it
    cfg = resolve_init_from(Config.from_dict({"model": {"init_from": f"hf:{src}"}}))
    check_init_from(cfg, VOCAB)
    d = describe_section(cfg.model, VOCAB)
    engine = Engine(d, Topology.build(1, 1, 1), EngineConfig(
        seq_len=SEQ, init_from=str(src), optimizer={"grad_clip": 0.0},
        training={"global_batch_size": 1}))
    with engine.evaluating(), torch.no_grad():
        ours = engine._logits(idx)[..., :VOCAB]
    row["tp1_max"], row["tp1_rel"] = _diff(ours, want)
    tensors = {**model_tensors(engine), **dict(engine.local.named_buffers())}

    source = read_config(src)
    section = section_of(source)
    if d.kind == "llama":  # the GPT has one attention kernel
        math = _description(section, source, attention="math").build().eval()
        math.load_state_dict(tensors, strict=False)
        with torch.no_grad():
            row["math_max"], row["math_rel"] = _diff(math(idx)[0][..., :VOCAB], want)

    aux = {"moe_aux_loss_coef": 0.0} if d.n_experts else {}
    gd = _description(section, source, **aux)
    model = gd.build().eval()
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= ({gd.tied[1]} if gd.tied else set()), missing
    logits = model(idx)[0][..., :VOCAB]
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    ours_g = to_hf_tensors(gd, {n: p.grad for n, p in model.named_parameters()})
    theirs.zero_grad()
    theirs_g = _their_grads(theirs, theirs(idx).logits, targets, work / "grads")
    row["grad"] = max(float((ours_g[k] - theirs_g[k]).abs().max() / theirs_g[k].abs().max())
                      for k in ours_g)
    row["grad_tensors"] = len(ours_g)

    tokenizer = {"kind": "char", "chars": [chr(33 + i) for i in range(VOCAB)]}
    # the trainer's checkpoint of the engine (its parameters and training-state buffers)
    checkpoint.save(work / "run" / "checkpoints", 1, logical_tensors(engine),
                    {"step": 1, "config": cfg.model_dump(), "tokenizer": tokenizer,
                     "hf_config": source})
    export_hf(work / "run", work / "out")
    original = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    exported = transformers.AutoModelForCausalLM.from_pretrained(work / "out").eval()
    language_model = getattr(getattr(original, "model", None), "language_model", None)
    if language_model is not None:  # multimodal: exported text-only
        a = language_model.state_dict()
        b = {k.removeprefix("model."): v for k, v in exported.state_dict().items()
             if k != "lm_head.weight"}
    else:
        a, b = original.state_dict(), exported.state_dict()
    with torch.no_grad():
        same_logits = torch.equal(exported(idx).logits, want)
    row["export_tensors"] = len(a)
    row["export_exact"] = (a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                           and same_logits)
    row["exported_as"] = type(exported).__name__
    return row


def spawned(dirs: dict[str, Path]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Rank 0's logits at tp = 2 for every directory, and at dp2 x ep2 for the mixtures:
    one spawn of 2 gloo ranks, 1 thread each."""
    from hf_workers import imported_logits

    from shardwise.launch import spawn

    idx, _ = tokens()
    ep = [str(p) for n, p in dirs.items() if n in MIXTURES]
    out = spawn(imported_logits, 2, ([str(p) for p in dirs.values()], idx, 2, ep), threads=1)
    return out[0][:len(dirs)], out[0][len(dirs):]


def _e(x: float | None) -> str:
    return "" if x is None else "0" if x == 0 else f"{x:.1e}"


def table(rows: list[dict], info: dict, seconds: float, command: str) -> str:
    """The results as Markdown: the machine, then one line per checkpoint."""
    head = (f"`{command}`: {info['cpu']}, {info['cores']} cores, {info['torch_threads']} "
            f"torch threads (spawned ranks: {info['rank_threads']} each), torch "
            f"{info['torch']}, transformers {info['transformers']}, Python {info['python']}; "
            f"load average {info['load_average']}; {seconds:.0f} s. fp32, 2 x {SEQ} tokens. "
            "max: largest |ours - transformers'| logit; rel: ||ours - theirs|| / ||theirs||; "
            "grad: largest max|dg| / max|g| over the parameters; export: shardwise export's "
            "tensors and logits against the source, bit for bit.\n\n")
    lines = ["| checkpoint | transformers class | tp1 max | tp1 rel | math max | tp2 max | "
             "tp2 rel | dp2 x ep2 max | grad | export |", "|---" * 10 + "|"]
    for r in rows:
        export = ("bit-exact" if r["export_exact"] else "DIFFERS") + f" ({r['export_tensors']})"
        lines.append(f"| {r['name']} | {r['architecture']} | {_e(r['tp1_max'])} | "
                     f"{_e(r['tp1_rel'])} | {_e(r.get('math_max'))} | {_e(r.get('tp2_max'))} | "
                     f"{_e(r.get('tp2_rel'))} | {_e(r.get('ep2_max'))} | {_e(r['grad'])} | "
                     f"{export} |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=sorted(BUILDERS), help="these checkpoints")
    ap.add_argument("--no-spawn", action="store_true", help="skip the tp2 / ep2 columns")
    ap.add_argument("--out", type=Path, default=OUT, help="results directory (none: '-')")
    args = ap.parse_args(argv)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    names = args.only or list(BUILDERS)
    covered = {a.architecture for a in ARCHS}
    start = time.perf_counter()
    info = machine()
    print(f"{info['cpu']}, {info['cores']} cores, {info['torch_threads']} torch threads; "
          f"torch {info['torch']}, transformers {info['transformers']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dirs = {n: save(n, root / "hf") for n in names}
        rows = [measure(n, dirs[n], root / "work" / n) for n in names]
        if not args.no_spawn:
            idx, _ = tokens()
            want = {n: transformers.AutoModelForCausalLM.from_pretrained(p).eval()
                    for n, p in dirs.items()}
            with torch.no_grad():
                want = {n: m(idx).logits for n, m in want.items()}
            tp2, ep2 = spawned(dirs)
            ep_names = [n for n in names if n in MIXTURES]
            for row, got in zip(rows, tp2):
                row["tp2_max"], row["tp2_rel"] = _diff(got[..., :VOCAB], want[row["name"]])
            for n, got in zip(ep_names, ep2):
                row = next(r for r in rows if r["name"] == n)
                row["ep2_max"], row["ep2_rel"] = _diff(got[..., :VOCAB], want[n])
    seconds = time.perf_counter() - start
    seen = {r["architecture"] for r in rows}
    if not args.only and not covered <= seen:
        raise SystemExit(f"no row for {sorted(covered - seen)}: add a builder to "
                         "tests/hf_models.py")
    command = "python benchmarks/hf_parity.py" + (f" {' '.join(argv)}" if argv else "")
    text = table(rows, info, seconds, command)
    print(text)
    if str(args.out) != "-":
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hf_parity.md").write_text(text)
        (args.out / "hf_parity.json").write_text(json.dumps(
            {"command": command, "machine": info, "seconds": round(seconds, 1), "rows": rows},
            indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
