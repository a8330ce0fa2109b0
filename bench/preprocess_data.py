"""Preprocessing throughput and memory: our streaming tool with 1 and 2 workers against a
single-process baseline that reads line by line, calls the same tokenizer and writes with
PaddleNLP's `MMapIndexedDatasetBuilder` (what PaddleNLP's create_pretraining_data.py does with one
worker), on a generated corpus of JSON lines; then the same at a quarter of the size, to show
whether peak memory grows with the corpus; then the two index writers alone on 20M one-token
documents (PaddleNLP's builder keeps every document's size in Python lists).

Each run is a fresh process; peak RSS is the largest of the run's processes (tool or worker).
The corpus: documents of 1-40 random paragraphs of the shipped Jargon File (about 2.5 KB each).

  .venv/bin/python bench/preprocess_data.py --gigabytes 1
"""

from __future__ import annotations

import argparse
import filecmp
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import machine, write_report

REPO = Path(__file__).resolve().parents[1]
CORPUS, TOKENIZER = REPO / "data" / "jargon-4.4.7.txt", REPO / "data" / "tokenizer"


def generate(path: Path, size: int, seed: int = 0) -> int:
    """JSON lines of about `size` bytes; the document count."""
    paragraphs = [p.strip() for p in CORPUS.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    rng, written, documents = random.Random(seed), 0, 0
    with open(path, "w", encoding="utf-8") as handle:
        while written < size:
            line = json.dumps({"text": "\n\n".join(rng.choices(paragraphs, k=rng.randint(1, 40)))}) + "\n"
            handle.write(line)
            written += len(line.encode("utf-8"))
            documents += 1
    return documents


def _baseline(corpus: Path, prefix: Path) -> int:
    import numpy as np
    import sentencepiece as spm
    from paddlenlp.data.indexed_dataset import MMapIndexedDatasetBuilder

    sp = spm.SentencePieceProcessor(model_file=str(TOKENIZER / "tokenizer.model"))
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    tokens = 0
    with open(corpus, encoding="utf-8") as lines:
        for line in lines:
            ids = sp.encode(json.loads(line)["text"].strip()) + [sp.eos_id()]
            builder.add_item(ids)
            builder.end_document()
            tokens += len(ids)
    builder.finalize(f"{prefix}.idx")
    return tokens


def _ours(corpus: Path, prefix: Path, workers: int) -> int:
    from paddle_pp.data.preprocess import preprocess

    return preprocess([str(corpus)], TOKENIZER, prefix, workers=workers, append_eos=True, show_progress=False).tokens


def _index_only(writer: str, documents: int, prefix: Path) -> None:
    """Writers alone, on `documents` one-token documents: what each keeps per document."""
    import numpy as np

    if writer == "paddlenlp_builder":
        from paddlenlp.data.indexed_dataset import MMapIndexedDatasetBuilder

        builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
        for _ in range(documents):
            builder.add_item([7])
            builder.end_document()
        builder.finalize(f"{prefix}.idx")
        return
    from paddle_pp.data.indexed_writer import IndexedWriter

    with IndexedWriter(prefix, np.uint16) as ours:
        for _ in range(documents // 10_000):
            ours.add_documents(np.full(10_000, 7), np.ones(10_000, np.int64))
        ours.commit()


def run_one(mode: str, corpus: Path, prefix: Path) -> dict:
    """In this process: one measured run. Imports happen before the clock starts (the baseline
    imports paddlenlp, and with it Paddle: seconds and about 500 MB that are no part of the work);
    `growth_mib` is the peak RSS of any of the run's processes beyond this one after its imports."""
    if "baseline" in mode or "paddlenlp" in mode:
        import paddlenlp.data.indexed_dataset  # noqa: F401
    else:
        import paddle_pp.data.preprocess  # noqa: F401
    imported_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    if mode.startswith("index:"):
        _, writer, documents = mode.split(":")
        _index_only(writer, int(documents), prefix)
        tokens = int(documents)
    else:
        tokens = _baseline(corpus, prefix) if mode == "baseline" else _ours(corpus, prefix, int(mode[len("workers"):]))
    seconds = time.perf_counter() - started
    peak_kib = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                   resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return {"mode": mode, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "peak_rss_mib": peak_kib / 1024, "rss_after_imports_mib": imported_kib / 1024,
            "growth_mib": (peak_kib - imported_kib) / 1024}


def _measure(mode: str, corpus: Path, prefix: Path) -> dict:
    command = [sys.executable, __file__, "--_run", mode, "--_corpus", str(corpus), "--_prefix", str(prefix)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--index_documents", type=int, default=20_000_000,
                        help="documents for the writers-only memory comparison")
    parser.add_argument("--work_dir", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument("--output", type=Path, default=REPO / "bench/results/preprocess_data.json")
    parser.add_argument("--_run", help=argparse.SUPPRESS)
    parser.add_argument("--_corpus", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--_prefix", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._run:
        print(json.dumps(run_one(args._run, args._corpus, args._prefix)))
        return 0
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        work = Path(work)
        sizes = {"full": int(args.gigabytes * 2 ** 30), "quarter": int(args.gigabytes * 2 ** 28)}
        results: dict = {**machine(), "runs": {}}
        for label, size in sizes.items():
            corpus = work / f"{label}.jsonl"
            documents = generate(corpus, size)
            results["runs"][label] = {"bytes": corpus.stat().st_size, "documents": documents}
            for mode in ("baseline", "workers1", "workers2"):
                results["runs"][label][mode] = _measure(mode, corpus, work / f"{label}_{mode}")
            for suffix in (".bin", ".idx"):
                one, two = work / f"{label}_workers1{suffix}", work / f"{label}_workers2{suffix}"
                same = filecmp.cmp(one, two, shallow=False)
                results["runs"][label][f"workers_1_2_identical{suffix}"] = same
            corpus.unlink()
        for writer in ("paddlenlp_builder", "ours"):
            results[f"index_writer_{writer}"] = _measure(f"index:{writer}:{args.index_documents}", work / "none",
                                                          work / f"index_{writer}")
        full = results["runs"]["full"]
        results["speedup_workers2_vs_baseline"] = full["workers2"]["tokens_per_s"] / full["baseline"]["tokens_per_s"]
        results["speedup_workers2_vs_workers1"] = full["workers2"]["tokens_per_s"] / full["workers1"]["tokens_per_s"]
    write_report(args.output, results)
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
