"""Data pipeline: tokenizer, memory-mapped ids, packed samples and the resumable sampler (no launch)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from paddle_pp.data.sampler import GlobalBatchSampler
from paddle_pp.data.tokenizer import TokenizerError, load_tokenizer
from paddle_pp.data.tokens import DataError, PackedTokens, ensure_tokens, preprocess

REPO = Path(__file__).resolve().parents[1]
CORPUS, TOKENIZER = REPO / "data" / "jargon-4.4.7.txt", REPO / "data" / "tokenizer"


def test_shipped_corpus_and_tokenizer_round_trip():
    assert CORPUS.stat().st_size >= 1_000_000
    sp = load_tokenizer(TOKENIZER)
    paragraph = CORPUS.read_text(encoding="utf-8").split("\n\n")[500]
    assert sp.decode(sp.encode(paragraph)) == paragraph


def test_missing_tokenizer_names_the_fix(tmp_path):
    with pytest.raises(TokenizerError, match="tools/train_tokenizer.py"):
        load_tokenizer(tmp_path)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("tokens") / "jargon"
    index = preprocess(CORPUS, TOKENIZER, prefix)
    return prefix, index


def test_preprocess_writes_ids_that_decode_to_the_corpus(tokens):
    prefix, index = tokens
    ids = np.fromfile(f"{prefix}.bin", dtype=index["dtype"])
    assert ids.size == index["num_tokens"] > 300_000
    sp = load_tokenizer(TOKENIZER)
    first_doc = ids[: int(np.argmax(ids == sp.eos_id()))]
    assert sp.decode(first_doc.tolist()) == CORPUS.read_text(encoding="utf-8").split("\n\n")[0].strip()


def test_stale_index_is_rebuilt(tokens, tmp_path):
    prefix, index = tokens
    stale = tmp_path / "stale"
    Path(f"{stale}.bin").write_bytes(Path(f"{prefix}.bin").read_bytes())
    Path(f"{stale}.idx.json").write_text(json.dumps({**index, "tokenizer_sha256": "0" * 64}))
    assert ensure_tokens(CORPUS, TOKENIZER, stale)["tokenizer_sha256"] == index["tokenizer_sha256"]


def test_truncated_ids_fail_clearly(tokens, tmp_path):
    prefix, _ = tokens
    cut = tmp_path / "cut"
    Path(f"{cut}.bin").write_bytes(Path(f"{prefix}.bin").read_bytes()[:-10])
    Path(f"{cut}.idx.json").write_text(Path(f"{prefix}.idx.json").read_text())
    with pytest.raises(DataError, match="truncated"):
        PackedTokens(cut, 128, 16)


def test_packed_samples_shift_by_one_and_hold_out_the_tail(tokens):
    prefix, index = tokens
    data = PackedTokens(prefix, 64, 8)
    inputs, labels = data.batch([0, 5])
    np.testing.assert_array_equal(inputs[:, 1:], labels[:, :-1])
    ids = np.fromfile(f"{prefix}.bin", dtype=index["dtype"])
    np.testing.assert_array_equal(inputs[1], ids[5 * 64: 6 * 64])
    last_train_end = (data.num_train - 1) * 64 + 65
    first_eval_start = (data.num_train + 1) * 64
    assert first_eval_start >= last_train_end
    assert data.num_train + 1 + data.eval_samples == data.total


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_replicas_read_disjoint_slices_covering_each_epoch(replicas):
    sampler = GlobalBatchSampler(num_samples=96, global_batch_size=8, seed=3)
    seen = []
    for step in range(96 // 8):
        parts = [sampler.replica_batch(step * 8, r, replicas) for r in range(replicas)]
        flat = np.concatenate(parts)
        assert len(set(flat.tolist())) == 8, "replicas overlap within a batch"
        np.testing.assert_array_equal(flat, sampler.global_batch(step * 8))
        seen.extend(flat.tolist())
    assert sorted(seen) == list(range(96)), "one epoch must cover every sample exactly once"


def test_sampler_resumes_exactly_and_reshuffles_each_epoch():
    sampler = GlobalBatchSampler(num_samples=50, global_batch_size=8, seed=7)
    stream = np.concatenate([sampler.global_batch(c) for c in range(0, 200, 8)])
    resumed = GlobalBatchSampler(num_samples=50, global_batch_size=8, seed=7)
    np.testing.assert_array_equal(resumed.global_batch(96), stream[96:104])
    assert not np.array_equal(stream[:50], stream[50:100]), "epochs must use different orders"
    assert sorted(stream[50:100].tolist()) == list(range(50))


def test_global_batch_must_split_over_replicas():
    with pytest.raises(ValueError, match="does not split"):
        GlobalBatchSampler(10, 6, 0).replica_batch(0, 0, 4)
