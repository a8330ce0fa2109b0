"""From the data flags to the train and valid samples: checked on every rank before any process
group exists (files, weights, splits), then built once (preprocessing the shipped corpus, the id
scan, the index files) by the rank the caller lets go first.

Dataset sizes follow PaddleNLP's run_pretrain: train = max_steps x global batch, valid = eval_iters
x global batch x (evaluations + 1), test = 10 x eval_iters x global batch (it only sizes a blend's
test parts, which are never built here). The same flags therefore give the same samples as PaddleNLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from paddle_pp.data.causal import build_samples, parse_input_dir, split_ranges
from paddle_pp.data.errors import DataError
from paddle_pp.data.indexed import check_vocabulary, read_header
from paddle_pp.data.preprocess import ensure_corpus

SPLIT_NAMES = ("train", "valid")


@dataclass(frozen=True)
class DataPlan:
    """What to read: `data_prefix` in PaddleNLP's form, or None for the --corpus text."""

    data_prefix: tuple[str, ...] | None
    corpus: Path
    tokenizer_dir: Path
    cache_dir: Path
    split: str
    seq_length: int
    seed: int
    num_samples: tuple[int, int, int]
    vocab_size: int
    add_bos_token: bool = True  # --corpus documents begin as the tokenizer declares

    def describe(self) -> str:
        return " ".join(self.data_prefix) if self.data_prefix else str(self.corpus)


def dataset_sizes(global_batch: int, max_steps: int, eval_steps: int, eval_iters: int) -> tuple[int, int, int]:
    evaluations = max_steps // eval_steps if eval_steps else 0
    return (global_batch * max_steps, global_batch * eval_iters * (evaluations + 1), global_batch * eval_iters * 10)


def plan_data(input_dir: str, corpus: Path, tokenizer_dir: Path, cache_dir: Path, split: str, data_impl: str,
              seq_length: int, seed: int, num_samples: tuple[int, int, int], vocab_size: int,
              add_bos_token: bool = True) -> DataPlan:
    """Every check that needs no more than index headers: a bad request fails here, on every rank."""
    if data_impl != "mmap":
        raise DataError(f"--data_impl {data_impl} is not supported; prepared data is read as 'mmap' "
                        "(.bin + .idx from tools/preprocess_data.py or PaddleNLP)")
    data_prefix = tuple(parse_input_dir(input_dir)) if input_dir.strip() else None
    if data_prefix is None:
        if not Path(corpus).is_file():
            raise DataError(f"--corpus {corpus} does not exist; pass a UTF-8 text file, or --input_dir with data "
                            "prepared by tools/preprocess_data.py")
    else:
        prefixes = data_prefix if len(data_prefix) == 1 else data_prefix[1::2]
        for prefix in prefixes:
            header = read_header(Path(prefix))
            bounds = split_ranges(split, header.documents)
            for position, name in enumerate(SPLIT_NAMES):
                if bounds[position + 1] <= bounds[position]:
                    raise DataError(f"--split '{split}' leaves the {name} split of {prefix} empty ({header.documents} "
                                    f"documents); give {name} a larger share, e.g. --split 949,50,1")
    return DataPlan(data_prefix, Path(corpus), Path(tokenizer_dir), Path(cache_dir), split, seq_length, seed,
                    num_samples, vocab_size, add_bos_token)


def build_data(plan: DataPlan) -> tuple:
    """(train, valid) samples; preprocesses the corpus, scans ids and writes index files when they
    are not cached yet."""
    data_prefix = plan.data_prefix
    if data_prefix is None:
        data_prefix = (str(ensure_corpus(plan.corpus, plan.tokenizer_dir, plan.cache_dir, plan.add_bos_token)),)
    prefixes = data_prefix if len(data_prefix) == 1 else data_prefix[1::2]
    for prefix in prefixes:
        check_vocabulary(read_header(Path(prefix)), plan.vocab_size, plan.cache_dir)
    train, valid = build_samples(list(data_prefix), plan.split, plan.num_samples, plan.seq_length, plan.seed,
                                 plan.cache_dir)
    for name, dataset in zip(SPLIT_NAMES, (train, valid)):
        if dataset is None:
            raise DataError(f"{plan.describe()}: the {name} split is empty under --split '{plan.split}'")
    return train, valid
