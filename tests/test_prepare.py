"""``shardwise prepare`` and training from prepared shards: the tokens are ``tokenizers``' own
encoding, the manifest tells the truth, a second run refuses or resumes, bad inputs are one
line with exit 2, and a run resumed in another layout reads the windows an uninterrupted run
reads. Tiny corpora built in tmp_path; one multi-rank run (the README's commands, dp = 2)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import assert_one_line_exit_2, run_shardwise
from shardwise.cli.main import main
from shardwise.data import CharTokenizer, DataError, DistributedBatchSampler
from shardwise.data import prepare as prep
from shardwise.data.shards import load_prepared

REPO = Path(__file__).resolve().parents[1]

TEXT = ("First line of a file  \n\n\n  indented line, café ünïcode\ttabs\n"
        "trailing spaces   \nlast line without a newline")
DOCS = ["The quick brown fox jumps over the lazy dog.", "Second document\nwith two lines\n",
        "  leading spaces and ellipsis…", "x" * 300, "end"]


def _corpus(tmp_path: Path, repeat: int = 20) -> tuple[Path, Path]:
    """A text file and a JSONL file (one blank line among the records)."""
    txt = tmp_path / "notes.txt"
    txt.write_text("\n".join([TEXT] * repeat), encoding="utf-8")
    jsonl = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS * repeat)]
    jsonl.write_text("\n".join(lines[:3] + [""] + lines[3:]) + "\n", encoding="utf-8")
    return txt, jsonl


def _opts(inputs, out, **kw) -> prep.PrepareOptions:
    kw.setdefault("progress", False)
    return prep.PrepareOptions(inputs=tuple(str(p) for p in inputs), out=str(out), **kw)


def _all_tokens(root: Path, split: str) -> np.ndarray:
    m = json.loads((root / "manifest.json").read_text())
    parts = [np.fromfile(root / r["file"], dtype=m["dtype"]) for r in m["shards"][split]]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def test_bpe_tokens_are_tokenizers_own_encoding(tmp_path):
    """Small blocks, pieces and shards: the text file is cut into many pieces, yet its
    tokens are the trained tokenizer's encoding of the whole file; documents are joined by
    <|endoftext|>."""
    from tokenizers import Tokenizer

    txt, jsonl = _corpus(tmp_path)
    out = tmp_path / "bpe"
    m = prep.prepare(_opts([txt, jsonl], out, tokenizer="bpe", vocab_size=400, val_fraction=0.0,
                           block_chars=700, piece_chars=90, shard_tokens=300), log=lambda s: None)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    assert m["tokenizer"]["eos_id"] == eos == 0 and m["dtype"] == "uint16"
    docs = [txt.read_text(encoding="utf-8")] + DOCS * 20
    expected = []
    for i, d in enumerate(docs):
        expected += ([eos] if i else []) + tok.encode(d, add_special_tokens=False).ids
    assert _all_tokens(out, "train").tolist() == expected
    assert len(m["shards"]["train"]) > 3 and m["tokens"] == {"train": len(expected), "val": 0}
    assert m["vocab_size"] == tok.get_vocab_size() <= 400
    # the tokenizer round-trips the text (byte-level: nothing is lost)
    assert tok.decode(tok.encode(docs[0]).ids) == docs[0]


def test_split_holds_out_the_tail_of_each_block(tmp_path):
    txt, jsonl = _corpus(tmp_path)
    whole = tmp_path / "whole"
    prep.prepare(_opts([txt, jsonl], whole, tokenizer="char", val_fraction=0.0), log=print)
    stream = _all_tokens(whole, "train")
    one = tmp_path / "one_block"  # the default block holds this corpus: val is its tail
    m = prep.prepare(_opts([txt, jsonl], one, tokenizer="char", val_fraction=0.25), log=print)
    k = int(len(stream) * 0.25)
    assert m["tokens"] == {"train": len(stream) - k, "val": k}
    assert _all_tokens(one, "train").tolist() == stream[:-k].tolist()
    assert _all_tokens(one, "val").tolist() == stream[-k:].tolist()
    many = tmp_path / "blocks"  # small blocks: val tails spread over the corpus, same total
    m = prep.prepare(_opts([txt, jsonl], many, tokenizer="char", val_fraction=0.25,
                           block_chars=500), log=print)
    assert m["tokens"]["val"] == k and m["tokens"]["train"] == len(stream) - k
    train, val = _all_tokens(many, "train"), _all_tokens(many, "val")
    assert sorted(np.concatenate([train, val]).tolist()) == sorted(stream.tolist())
    assert val.tolist() != stream[-k:].tolist()


def test_char_tokens_equal_the_text_path(tmp_path):
    """Two text files with the char tokenizer: the stream of the text path (files joined by a
    blank line, ``CharTokenizer`` over its characters)."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("To be, or not to be\nthat is the question.\n", encoding="utf-8")
    b.write_text("Ça va? Ünïcödé — and more\n", encoding="utf-8")
    out = tmp_path / "chars"
    m = prep.prepare(_opts([a, b], out, tokenizer="char", val_fraction=0.0), log=print)
    text = a.read_text(encoding="utf-8") + "\n\n" + b.read_text(encoding="utf-8")
    ref = CharTokenizer.from_text(text)
    assert m["tokenizer"]["chars"] == ref.chars
    assert _all_tokens(out, "train").tolist() == ref.encode(text).tolist()


