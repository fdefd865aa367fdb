"""The language model under ``shardwise train``: its checks at the door (the user's model
module, the kind, the corpus and the model it implies), its per-rank entry point and its
closing line."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from shardwise import checkpoint, comm
from shardwise.apps.lm.model import describe_layout
from shardwise.apps.lm.text import check_corpus, check_tokenizer, token_unit
from shardwise.apps.lm.trainer import Trainer
from shardwise.base.config import Config
from shardwise.base.topology import Topology, init_process_groups
from shardwise.base.words import count
from shardwise.data.tokenizer import tokenizer_from_state
from shardwise.engine.engine import BLOCK_CAUSAL_NEEDS_EOS
from shardwise.launch import rank_device
from shardwise.models import describe_section
from shardwise.parallel.tensor_parallel.group import RankGroup
from shardwise.parallel.tensor_parallel.plan import check_divisible
from shardwise.training.console import status


def train_rank(cfg_dict: dict, device: torch.device | None = None,
               resume: bool | str = False) -> dict:
    """Build topology and trainer on this rank, train, write outputs; returns ``run_loop``'s
    summary (``step``, ``loss``, ``val_loss``, ``elapsed_s``).

    ``resume``: a checkpoint path (the launcher chose and verified it), ``True`` for the
    newest usable one of ``checkpoint_dir``, or ``False``. Expects ``torch.distributed`` to
    be initialised with ``dp * pp * cp * tp`` ranks; ``device``: None for the process group's
    (CUDA with NCCL, else the CPU).
    """
    cfg = Config.from_dict(cfg_dict)
    p = cfg.parallel
    comm.configure(timeout_s=p.timeout_s)  # a missing peer raises, naming the collective
    topology = init_process_groups(Topology.build(p.dp, p.pp, p.tp, cp=p.cp,
                                                  rank=dist.get_rank(),
                                                  world_size=dist.get_world_size(), ep=p.ep,
                                                  dp_replicate=p.dp_replicate))
    device = device or rank_device(cfg.training.device)
    tokenizer = None
    if isinstance(resume, str):
        latest = Path(resume)
    else:
        latest = checkpoint.find_resumable(cfg.checkpoint_dir)[0] if resume else None
    if latest is not None:
        tokenizer = tokenizer_from_state(checkpoint.read_meta(latest)["tokenizer"])
    trainer = Trainer(cfg, topology, device, tokenizer=tokenizer)
    if topology.rank == 0:
        n = _full_size(trainer.description)
        source = f" from {cfg.model.init_from}" if cfg.model.init_from else ""
        unit = token_unit(trainer.tokenizer) + "s"
        status(f"shardwise: {trainer.description.kind} {n / 1e6:.2f}M parameters{source}, "
               f"vocab {trainer.tokenizer.vocab_size}{_model_vocab(trainer)}, "
               f"{len(trainer.train_tokens):,} train / {len(trainer.val_tokens):,} val {unit}; "
               f"{describe_layout(cfg)}, {_where(device)}, "
               f"{count(torch.get_num_threads(), 'thread')} per rank")
        mem = trainer.engine.memory_bytes()
        status(f"shardwise: rank 0 holds {_mib(mem['params'])} parameters, "
               f"{_mib(mem['grads'])} gradients, {_mib(mem['optimizer'])} optimizer state "
               f"({_mib(mem['total'])}; `shardwise memory` predicts every layout)")
    if latest is not None:
        trainer.resume(latest)
        if topology.rank == 0:
            status(f"shardwise: resumed from {latest} at step {trainer.step} "
                   "(--fresh starts over, keeping the old checkpoints)")
    try:
        summary = trainer.fit()
        trainer.wait_for_checkpoint()  # checkpoint.async_save: the last one is complete
        trainer.finish()
    finally:
        if trainer.ft is not None:  # leave the quorum
            trainer.ft.shutdown()
    return {**summary, "unit": token_unit(trainer.tokenizer)}


def check_config(cfg: Config) -> None:
    """At the door, on the launcher: import ``model.module`` (the user's code that registers
    a model) and look ``model.kind`` up; ``ValueError`` (one line naming the field) when
    either fails. Every rank imports the module again (``models.describe_section``)."""
    from shardwise.models import section_kind

    section_kind(cfg.model)
    if cfg.fault_tolerance.enable:
        check_fault_tolerance(cfg)


def check_fault_tolerance(cfg: Config) -> None:
    """With ``fault_tolerance.enable``, what the replica groups of a torchft job need of the
    other sections (each group its own job; docs/reliability.md): ``ValueError``, one line."""
    p, t, n = cfg.parallel, cfg.training, cfg.fault_tolerance.group_size
    if p.dp_replicate > 1:
        raise ValueError(f"fault_tolerance.enable with parallel.dp_replicate={p.dp_replicate}: "
                         "each replica group is its own job; set parallel.dp_replicate = 1")
    if p.ep > 1 or cfg.model.experts:
        raise ValueError("fault_tolerance.enable with experts (parallel.ep, model.n_experts): "
                         "their sync spans one job's ranks, not the replica groups")
    if p.schedule == "pipedream":
        raise ValueError("fault_tolerance.enable with parallel.schedule=pipedream: a step is "
                         "committed or redone as a whole; PipeDream has no step boundary")
    if t.global_batch_size % (n * p.dp * p.micro_batches):
        raise ValueError(f"training.global_batch_size={t.global_batch_size} must be divisible "
                         f"by fault_tolerance.group_size x parallel.dp x parallel.micro_batches"
                         f" = {n} x {p.dp} x {p.micro_batches} (each replica group trains its "
                         "slot of the global batch)")


def check_model(cfg: Config, vocab_size: int, eos_id: int | None = None) -> None:
    """The model ``cfg`` implies: the ``[model]`` section through the kind's
    ``from_section`` with ``vocab_size``, tp dividing what its plan splits
    (``ModelDescription.tp_divides``: n_kv_heads for the Llama), and
    under ``attention_mask = "block_causal"`` a tokenizer end-of-text id (``eos_id``) to
    end documents at, ``lora.targets`` matching linear layers of the blocks.
    ``ValueError``, one line naming the field."""
    d = describe_section(cfg.model, vocab_size)
    if d.attention_mask == "block_causal" and eos_id is None:
        raise ValueError(BLOCK_CAUSAL_NEEDS_EOS)
    p = cfg.parallel
    check_divisible(d, RankGroup(size=p.tp, axis="parallel.tp"))
    if cfg.lora.rank:  # lora.targets against the model's linear layers, on meta
        import torch

        from shardwise.parallel.lora import apply_lora

        with torch.device("meta"):
            apply_lora(d.build(), cfg.lora.targets, cfg.lora.rank, cfg.lora.alpha, 0.0,
                       styles=d.style_of)


def check_data(cfg: Config) -> None:
    """At the door: the corpus (``apps.lm.text.check_corpus``: a text file, or a prepared
    directory and its checksums), then the model it implies with the corpus's vocabulary
    (the character tokenizer's, or the prepared tokenizer's): ``check_model``, at most
    ``model.vocab_size`` tokens when that is set; with ``model.init_from``, the checkpoint's
    tensors against its config.json (``apps.lm.hf.check_init_from``).
    ``DataError`` / ``ValueError``, one line."""
    from shardwise.apps.lm.hf import check_init_from
    from shardwise.data import load_text
    from shardwise.data.shards import is_prepared_dir, read_manifest

    eos = None  # the character tokenizer of a text has no end-of-text token
    if is_prepared_dir(cfg.data.path):
        check_corpus(cfg)
        manifest = read_manifest(cfg.data.path)
        vocab, eos = manifest["vocab_size"], manifest["tokenizer"].get("eos_id")
    else:
        text = load_text(cfg.data.path)
        check_corpus(cfg, text)
        vocab = len(set(text))
    check_init_from(cfg, vocab)
    if cfg.model.vocab_size and vocab > cfg.model.vocab_size:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size}: the tokenizer has {vocab} "
                         "ids; it must not be larger")
    check_model(cfg, vocab, eos)


def check_resumable(path: str | Path, cfg: Config) -> None:
    """At the door, before resuming ``path``: on a prepared directory, the checkpoint's
    tokenizer must be the directory's (``DataError``)."""
    saved = checkpoint.read_meta(path).get("tokenizer")
    if saved is not None:  # each rank rebuilds it from there: refused here, in one line
        from shardwise.data import DataError

        try:
            tokenizer_from_state(saved)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise DataError(f"{Path(path) / 'meta.json'}: its tokenizer does not read "
                            f"({type(e).__name__}: {e}); --fresh starts over (the old "
                            "checkpoints are kept)") from None
    check_tokenizer(cfg, saved)


def resolve(cfg: Config) -> Config:
    """At the door and on every rank: ``cfg`` with what files decide filled in
    (``model.init_from``: the model of its config.json, ``apps.lm.hf.resolve_init_from``)."""
    from shardwise.apps.lm.hf import resolve_init_from

    return resolve_init_from(cfg)


def summary(result: dict) -> str:
    """The end of the closing line: final train and validation loss (nats per char, or per
    token with a prepared tokenizer)."""
    unit = result.get("unit", "char")
    return (f"final train loss {result['loss']:.4f}, validation loss "
            f"{result['val_loss']:.4f} nats/{unit}")


def _model_vocab(trainer) -> str:
    v = trainer.description.vocab_size
    return f" (the model's {v})" if v != trainer.tokenizer.vocab_size else ""


def _where(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _full_size(description) -> int:
    """Parameters of the single-process model (what every layout trains; a tied matrix
    once), counted on the meta device: nothing is allocated."""
    with torch.device("meta"):
        return sum(p.numel() for p in description.build().parameters())
