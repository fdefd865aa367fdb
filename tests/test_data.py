"""Corpus, tokenizer and the distributed sampler (no processes)."""

import pytest
import torch

from shardwise.data import CharTokenizer, DataError, DistributedBatchSampler, load_text


def test_tokenizer_roundtrip_and_state(corpus):
    text = load_text(corpus)
    tok = CharTokenizer.from_text(text)
    ids = tok.encode(text[:500])
    assert tok.decode(ids) == text[:500]
    again = CharTokenizer.from_state_dict(tok.state_dict())
    assert torch.equal(again.encode(text[:500]), ids)


def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(DataError, match="nope.txt"):
        load_text(tmp_path / "nope.txt")


def _sampler(tokens, rank, dp, seed=0):
    return DistributedBatchSampler(tokens, block_size=8, global_batch_size=12, dp_rank=rank,
                                   dp_size=dp, seed=seed)


def test_ranks_get_disjoint_shards_whose_union_is_the_global_batch():
    tokens = torch.arange(1000)
    single = _sampler(tokens, 0, 1)
    ranks = [_sampler(tokens, r, 3) for r in range(3)]
    for _ in range(15):  # crosses an epoch boundary (10 batches per epoch)
        xs, ys = single.next_batch()
        parts = [s.next_batch() for s in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), xs)
        assert torch.equal(torch.cat([p[1] for p in parts]), ys)
        starts = [set(p[0][:, 0].tolist()) for p in parts]
        assert not (starts[0] & starts[1]) and not (starts[1] & starts[2])
        assert torch.equal(ys[:, :-1], xs[:, 1:])  # targets are inputs shifted by one


def test_deterministic_for_a_seed_and_different_across_seeds():
    tokens = torch.arange(1000)
    a, b, c = _sampler(tokens, 0, 1, 7), _sampler(tokens, 0, 1, 7), _sampler(tokens, 0, 1, 8)
    xa, xb, xc = a.next_batch()[0], b.next_batch()[0], c.next_batch()[0]
    assert torch.equal(xa, xb) and not torch.equal(xa, xc)


def test_resume_continues_with_the_exact_next_batch():
    tokens = torch.arange(1000)
    a = _sampler(tokens, 1, 2)
    for _ in range(13):
        a.next_batch()
    b = _sampler(tokens, 1, 2)
    b.load_state_dict(a.state_dict())
    for _ in range(10):
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])


def test_too_small_split_is_rejected():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        _sampler(torch.arange(50), 0, 1)
