"""Data pipeline without a launch: tokenizers, the preprocessing tool and its files, the samples
compared with PaddleNLP's own dataset classes, and every bad input's message."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paddle_pp.data import preprocess as preprocess_module
from paddle_pp.data.causal import build_samples, parse_input_dir
from paddle_pp.data.errors import DataError
from paddle_pp.data.indexed import read_header
from paddle_pp.data.preprocess import ensure_corpus, preprocess
from paddle_pp.data.sampler import SequentialBatches
from paddle_pp.data.source import build_data, dataset_sizes, plan_data
from paddle_pp.data.tokenizer import TokenizerError, load_text_tokenizer, load_tokenizer
from paddle_pp.runtime.launch import LaunchError

from runs import MODEL, PP2, SCRIPT, TP2

REPO = Path(__file__).resolve().parents[1]
CORPUS, TOKENIZER = REPO / "data" / "jargon-4.4.7.txt", REPO / "data" / "tokenizer"
PARAGRAPHS = [p.strip() for p in CORPUS.read_text(encoding="utf-8").split("\n\n") if p.strip()]


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in records)
    return path


def _documents(prefix: Path) -> list[list[int]]:
    from paddlenlp.data.indexed_dataset import MMapIndexedDataset

    dataset = MMapIndexedDataset(str(prefix), skip_warmup=True)
    return [dataset[i].tolist() for i in range(len(dataset))]


def _paddlenlp_samples(data_prefix: list[str], num_samples: list[int], seq: int, seed: int, cache: Path):
    from paddlenlp.data.causal_dataset import build_train_valid_test_datasets

    return build_train_valid_test_datasets(data_prefix, "mmap", "949,50,1", num_samples, seq, seed, True,
                                           data_cache_path=str(cache))[:2]


def test_shipped_corpus_and_tokenizer_round_trip():
    assert CORPUS.stat().st_size >= 1_000_000
    sp = load_tokenizer(TOKENIZER)
    assert sp.decode(sp.encode(PARAGRAPHS[500])) == PARAGRAPHS[500]


def test_missing_tokenizer_names_the_fix(tmp_path):
    with pytest.raises(TokenizerError, match="tools/train_tokenizer.py"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="--tokenizer_dir"):
        load_text_tokenizer(tmp_path)


@pytest.fixture(scope="module")
def jsonl_inputs(tmp_path_factory):
    """The corpus's paragraphs as two JSON-lines files (one gzipped) with two lines lacking the key."""
    folder = tmp_path_factory.mktemp("jsonl")
    records = [{"text": p, "id": i} for i, p in enumerate(PARAGRAPHS[:3000])]
    records.insert(10, {"content": "no text key"})
    records.insert(2000, {"title": "neither"})
    return [_write_jsonl(folder / "part-0.jsonl", records[:1500]),
            _write_jsonl(folder / "part-1.jsonl.gz", records[1500:])]


@pytest.fixture(scope="module")
def prepared(jsonl_inputs, tmp_path_factory):
    """Our tool's output with 1 and with 2 workers, batches cut small so both see many batches."""
    folder = tmp_path_factory.mktemp("prepared")
    patch = pytest.MonkeyPatch()
    patch.setattr(preprocess_module, "BATCH_BYTES", 16 << 10)
    summaries = {n: preprocess([str(p) for p in jsonl_inputs], TOKENIZER, folder / f"w{n}", workers=n,
                               append_eos=True, show_progress=False) for n in (1, 2)}
    patch.undo()
    return folder, summaries


def test_tool_files_open_in_paddlenlp_with_the_tokenizers_ids(prepared):
    folder, summaries = prepared
    sp = load_tokenizer(TOKENIZER)
    assert _documents(folder / "w1") == [sp.encode(p) + [sp.eos_id()] for p in PARAGRAPHS[:3000]]
    summary = summaries[1]
    assert (summary.documents, summary.skipped_missing_key, summary.files) == (3000, 2, 2)
    assert "2 JSON line(s) without the key" in summary.describe()


def test_one_and_two_workers_write_identical_bytes(prepared):
    folder, _ = prepared
    for suffix in (".bin", ".idx"):
        assert (folder / f"w1{suffix}").read_bytes() == (folder / f"w2{suffix}").read_bytes()