def test_tokenizer_json_with_a_large_vocabulary_writes_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "</s>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["</s>"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    docs = [" ".join(f"w{(i * 7919 + j * 104_729) % 70_000}" for j in range(30)) + " oov"
            for i in range(40)]
    corpus = tmp_path / "words.jsonl"
    corpus.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs), encoding="utf-8")
    out = tmp_path / "wl"
    m = prep.prepare(_opts([corpus], out, tokenizer=str(path), field="body", val_fraction=0.0),
                     log=print)
    assert m["dtype"] == "uint32" and m["vocab_size"] == 70_002
    assert m["tokenizer"]["eos_token"] == "</s>" and m["tokenizer"]["eos_id"] == 70_001
    expected = []
    for i, d in enumerate(docs):
        expected += ([70_001] if i else []) + tok.encode(d, add_special_tokens=False).ids
    assert _all_tokens(out, "train").tolist() == expected
    assert max(expected) > 65_535


def test_parquet_field(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"content": DOCS, "n": list(range(len(DOCS)))}), path)
    out = tmp_path / "pq"
    m = prep.prepare(_opts([path], out, tokenizer="char", field="content", val_fraction=0.0),
                     log=print)
    assert m["documents"] == len(DOCS)
    text = "\n\n".join(DOCS)
    expected = CharTokenizer(m["tokenizer"]["chars"]).encode(text).tolist()
    assert _all_tokens(out, "train").tolist() == expected


def test_manifest_counts_checksums_and_the_memory_mapped_stream(tmp_path):
    txt, jsonl = _corpus(tmp_path)
    out = tmp_path / "m"
    m = prep.prepare(_opts([txt, jsonl], out, tokenizer="bpe", vocab_size=300,
                           block_chars=600, shard_tokens=200), log=print)
    assert m["format"] == "shardwise.tokens" and m["version"] == 1
    assert m["documents"] == 1 + len(DOCS) * 20
    assert [s["documents"] for s in m["sources"]] == [1, 100]
    assert m["characters"] == len(txt.read_text(encoding="utf-8")) + len("".join(DOCS)) * 20
    assert m["split"]["val_fraction"] == 0.1 and m["tokenizer"]["kind"] == "hf"
    digest = hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    assert m["tokenizer"]["sha256"] == digest
    for split in ("train", "val"):
        assert m["tokens"][split] == sum(r["tokens"] for r in m["shards"][split])
        for r in m["shards"][split]:
            raw = (out / r["file"]).read_bytes()
            assert len(raw) == 2 * r["tokens"] and hashlib.sha256(raw).hexdigest() == r["sha256"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json", "tokenizer.json"] + [r["file"] for s in ("train", "val")
                                               for r in m["shards"][s]])
    data = load_prepared(out, checksums=True)
    assert data.tokenizer.vocab_size == m["vocab_size"]
    flat = _all_tokens(out, "train")
    assert len(data.train) == len(flat)
    idx = torch.tensor([[0, 1, 2], [198, 199, 200], [len(flat) - 3, len(flat) - 2, len(flat) - 1]])
    assert torch.equal(data.train[idx], torch.from_numpy(flat[idx.numpy()]))  # across shards
    assert data.train[5].item() == flat[5]
    assert data.train[190:210].tolist() == flat[190:210].tolist()
    with pytest.raises(IndexError):
        data.train[torch.tensor([len(flat)])]


