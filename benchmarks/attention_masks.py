"""What a forward keeps of its attention masks for backward, shared against built per call.

A small Llama (4 layers by default, T = 2048, B = 1, fp32) runs one forward on the CPU inside
``torch.autograd.graph.saved_tensors_hooks``; every tensor autograd saves is recorded by its
storage, and the masks among them (bool, or float holding -inf and needing no gradient:
``models.gpt._mask``'s two forms) are summed, once per distinct storage. Three settings:
``block_causal`` (documents of 300 tokens packed), a sliding window of W = 256 in query chunks
of 256 (8 chunks), and both. ``shared``: as ``causal_attention`` runs
(``models.sequence.shared_mask``); ``per call``: the same forward with the sharing switched
off (``shared_mask`` builds every time), which is what the code before it kept (checked
against that code, 3dee855: the same storages and bytes; SDPA turns a bool mask into a
fresh additive copy on every call and saves that; the written-out scores save a fresh
inverted mask). ``saved MiB``: every tensor the forward saved, masks included,
each storage once (activations and weights alike). Under a minute on 2 CPU cores:

    python benchmarks/attention_masks.py

Writes ``benchmarks/attention_masks_results/attention_masks.md`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import torch

from shardwise.models import gpt, sequence
from shardwise.models.llama import Llama, LlamaConfig

OUT = Path(__file__).resolve().parent / "attention_masks_results"
EOS = 3
SETTINGS = {  # name -> (Llama options, document ids)
    "block_causal": ({"attention_mask": "block_causal"}, True),
    "window": ({"sliding_window": None}, False),
    "window + block_causal": ({"sliding_window": None, "attention_mask": "block_causal"}, True),
}


def _is_mask(t: torch.Tensor) -> bool:
    return t.dtype == torch.bool or (t.is_floating_point() and not t.requires_grad
                                     and bool(torch.isneginf(t).any()))


def measure(setting: str, impl: str, shared: bool, args) -> dict:
    """One forward's saved tensors: mask calls, distinct mask storages and their bytes, and
    every saved storage's bytes."""
    options, with_docs = SETTINGS[setting]
    options = {k: (args.window if v is None else v) for k, v in options.items()}
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, block_size=args.length, n_layer=args.layers,
                              n_head=4, n_kv_heads=2, n_embd=64, attention=impl, **options))
    idx = torch.randint(EOS + 1, 256, (1, args.length), generator=torch.Generator().manual_seed(0))
    idx[:, args.document - 1::args.document] = EOS
    shard = (sequence.SequenceShard(documents=sequence.document_ids(idx, EOS))
             if with_docs else None)
    masks, saved, calls = {}, {}, 0

    def pack(t):
        nonlocal calls
        st = t.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        if _is_mask(t):
            calls += 1
            masks[st.data_ptr()] = st.nbytes()
        return t

    build_always = lambda shard, key, build: build()  # noqa: E731
    real = sequence.shared_mask
    sequence.shared_mask = real if shared else build_always
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), sequence.use(shard):
            model(idx)
    finally:
        sequence.shared_mask = real
    return {"setting": setting, "impl": impl, "shared": shared, "mask_calls": calls,
            "masks": len(masks), "mask_mib": sum(masks.values()) / 2 ** 20,
            "saved_mib": sum(saved.values()) / 2 ** 20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--document", type=int, default=300, help="tokens per packed document")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    from shardwise.perf.peak import cpu_name

    command = "python " + " ".join(["benchmarks/attention_masks.py"] + sys.argv[1:])
    c = gpt.window_chunk(args.length, args.window)
    lines = ["# Attention masks kept for backward: shared against built per call", "",
             f"`{command}`", "",
             (f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, python "
              f"{platform.python_version()}. Llama, {args.layers} layers, n_embd 64, 4 heads "
              f"(2 kv), B = 1, T = {args.length}, fp32, one forward; window W = "
              f"{args.window} in query chunks of c = {c} ({-(-args.length // c)} chunks); "
              f"documents of {args.document} tokens. calls: the masks autograd saved (one "
              "per layer and chunk); masks: the distinct storages among them; saved MiB: "
              "every saved storage, once. per call: with the sharing switched off, what the "
              "code before it kept."), "",
             "| setting | attention | calls | masks, shared | masks, per call | "
             "mask MiB, shared | mask MiB, per call | saved MiB, shared | saved MiB, per call |",
             "|---|---|---|---|---|---|---|---|---|"]
    for setting in SETTINGS:
        for impl in ("sdpa", "math"):
            new, old = (measure(setting, impl, shared, args) for shared in (True, False))
            assert new["mask_calls"] == old["mask_calls"]
            lines.append(f"| {setting} | {impl} | {new['mask_calls']} | {new['masks']} | "
                         f"{old['masks']} | {new['mask_mib']:.2f} | {old['mask_mib']:.2f} | "
                         f"{new['saved_mib']:.1f} | {old['saved_mib']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_masks.md").write_text(text)


if __name__ == "__main__":
    main()