def test_a_llama_style_folder_loads_through_paddlenlps_auto_tokenizer(tmp_path):
    folder = tmp_path / "llama_tokenizer"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes((TOKENIZER / "tokenizer.model").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    tokenizer = load_text_tokenizer(folder)
    sp = load_tokenizer(TOKENIZER)
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (sp.vocab_size(), sp.eos_id())
    text = PARAGRAPHS[42]
    assert tokenizer.encode(text) == sp.encode(text)
    assert {p.name for p in tokenizer.files()} == {"tokenizer.model", "tokenizer_config.json"}


def _gpt2_style_folder(folder: Path) -> Path:
    """A minimal byte-level BPE tokenizer folder (vocab.json, merges.txt) as GPT-2 ships them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    codes = printable + [256 + n for n in range(256 - len(printable))]
    vocab = {chr(code): i for i, code in enumerate(codes)}
    merges = [("h", "e"), ("l", "l"), ("he", "ll")]
    vocab.update({a + b: 256 + i for i, (a, b) in enumerate(merges)})
    vocab["<|endoftext|>"] = len(vocab)
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPTTokenizer"}))
    return folder


def test_a_gpt2_style_folder_tokenizes_in_the_tool_with_two_workers(tmp_path):
    folder = _gpt2_style_folder(tmp_path / "gpt2")
    _write_jsonl(tmp_path / "in.jsonl", [{"text": "hello hell"}, {"text": "hell"}])
    summary = preprocess([str(tmp_path / "in.jsonl")], folder, tmp_path / "out", workers=2, append_eos=True,
                         show_progress=False)
    hell, o, space, eos = 258, 78, 220, 259
    assert _documents(tmp_path / "out") == [[hell, o, space, hell, eos], [hell, eos]]
    assert summary.dtype == "uint16"


def test_a_line_that_is_not_json_fails_naming_it_and_leaves_nothing(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"bad.jsonl: line 2 is not JSON"):
        preprocess([str(bad)], TOKENIZER, tmp_path / "out", show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_no_document_with_the_key_says_which_key(tmp_path):
    _write_jsonl(tmp_path / "x.jsonl", [{"body": "a"}, {"body": "b"}])
    with pytest.raises(DataError, match="--json_key"):
        preprocess([str(tmp_path / "x.jsonl")], TOKENIZER, tmp_path / "out", show_progress=False)


def test_a_killed_tool_leaves_no_file_that_looks_complete(tmp_path):
    """The tool reads a named pipe; once it has consumed more than the pipe holds it is mid-run,
    and SIGKILL then must leave neither final file."""
    fifo = tmp_path / "stream.jsonl"
    os.mkfifo(fifo)
    tool = subprocess.Popen([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(fifo),
                             "--output_prefix", str(tmp_path / "out"), "--workers", "2", "--disable_progress_bar"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with open(fifo, "w", encoding="utf-8") as writer:
        line = json.dumps({"text": " ".join(PARAGRAPHS[:50])}) + "\n"
        for _ in range(4 * (1 << 20) // len(line)):  # 4 MB: far beyond the 64 KB pipe, so it was read
            writer.write(line)
        writer.flush()
        tool.send_signal(signal.SIGKILL)
    tool.wait(timeout=60)
    assert tool.returncode == -signal.SIGKILL
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.idx").exists()


@pytest.fixture(scope="module")
def two_sources(prepared, tmp_path_factory):
    """Our tool's files and files written by PaddleNLP's own MMapIndexedDatasetBuilder."""
    from paddlenlp.data.indexed_dataset import MMapIndexedDatasetBuilder

    folder, _ = prepared
    theirs = tmp_path_factory.mktemp("paddlenlp_written") / "jargon_tail"
    sp = load_tokenizer(TOKENIZER)
    builder = MMapIndexedDatasetBuilder(f"{theirs}.bin", np.uint16)
    for paragraph in PARAGRAPHS[3000:]:
        builder.add_item(sp.encode(paragraph) + [sp.eos_id()])
        builder.end_document()
    builder.finalize(f"{theirs}.idx")
    return str(folder / "w1"), str(theirs)


@pytest.mark.parametrize("blend", [False, True], ids=["one_source", "two_source_blend"])
def test_samples_equal_paddlenlps_datasets(two_sources, blend, tmp_path):
    ours_prefix, theirs_prefix = two_sources
    data_prefix = ["0.7", ours_prefix, "0.3", theirs_prefix] if blend else [ours_prefix]
    num_samples = [8 * 1000, 8 * 2 * 3, 8 * 20]  # 8000 samples: ours (about 3,400 per epoch) is read 2+ times
    ours = build_samples(data_prefix, "949,50,1", tuple(num_samples), 32, 1234, tmp_path / "ours")
    theirs = _paddlenlp_samples(data_prefix, num_samples, 32, 1234, tmp_path / "theirs")
    for mine, reference in zip(ours, theirs):
        assert len(mine) == len(reference) >= 48
        for i in range(len(reference)):
            np.testing.assert_array_equal(mine[i], reference[i]["text"])
    reread = build_samples(data_prefix, "949,50,1", tuple(num_samples), 32, 1234, tmp_path / "ours")
    np.testing.assert_array_equal(reread[0][len(reread[0]) - 1], ours[0][len(ours[0]) - 1])


def test_index_files_are_reused_and_written_whole(two_sources, tmp_path):
    _, theirs_prefix = two_sources
    build_samples([theirs_prefix], "949,50,1", (64, 16, 0), 32, 7, tmp_path)
    files = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert len([n for n in files if n.endswith(".npy")]) == 6 and not [n for n in files if n.startswith(".")]
    build_samples([theirs_prefix], "949,50,1", (64, 16, 0), 32, 7, tmp_path)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == files
    shuffle = next(p for p in tmp_path.iterdir() if p.name.endswith("_shuffle_idx.npy"))
    shuffle.write_bytes(shuffle.read_bytes()[:-8])  # a truncated index (as a crash mid-np.save leaves)
    rebuilt = build_samples([theirs_prefix], "949,50,1", (64, 16, 0), 32, 7, tmp_path)
    assert len(rebuilt[0]) >= 64


def test_replicas_read_disjoint_slices_of_consecutive_samples():
    batches = SequentialBatches(num_samples=96, global_batch_size=8)
    for replicas in (1, 2, 4):
        for start in range(0, 96, 8):
            parts = [batches.replica_batch(start, r, replicas) for r in range(replicas)]
            np.testing.assert_array_equal(np.concatenate(parts), np.arange(start, start + 8))
    with pytest.raises(DataError, match="does not split"):
        batches.replica_batch(0, 0, 3)
    with pytest.raises(DataError, match="raise --max_steps"):
        batches.global_batch(96)


def test_input_dir_takes_a_prefix_a_blend_or_a_folder_of_prefixes(tmp_path):
    for name in ("b_books", "a_web"):
        for suffix in (".bin", ".idx"):
            (tmp_path / f"{name}{suffix}").write_bytes(b"")
    assert parse_input_dir(str(tmp_path / "a_web")) == [str(tmp_path / "a_web")]
    assert parse_input_dir(f"2 {tmp_path}/a_web 1 {tmp_path}/b_books") == ["2", f"{tmp_path}/a_web", "1",
                                                                            f"{tmp_path}/b_books"]
    assert parse_input_dir(str(tmp_path)) == ["1.0", str(tmp_path / "a_web"), "1.0", str(tmp_path / "b_books")]


def _plan(input_dir: str, cache: Path, split: str = "949,50,1", data_impl: str = "mmap", vocab: int = 4096):
    return plan_data(input_dir, CORPUS, TOKENIZER, cache, split, data_impl, 32, 42, dataset_sizes(8, 20, 10, 1), vocab)


@pytest.mark.parametrize("case, message", [
    ("missing_idx", r"w1\.idx is missing"),
    ("short_bin", r"holds \d+ bytes but w1\.idx describes \d+"),
    ("bad_weight", r"'heavy' is not a weight"),
    ("odd_blend", "pairs 'weight prefix'"),
    ("empty_split", "leaves the valid split of .* empty"),
    ("lazy", "--data_impl lazy is not supported"),
    ("no_corpus", "--corpus .* does not exist"),
])
def test_bad_data_requests_fail_before_training_naming_the_fix(prepared, tmp_path, case, message):
    folder, _ = prepared
    good = folder / "w1"
    copy = tmp_path / "w1"
    for suffix in (".bin", ".idx"):
        Path(f"{copy}{suffix}").write_bytes(Path(f"{good}{suffix}").read_bytes())
    requests = {
        "missing_idx": lambda: (Path(f"{copy}.idx").unlink(), _plan(str(copy), tmp_path)),
        "short_bin": lambda: (os.truncate(f"{copy}.bin", 1000), _plan(str(copy), tmp_path)),
        "bad_weight": lambda: _plan(f"heavy {copy}", tmp_path),
        "odd_blend": lambda: _plan(f"1 {copy} 2", tmp_path),
        "empty_split": lambda: _plan(str(copy), tmp_path, split="100,0,0"),
        "lazy": lambda: _plan(str(copy), tmp_path, data_impl="lazy"),
        "no_corpus": lambda: plan_data("", tmp_path / "nothing.txt", TOKENIZER, tmp_path, "949,50,1", "mmap", 32, 42,
                                       (8, 8, 8), 4096),
    }
    with pytest.raises(DataError, match=message):
        requests[case]()


def test_ids_beyond_the_vocabulary_fail_before_training(prepared, tmp_path):
    folder, _ = prepared
    header = read_header(folder / "w1")
    with pytest.raises(DataError, match=r"token id \d+, not below the model's vocabulary of 100.*--tokenizer_dir"):
        build_data(_plan(str(folder / "w1"), tmp_path, vocab=100))
    assert header.documents == 3000


def test_the_shipped_corpus_is_prepared_once_and_named_by_its_inputs(tmp_path):
    prefix = ensure_corpus(CORPUS, TOKENIZER, tmp_path)
    stamp = Path(f"{prefix}.bin").stat().st_mtime_ns
    assert ensure_corpus(CORPUS, TOKENIZER, tmp_path) == prefix and Path(f"{prefix}.bin").stat().st_mtime_ns == stamp
    other_corpus = tmp_path / "other.txt"
    other_corpus.write_text("\n\n".join(PARAGRAPHS[:100]))
    assert ensure_corpus(other_corpus, TOKENIZER, tmp_path) != prefix
    assert read_header(prefix).documents == len(PARAGRAPHS)


@pytest.mark.multiproc
def test_trained_batches_are_paddlenlps_samples_under_dp2_and_after_a_resume_under_tp2_pp2(
        two_sources, run_workers, tmp_path):
    """dp2 trains 3 steps on a blend of our tool's files and PaddleNLP-written files and saves;
    tp2 x pp2 resumes and trains 2 more. Every row each rank fed the model, reassembled into global
    batches, is PaddleNLP's dataset sample of the same position (inputs and labels)."""
    ours_prefix, theirs_prefix = two_sources
    blend = f"0.3 {ours_prefix} 0.7 {theirs_prefix}"
    common = [*MODEL, "--input_dir", blend, "--data_cache", str(tmp_path / "cache"),
              "--output_dir", str(tmp_path / "out")]
    first = run_workers("batch_probe_worker.py", 2, [*common, "--exit_after_steps", "3", "--save_steps", "3"],
                        tag="dp2")
    resumed = run_workers("batch_probe_worker.py", 4, [*common, *TP2, *PP2, "--exit_after_steps", "2",
                                                       "--resume_from_checkpoint", "latest"], tag="tp2pp2")
    train, _ = _paddlenlp_samples(blend.split(), list(dataset_sizes(8, 20, 10, 1)), 32, 42, tmp_path / "theirs")
    for results, steps in ((first, [1, 2, 3]), (resumed, [4, 5])):
        for field, stage, cut in (("inputs", "first_stage", slice(None, -1)), ("labels", "last_stage", slice(1, None))):
            feeders = sorted((r for r in results if r[stage] and r["tp_rank"] == 0), key=lambda r: r["replica"])
            assert len(feeders) == feeders[0]["replicas"]
            for position, step in enumerate(steps):
                assert all(r["fed"][position]["step"] == step for r in feeders)
                fed = np.concatenate([np.array(r["fed"][position][field]) for r in feeders])
                expected = np.stack([train[i]["text"][cut] for i in range(8 * (step - 1), 8 * step)])
                np.testing.assert_array_equal(fed, expected, err_msg=f"{field} of step {step}")


@pytest.mark.multiproc
def test_ids_beyond_the_vocabulary_found_by_rank_0_fail_every_rank(prepared, run_workers, tmp_path):
    """Rank 0 scans the data for the job; the rank waiting on the store gets its message and exits
    too, instead of waiting for data that never comes."""
    folder, _ = prepared
    tokenizer = _gpt2_style_folder(tmp_path / "small_vocab")
    with pytest.raises(LaunchError) as error:
        run_workers(SCRIPT, 2, [*MODEL, "--input_dir", str(folder / "w1"), "--tokenizer_dir", str(tokenizer),
                                "--data_cache", str(tmp_path / "cache"), "--output_dir", str(tmp_path / "out")],
                    timeout=200)
    for rank in (0, 1):
        log = error.value.rank_logs[rank]
        assert "not below the model's vocabulary of 260" in log, log[-2000:]