def test_second_run_refuses_and_an_interrupted_one_resumes(tmp_path, monkeypatch):
    txt, jsonl = _corpus(tmp_path)
    kw = dict(tokenizer="bpe", vocab_size=300, block_chars=500, shard_tokens=150)
    done = tmp_path / "done"
    reference = prep.prepare(_opts([txt, jsonl], done, **kw), log=print)
    with pytest.raises(DataError, match="already holds a prepared dataset"):
        prep.prepare(_opts([txt, jsonl], done, **kw), log=print)

    # interrupted after the second progress save: shard 1 renamed, its progress not saved
    out = tmp_path / "cut"
    real, calls = prep._save_state, []

    def save_then_die(root, state):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(root, state)

    monkeypatch.setattr(prep, "_save_state", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(_opts([txt, jsonl], out, **kw), log=print)
    monkeypatch.setattr(prep, "_save_state", real)
    assert not (out / "manifest.json").exists() and (out / "prepare.json").exists()
    with pytest.raises(DataError, match="unfinished prepare"):
        load_prepared(out)
    with pytest.raises(DataError, match="unfinished prepare of other inputs or options"):
        prep.prepare(_opts([txt, jsonl], out, **{**kw, "vocab_size": 320}), log=print)
    lines = []
    resumed = prep.prepare(_opts([txt, jsonl], out, **kw), log=lines.append)
    assert lines and "resuming" in lines[0] and "after 1 complete train shard (" in lines[0]
    assert resumed == reference  # same shards, checksums, counts
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in done.iterdir())

    # a crash while the manifest is renamed into place: no manifest, and the next run finishes
    torn = tmp_path / "torn"
    real_replace = os.replace

    def no_manifest(src, dst):
        if Path(dst).name == "manifest.json":
            raise OSError("disk gone")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", no_manifest)
    with pytest.raises(OSError, match="disk gone"):
        prep.prepare(_opts([txt, jsonl], torn, **kw), log=print)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not (torn / "manifest.json").exists() and (torn / "prepare.json").exists()
    assert prep.prepare(_opts([txt, jsonl], torn, **kw), log=print) == reference
    assert not (torn / "manifest.json.tmp").exists() and not (torn / "prepare.json").exists()

    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes").write_text("mine")
    with pytest.raises(DataError, match="not an empty directory"):
        prep.prepare(_opts([txt], stray, tokenizer="char"), log=print)


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: shardwise prepare")
    assert "--tokenizer char|bpe|PATH" in out and "--vocab-size N" in out


