"""Chat data (issue 46, first part): ``shardwise prepare --chat`` renders JSONL conversations
with the tokenizer's chat template and writes a loss mask that covers exactly the
assistant's tokens; training on it takes the mean over the global batch's target tokens,
the same in dp 2, tp 2, pp 2 and cp 2 (2 micro-batches, block_causal packing) as in one
process. No network: the tokenizer is a byte-level BPE trained here. The parity test
spawns 2 ranks once (every layout in turn)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ddp_workers import tiny_config, train
from helpers import assert_one_line_exit_2, rel_err
from layout_workers import layouts_worker, val_loss_worker
from shardwise.data import prepare as prep
from shardwise.data.sampler import IGNORE_INDEX, DistributedBatchSampler
from shardwise.data.shards import load_prepared
from shardwise.launch import spawn

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
RTOL = 1e-5


def _conversations(n: int = 60) -> list[dict]:
    g = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "zeta"]
    out = []
    for i in range(n):
        say = lambda k: " ".join(g.choice(words, size=k))  # noqa: E731
        if i % 3 == 0:  # the prompt/response form
            out.append({"prompt": say(3 + i % 5), "response": say(2 + i % 7)})
        else:  # several turns, a system prompt on some
            msgs = [{"role": "system", "content": "be brief"}] if i % 2 else []
            for t in range(1 + i % 3):
                msgs += [{"role": "user", "content": say(2 + (i + t) % 6)},
                         {"role": "assistant", "content": say(1 + (i * t) % 9)}]
            out.append({"messages": msgs})
    return out


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> tuple[Path, list[dict]]:
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("chat")
    convs = _conversations()
    raw = tmp / "text.txt"
    raw.write_text("\n".join(json.dumps(c) for c in convs) + TEMPLATE, encoding="utf-8")
    tok = prep.train_bpe(iter([[(raw.read_text(), True, 0)]]), 300)
    (tmp / "tok").mkdir()
    tok.save(str(tmp / "tok" / "tokenizer.json"))
    (tmp / "tok" / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    data = tmp / "chat.jsonl"
    data.write_text("\n".join(json.dumps(c) for c in convs) + "\n", encoding="utf-8")
    out = tmp / "prepared"
    prep.prepare(prep.PrepareOptions(inputs=(str(data),), out=str(out),
                                     tokenizer=str(tmp / "tok" / "tokenizer.json"),
                                     chat=True, val_fraction=0.2, progress=False))
    return out, convs


def test_mask_covers_exactly_the_assistant_tokens(chat_dir):
    root, convs = chat_dir
    d = load_prepared(root, checksums=True)
    ids = np.concatenate([d.train[:].numpy(), d.val[:].numpy()])
    mask = np.concatenate([d.train_mask[:].numpy(), d.val_mask[:].numpy()])
    eos = d.tokenizer.eos_id
    assert len(ids) == len(mask) and set(np.unique(mask)) == {0, 1}
    assert (mask[ids == eos] == 0).all()  # the separators are not targets
    docs = np.split(np.arange(len(ids)), np.flatnonzero(ids == eos))
    assert len(docs) == len(convs)
    for doc, conv in zip(docs, convs):
        doc = doc[ids[doc] != eos]
        msgs = conv.get("messages") or [{"role": "user", "content": conv["prompt"]},
                                        {"role": "assistant", "content": conv["response"]}]
        want = [m["content"] + "<|end|>\n" for m in msgs if m["role"] == "assistant"]
        # the runs of targets, decoded: each assistant turn and its end marker, nothing else
        runs = np.split(doc, np.flatnonzero(np.diff(mask[doc])) + 1)
        got = [d.tokenizer.decode(ids[r].tolist()) for r in runs if mask[r[0]]]
        assert got == want
        rest = "".join(d.tokenizer.decode(ids[r].tolist()) for r in runs if not mask[r[0]])
        assert rest == "".join("<|assistant|>" if m["role"] == "assistant" else
                               f"<|{m['role']}|>{m['content']}<|end|>\n" for m in msgs)


def test_sampler_marks_masked_targets_and_counts_the_global_batch(chat_dir):
    root, _ = chat_dir
    d = load_prepared(root)
    s = DistributedBatchSampler(d.train, 16, 8, dp_rank=1, dp_size=2, mask=d.train_mask)
    idx = s.global_indices()
    x, y = s.next_batch()
    pos = idx[4:, None] * 16 + torch.arange(1, 17)
    assert torch.equal(y == IGNORE_INDEX, d.train_mask[pos] == 0)
    assert s.global_targets == int((d.train_mask[idx[:, None] * 16 + torch.arange(1, 17)]
                                    != 0).sum())


def test_losses_skip_masked_targets_and_divide_by_the_given_count():
    """Both loss paths (plain and vocabulary-parallel, tp of one rank): masked targets add
    nothing, the sum is divided by the given count; a micro-batch of no targets is 0, not
    NaN; with no mask, the plain mean bit for bit (value and gradient)."""
    import torch.nn.functional as F

    from shardwise.engine.model import lm_loss_fp32
    from shardwise.parallel.tensor_parallel.group import RankGroup
    from shardwise.parallel.tensor_parallel.loss import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (2, 6), generator=g)
    masked = targets.masked_fill(torch.rand(2, 6, generator=g) < 0.5, IGNORE_INDEX)
    keep = masked != IGNORE_INDEX
    want = F.cross_entropy(logits[keep], targets[keep], reduction="sum") / 17.0
    tp1 = RankGroup(axis="tp")

    def vp(x, t, d=None):
        return vocab_parallel_cross_entropy(x, t, tp1, denominator=d)

    def vp_mean(x, t):  # the mean the vocabulary-parallel path took before masks
        return vocab_parallel_cross_entropy(x, t, tp1, reduction="none").mean()

    plain_mean = lambda x, t: F.cross_entropy(x.flatten(0, 1), t.flatten())  # noqa: E731
    for loss, mean in ((lm_loss_fp32, plain_mean), (vp, vp_mean)):
        torch.testing.assert_close(loss(logits, masked, 17), want)
        none = loss(logits, torch.full_like(targets, IGNORE_INDEX), 17)
        none.backward()
        assert none.item() == 0.0 and torch.isfinite(logits.grad).all()
        logits.grad = None
        plain = loss(logits, targets)
        (g1,) = torch.autograd.grad(plain, logits)
        ref = mean(logits, targets)
        (g2,) = torch.autograd.grad(ref, logits)
        assert plain.item() == ref.item() and torch.equal(g1, g2)


def test_bad_chat_options_are_one_line(tmp_path, capsys, chat_dir):
    data = tmp_path / "c.jsonl"
    data.write_text('{"messages": [{"role": "user"}]}\n', encoding="utf-8")
    tok = chat_dir[0] / "tokenizer.json"  # no tokenizer_config.json beside it
    base = ["prepare", str(data), "--out", str(tmp_path / "o")]
    assert_one_line_exit_2(base + ["--chat", "--tokenizer", "bpe"], capsys, "--chat")
    assert_one_line_exit_2(base + ["--chat", "--tokenizer", str(tok)], capsys,
                           "chat_template", "--chat-template")
    tpl = tmp_path / "t.jinja"
    tpl.write_text(TEMPLATE, encoding="utf-8")
    assert_one_line_exit_2(base + ["--chat", "--tokenizer", str(tok), "--chat-template",
                                   str(tpl)], capsys, "c.jsonl:1", "messages")
    assert not (tmp_path / "o").exists()
    # the command line's own path, the template from a file: exit 0, a loss mask listed
    from shardwise.cli.main import main

    data.write_text('{"prompt": "alpha beta", "response": "gamma"}\n' * 40, encoding="utf-8")
    assert main(base + ["--chat", "--tokenizer", str(tok), "--chat-template", str(tpl),
                        "--no-progress"]) == 0
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert m["documents"] == 40 and m["loss_mask"]["train"][0]["tokens"] == m["tokens"]["train"]


def test_masked_loss_dp2_tp2_pp2_cp2_match_one_process(chat_dir, tmp_path):
    root, _ = chat_dir
    base = {"model": {"block_size": 32, "attention_mask": "block_causal"},
            "training": {"steps": 4, "global_batch_size": 8, "seed": 1},
            "optimizer": {"lr": 1e-2, "warmup_steps": 1}}

    def cfg(parallel: dict) -> dict:
        return tiny_config(str(root), str(tmp_path), **base,
                           parallel={"micro_batches": 2, **parallel})

    ref = train(cfg({"dp": 1}))
    layouts = {"dp2": cfg({"dp": 2}), "tp2": cfg({"tp": 2}), "pp2": cfg({"pp": 2}),
               "cp2": cfg({"cp": 2})}
    results = spawn(layouts_worker, 2, (list(layouts.values()),))
    ref_losses = torch.tensor(ref["losses"])
    assert ref_losses[-1] < ref_losses[0]
    for i, name in enumerate(layouts):
        for r in results:
            got = torch.tensor(r[i]["losses"])
            assert ((got - ref_losses).abs() <= RTOL * ref_losses.abs()).all(), (name, got)
            for n, t in r[i]["params"].items():
                assert rel_err(t, ref["params"][n]) <= RTOL, (name, n)


def test_validation_loss_is_the_mean_over_target_tokens_in_every_layout(chat_dir, tmp_path):
    """``Trainer.evaluate`` on chat data: the summed nats over the val windows' target tokens
    over their count (as training's loss), computed here from one process's logits; the
    same at dp 2, tp 2, pp 2 and cp 2 (one spawn of 2 ranks)."""
    import torch.nn.functional as F

    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.base.config import Config

    root, _ = chat_dir
    T = 32

    def cfg(parallel: dict) -> dict:
        return tiny_config(str(root), str(tmp_path), model={"block_size": T},
                           training={"global_batch_size": 4, "eval_batches": 2, "seed": 1},
                           parallel=parallel)

    trainer = build_trainer(Config.from_dict(cfg({"dp": 1})))
    got = trainer.evaluate()["val_loss"]
    d = load_prepared(root)
    n = min((len(d.val) - 1) // T, 2 * 4)  # eval_batches x the global batch's windows
    pos = torch.arange(n)[:, None] * T + torch.arange(T + 1)
    w = d.val[pos]
    with torch.no_grad():
        logits = trainer.engine.local.chunks[0].eval()(w[:, :-1]).float()
    nats = F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="none")
    keep = d.val_mask[pos[:, 1:]].flatten() != 0
    assert 0 < keep.sum() < keep.numel()
    want = float(nats[keep].sum() / keep.sum())
    assert abs(got - want) <= RTOL * want, (got, want, float(nats.mean()))
    assert abs(float(nats.mean()) - want) > 100 * RTOL * want  # the mask matters here
    layouts = {"dp2": {"dp": 2}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "cp2": {"cp": 2}}
    results = spawn(val_loss_worker, 2, ([cfg(p) for p in layouts.values()],))
    for i, name in enumerate(layouts):
        for r in results:
            assert abs(r[i] - want) <= RTOL * want, (name, r[i], want)