def test_bad_inputs_are_one_line_with_exit_2(tmp_path, capsys):
    txt, jsonl = _corpus(tmp_path, repeat=1)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 ol\u00e9\n".encode("latin-1"))
    no_field = tmp_path / "no_field.jsonl"
    no_field.write_text('{"text": "a"}\n\n{"body": "b"}\n', encoding="utf-8")
    out = str(tmp_path / "out")
    cases = [
        (["prepare", str(tmp_path / "missing.jsonl"), "--tokenizer", "char", "--out", out],
         "missing.jsonl: file not found"),
        (["prepare", str(latin1), "--tokenizer", "char", "--out", out],
         "latin1.txt: not UTF-8 (byte 3 is e9)"),
        (["prepare", str(no_field), "--tokenizer", "char", "--out", out],
         "no_field.jsonl: line 3 has no field 'text' (its fields: body)"),
        (["prepare", str(jsonl), "--tokenizer", "bpe", "--vocab-size", str(2**32 + 1),
          "--out", out],
         "a vocabulary of 4,294,967,297 tokens does not fit uint32 ids"),
        (["prepare", str(jsonl), "--tokenizer", "nope.json", "--out", out],
         "--tokenizer nope.json: not char, bpe, or an existing tokenizer.json file"),
        (["prepare", str(jsonl), "--tokenizer", "char", "--vocab-size", "300", "--out", out],
         "--vocab-size: only with --tokenizer bpe"),
        (["prepare", str(tmp_path / "x.csv"), "--tokenizer", "char", "--out", out],
         "x.csv: file not found"),
    ]
    (tmp_path / "y.csv").write_text("a,b\n")
    (tmp_path / "bad.json").write_text("{bad")
    cases.append((["prepare", str(jsonl), "--tokenizer", str(tmp_path / "bad.json"),
                   "--out", out], "bad.json: not a tokenizer.json"))
    cases.append((["prepare", str(tmp_path / "y.csv"), "--tokenizer", "char", "--out", out],
                  "y.csv: unknown format .csv"))
    # a line that is not JSON (datasets' parse error was a traceback), one that is no
    # object; an --out that cannot be created (a file on its way)
    bad_line = tmp_path / "bad_line.jsonl"
    bad_line.write_text('{"text": "a"}\nnot json\n', encoding="utf-8")
    a_list = tmp_path / "a_list.jsonl"
    a_list.write_text('{"text": "a"}\n[1, 2]\n', encoding="utf-8")
    cases.append((["prepare", str(bad_line), "--tokenizer", "char", "--out", out],
                  "bad_line.jsonl: line 2 is not JSON (Expecting value); expected one JSON "
                  "object per line"))
    cases.append((["prepare", str(bad_line), "--tokenizer", "bpe", "--out", out],
                  "bad_line.jsonl: line 2 is not JSON"))
    cases.append((["prepare", str(a_list), "--tokenizer", "char", "--out", out],
                  "a_list.jsonl: line 2 is a JSON list; expected one JSON object per line"))
    cases.append((["prepare", str(txt), "--tokenizer", "char", "--out",
                   str(tmp_path / "y.csv" / "out")], "y.csv/out: cannot create it"))
    for argv, expected in cases:
        err = assert_one_line_exit_2(argv, capsys)
        assert err.startswith("shardwise prepare: error: ") and expected in err, (argv, err)
        assert not Path(out).exists(), argv  # a failed fresh run leaves nothing

    # training: a directory without a manifest, a shard that does not match its checksum
    empty = tmp_path / "empty"
    empty.mkdir()
    base = ["train", "--config", str(REPO / "configs/tiny.toml"),
            "--training.out_dir", str(tmp_path / "run")]
    err = assert_one_line_exit_2(base + ["--data", str(empty)], capsys)
    assert "holds no manifest.json; make one with: shardwise prepare" in err
    good = tmp_path / "good"
    assert main(["prepare", str(txt), str(jsonl), "--tokenizer", "char", "--out", str(good),
                 "--no-progress"]) == 0
    capsys.readouterr()
    err = assert_one_line_exit_2(["prepare", str(txt), "--tokenizer", "char", "--out", str(good)],
                                 capsys)
    assert "already holds a prepared dataset" in err
    shard = good / "train_00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 1
    shard.write_bytes(bytes(raw))
    err = assert_one_line_exit_2(base + ["--data", str(good)], capsys)
    assert re.search(r"train_00000\.bin: checksum mismatch \(manifest\.json says sha256 \w+\.\.\., "
                     r"the file hashes to \w+\.\.\.\); prepare it again", err), err
    shard.write_bytes(shard.read_bytes() + b"\0\0")
    err = assert_one_line_exit_2(base + ["--data", str(good)], capsys)
    assert "manifest.json says" in err and "bytes" in err
    # a damaged manifest: a missing field, a shard file name that leaves the directory
    manifest = good / "manifest.json"
    saved = json.loads(manifest.read_text())
    raw[10] ^= 1
    shard.write_bytes(bytes(raw))  # the shard whole again: only the manifest is damaged below
    # metadata the tokenizer contradicts (a traceback or a model of the wrong size before):
    # no token counts, an end-of-text id beyond the vocabulary, another vocabulary size
    for damage, expected in ((lambda m: m.pop("dtype"), "dtype None"),
                             (lambda m: m["shards"]["val"][0].update(file="../a.txt"),
                              "a val shard entry"),
                             (lambda m: m.pop("tokens"), "tokens must give the train and val"),
                             (lambda m: m["tokenizer"].update(eos_id=m["vocab_size"]),
                              "tokenizer.eos_id"),
                             (lambda m: m.update(vocab_size=m["vocab_size"] + 5),
                              "but its tokenizer (tokenizer.chars) has")):
        m = json.loads(json.dumps(saved))
        damage(m)
        manifest.write_text(json.dumps(m))
        err = assert_one_line_exit_2(base + ["--data", str(good)], capsys)
        assert expected in err, err
        assert "manifest.json is damaged" in err or "manifest.json says vocab_size" in err, err
    assert not (tmp_path / "run").exists()  # no rank started


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Your own data", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines()
            if line.startswith("shardwise ")]


def _record_windows(trainer, steps: int) -> list[torch.Tensor]:
    """Train up to ``steps``, keeping each step's input windows (this rank's x)."""
    seen, draw = [], trainer.sampler.next_batch

    def recording():
        x, y = draw()
        seen.append(x.clone())
        return x, y

    trainer.sampler.next_batch = recording
    while trainer.step < steps:
        trainer.train_step()
    return seen


def test_readme_commands_train_at_dp2_and_resume_in_another_layout(corpus, tmp_path, capsys,
                                                                 monkeypatch):
    """The README's "Your own data" commands as a user runs them (prepare; train at dp = 2,
    checkpoints at steps 3 and 6). Then: the run resumed from step 3 at dp = 1 reads, step by
    step, the windows of an uninterrupted dp = 1 run and ends at the sampler position the
    dp = 2 run saved; four dp = 4 ranks resumed from it draw that global batch between them.
    Prepared again with another tokenizer, the directory no longer resumes the run."""
    from shardwise import checkpoint
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.base.config import Config

    commands = _readme_commands()
    assert [c.split()[1] for c in commands] == ["prepare", "train"], commands
    text = corpus.read_text(encoding="utf-8")
    docs = [p for p in text.split("\n\n") if p.strip()]
    (tmp_path / "my_corpus.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.toml").write_text((REPO / "configs" / "tiny.toml").read_text())
    outputs = []
    for command in commands:
        proc = run_shardwise(*shlex.split(command)[1:], cwd=tmp_path, timeout=600,
                             env={"PYTHONPATH": str(REPO / "src")})
        assert proc.returncode == 0, command + "\n" + proc.stdout + proc.stderr
        outputs.append(proc.stdout + proc.stderr)
    args = shlex.split(commands[1])
    data_dir = tmp_path / args[args.index("--data") + 1]
    out_dir = tmp_path / args[args.index("--training.out_dir") + 1]
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert f"vocab {manifest['vocab_size']}," in outputs[1] and "dp=2" in outputs[1]
    assert re.search(r"done: 6 steps .* validation loss \S+ nats/token", outputs[1])
    sample = (out_dir / "sample.txt").read_text()
    assert sample.startswith("<|endoftext|>") and len(sample) > len("<|endoftext|>")

    cfg_file = tmp_path / "configs" / "tiny.toml"
    overrides = {"data.path": str(data_dir), "parallel.dp": 1, "training.progress": False,
                 "training.sample_chars": 0, "checkpoint.every": 0, "checkpoint.at_end": False}
    straight = build_trainer(Config.load(cfg_file, {**overrides, "training.out_dir":
                                                     str(tmp_path / "straight")}))
    windows = _record_windows(straight, 6)
    ckpts = out_dir / "checkpoints"
    resumed = build_trainer(Config.load(cfg_file, {**overrides,
                                                   "training.out_dir": str(tmp_path / "resumed"),
                                                   "checkpoint.dir": str(ckpts)}))
    resumed.resume(ckpts / "step_000003")
    assert resumed.step == 3
    again = _record_windows(resumed, 6)
    assert len(again) == 3
    for step, (a, b) in enumerate(zip(again, windows[3:]), start=4):
        assert torch.equal(a, b), f"step {step}: the resumed run read other windows"
    assert resumed.sampler.state_dict() == checkpoint.read_meta(ckpts / "step_000006")["sampler"]

    meta = checkpoint.read_meta(ckpts / "step_000003")
    cfg = Config.load(cfg_file, overrides)
    parts = []
    for rank in range(4):
        s = DistributedBatchSampler(load_prepared(data_dir).train, cfg.model.block_size,
                                    cfg.training.global_batch_size, rank, 4, cfg.training.seed)
        s.load_state_dict(meta["sampler"])
        parts.append(s.next_batch()[0])
    assert torch.equal(torch.cat(parts), windows[3])
    assert all(len(p) == 2 for p in parts)

    # DIR prepared again with another tokenizer: resuming the run is refused at the door
    shutil.rmtree(data_dir)
    prep.prepare(_opts([tmp_path / "my_corpus.jsonl"], data_dir, tokenizer="bpe",
                       vocab_size=600), log=print)
    monkeypatch.chdir(tmp_path)
    code = main([*shlex.split(commands[1])[1:], "--training.steps", "8"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.endswith("tokenizer is not the one the checkpoint trained with "
                                      "(prepared again?); --fresh starts over"), err


def test_shard_tokens_is_honoured_and_the_next_command_is_shell_quoted(tmp_path, capsys):
    """``--shard-tokens 40000`` on 200K characters gives shards of about 40K tokens (blocks
    sized for it: before, one shard of every token, a block being 2M characters), and the
    suggested ``shardwise train --data DIR`` survives a space in DIR; one document is "1
    document"."""
    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps\n" for i in range(5000)))
    out = tmp_path / "my shards"
    assert main(["prepare", str(text), "--tokenizer", "char", "--out", str(out),
                 "--shard-tokens", "40000", "--no-progress"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert shlex.split(last.rpartition("; ")[2]) == ["shardwise", "train", "--data", str(out)]
    assert last.startswith("shardwise prepare: 1 document, 183,890 characters -> "), last
    m = json.loads((out / "manifest.json").read_text())
    sizes = [s["tokens"] for s in m["shards"]["train"]]
    assert len(sizes) >= 4 and all(40000 <= n <= 50000 for n in sizes[:-1]), sizes
