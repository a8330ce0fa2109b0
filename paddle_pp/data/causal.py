"""Training samples exactly as PaddleNLP's `build_train_valid_test_datasets` makes them for its
run_pretrain (GPTDataset and BlendableDataset, Megatron-LM's scheme): documents split by `--split`,
shuffled per epoch, packed into samples of seq_length + 1 ids, the samples shuffled, sources
blended by weight. The index arithmetic is PaddleNLP's own (its split, epoch and shuffle functions
and the compiled `fast_dataindex` helpers); what differs is how the index files are kept:

- PaddleNLP writes them in place with `np.save`, so a crash mid-write leaves a truncated file on
  which every later run fails (it finds all names present and never rebuilds); the ranks that did
  not build poll the disk with `sleep(3)`, between gloo barriers (which abort after 30 s on CPU).
  Here each file is written under a temporary name and renamed; the caller decides which rank
  builds first (the others wait on the job's store).
- Files are named by the same description hash, in the same places (`<data dir>/index-cache`,
  then `--data_cache`), so caches PaddleNLP built are reused and ours are readable by PaddleNLP.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from checkpoint.durable import replaced_when_written
from paddle_pp.data.errors import DataError
from paddle_pp.data.indexed import open_indexed, quiet_stdout


def _load_all(paths: dict[str, Path]) -> dict[str, np.ndarray] | None:
    """The cached arrays, or None when any is missing or unreadable (then they are rebuilt)."""
    if not all(path.is_file() for path in paths.values()):
        return None
    try:
        return {name: np.load(path, mmap_mode="r", allow_pickle=False)
                for name, path in paths.items() if name != "desc"}
    except (ValueError, OSError):
        return None


def _cache_paths(folder: Path, desc: str, names: tuple[str, ...]) -> dict[str, Path]:
    digest = hashlib.md5(desc.encode("utf-8")).hexdigest()
    paths = {name: folder / f"{digest}_{name}.npy" for name in names}
    paths["desc"] = folder / f"{digest}.dsc"
    return paths


def cached_arrays(desc: str, folders: list[Path], names: tuple[str, ...], build) -> dict[str, np.ndarray]:
    """Arrays found under `desc`'s hash in the first folder that has them all, else built and
    written to the last folder, the description file last (a complete set's marker)."""
    for folder in folders:
        found = _load_all(_cache_paths(folder, desc, names))
        if found is not None:
            return found
    paths = _cache_paths(folders[-1], desc, names)
    folders[-1].mkdir(parents=True, exist_ok=True)
    arrays = build()
    for name in names:
        with replaced_when_written(paths[name]) as staged, open(staged, "wb") as handle:
            np.save(handle, arrays[name], allow_pickle=False)
    with replaced_when_written(paths["desc"]) as staged:
        staged.write_text(desc)
    return _load_all(paths)


class CausalSamples:
    """One source's samples of one split (PaddleNLP's GPTDataset without its barriers)."""

    def __init__(self, name: str, data_prefix: str, documents: np.ndarray, indexed, splits_string: str,
                 num_samples: int, seq_length: int, seed: int, cache_dir: Path):
        self.indexed = indexed
        self.desc = (f"GPT Dataset\n\nData prefix {data_prefix}\nDataset name {name}\nNumber of samples {num_samples}\n"
                     f"Sequence length {seq_length}\nRandom seed {seed}\nSplit {splits_string}\n")
        folders = [Path(os.path.dirname(data_prefix)) / "index-cache", Path(cache_dir)]
        arrays = cached_arrays(self.desc, folders, ("doc_idx", "sample_idx", "shuffle_idx"),
                               lambda: _build_mappings(documents, indexed.sizes, num_samples, seq_length, seed))
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays["doc_idx"], arrays["sample_idx"], arrays["shuffle_idx"]

    def __len__(self) -> int:
        return self.sample_idx.shape[0] - 1

    def __getitem__(self, index: int) -> np.ndarray:
        """seq_length + 1 ids: the sample's inputs are the first seq_length, its labels the last."""
        index = self.shuffle_idx[index]
        (first_doc, first_offset), (last_doc, last_offset) = self.sample_idx[index], self.sample_idx[index + 1]
        if first_doc == last_doc:
            ids, _ = self.indexed.get(self.doc_idx[first_doc], offset=first_offset,
                                      length=last_offset - first_offset + 1)
            return np.asarray(ids, dtype=np.int64)
        pieces = [self.indexed.get(self.doc_idx[first_doc], offset=first_offset)[0]]
        pieces += [self.indexed.get(self.doc_idx[doc])[0] for doc in range(first_doc + 1, last_doc)]
        pieces.append(self.indexed.get(self.doc_idx[last_doc], length=last_offset + 1)[0])
        return np.concatenate(pieces).astype(np.int64)


def _build_mappings(documents: np.ndarray, sizes: np.ndarray, num_samples: int, seq_length: int,
                    seed: int) -> dict[str, np.ndarray]:
    """doc-idx, sample-idx and shuffle-idx, drawn in PaddleNLP's order from one RandomState."""
    from fast_dataindex import helpers
    from paddlenlp.data.causal_dataset import (
        _build_doc_idx,
        _build_shuffle_idx,
        _num_epochs,
    )

    tokens_per_epoch = int(np.sum(sizes[documents]))
    num_epochs = _num_epochs(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed=seed)
    separate_last_epoch = False
    if num_epochs > 1:
        from_earlier_epochs = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_last_epoch = num_samples - from_earlier_epochs < int(0.80 * per_epoch)
    with quiet_stdout():
        doc_idx = _build_doc_idx(documents, num_epochs, rng, separate_last_epoch)
        sample_idx = helpers.build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
        shuffled = from_earlier_epochs if separate_last_epoch else sample_idx.shape[0] - 1
        shuffle_idx = _build_shuffle_idx(shuffled, sample_idx.shape[0] - 1, rng)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


class BlendedSamples:
    """Samples drawn from several sources by weight (PaddleNLP's BlendableDataset)."""

    def __init__(self, datasets: list[CausalSamples], weights: list[float], size: int, cache_dir: Path):
        self.datasets = datasets
        weights = np.array(weights, dtype=np.float64)
        weights /= np.sum(weights)
        self.desc = ("Blendable dataset\n\nDatasets:\n" + "".join(d.desc + "\n\n" for d in datasets)
                     + f"Weights: {weights}\nSize: {size}\n")

        def build() -> dict[str, np.ndarray]:
            from fast_dataindex import helpers

            index, sample_index = np.zeros(size, dtype=np.int16), np.zeros(size, dtype=np.int64)
            helpers.build_blending_indices(index, sample_index, weights, len(datasets), size, False)
            return {"index": index, "sample_index": sample_index}

        arrays = cached_arrays(self.desc, [Path(cache_dir)], ("index", "sample_index"), build)
        self.dataset_index, self.dataset_sample_index = arrays["index"], arrays["sample_index"]

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.datasets[self.dataset_index[index]][self.dataset_sample_index[index]]


def parse_input_dir(value: str) -> list[str]:
    """PaddleNLP's `--input_dir`: "w1 prefix1 w2 prefix2 ..." (a weighted blend), one prefix, or a
    folder (every prefix in it, weight 1.0 each, sorted by name)."""
    tokens = value.split()
    if len(tokens) > 1:
        if len(tokens) % 2:
            raise DataError(f"--input_dir '{value}': a blend is pairs 'weight prefix'; got an odd number of items")
        for weight in tokens[0::2]:
            try:
                if float(weight) < 0:
                    raise ValueError
            except ValueError:
                raise DataError(f"--input_dir '{value}': '{weight}' is not a weight (a number >= 0) ; write "
                                "'w1 prefix1 w2 prefix2 ...'") from None
        if sum(float(w) for w in tokens[0::2]) <= 0:
            raise DataError(f"--input_dir '{value}': the weights sum to 0")
        return tokens
    if not tokens:
        raise DataError("--input_dir is empty")
    folder = Path(tokens[0])
    if folder.is_dir():
        prefixes = sorted(str(path)[:-len(".idx")] for path in folder.iterdir() if path.name.endswith(".idx"))
        if not prefixes:
            raise DataError(f"--input_dir {folder} holds no .idx files; preprocess data into it first")
        return prefixes if len(prefixes) == 1 else [item for prefix in prefixes for item in ("1.0", prefix)]
    return tokens


def split_ranges(splits_string: str, documents: int) -> list[int]:
    """Document boundaries of the train, valid and test splits (PaddleNLP's rounding)."""
    from paddlenlp.data.causal_dataset import get_train_valid_test_split_

    try:
        parts = [float(part) for part in splits_string.replace("/", ",").split(",")]
    except ValueError:
        raise DataError(f"--split '{splits_string}' is not numbers like '949,50,1'") from None
    if sum(parts) <= 0 or min(parts) < 0:
        raise DataError(f"--split '{splits_string}' needs non-negative parts with a positive sum")
    return get_train_valid_test_split_(splits_string, documents)


def _one_source(prefix: str, splits_string: str, num_samples: list[int], seq_length: int, seed: int,
                cache_dir: Path) -> list[CausalSamples | None]:
    indexed = open_indexed(Path(prefix))
    bounds = split_ranges(splits_string, indexed.sizes.shape[0])
    datasets = []
    for position, (name, wanted) in enumerate(zip(("train", "valid"), num_samples)):
        documents = np.arange(bounds[position], bounds[position + 1], 1, np.int32)
        datasets.append(CausalSamples(name, prefix, documents, indexed, splits_string, wanted, seq_length, seed,
                                      cache_dir) if len(documents) and wanted else None)
    return datasets


def build_samples(data_prefix: list[str], splits_string: str, num_samples: tuple[int, int, int], seq_length: int,
                  seed: int, cache_dir: Path) -> tuple:
    """(train, valid) as PaddleNLP builds them for `num_samples` = (train, valid, test) samples;
    None for a split that has no documents or no samples wanted."""
    from paddlenlp.data.causal_dataset import get_datasets_weights_and_num_samples

    if len(data_prefix) == 1:
        return tuple(_one_source(data_prefix[0], splits_string, list(num_samples[:2]), seq_length, seed, cache_dir))
    prefixes, weights, per_source = get_datasets_weights_and_num_samples(data_prefix, list(num_samples))
    sources = [_one_source(prefix, splits_string, sizes[:2], seq_length, seed, cache_dir)
               for prefix, sizes in zip(prefixes, per_source)]
    blended = []
    for position, wanted in enumerate(num_samples[:2]):
        parts = [source[position] for source in sources]
        if not wanted:
            blended.append(None)
            continue
        missing = [prefix for prefix, part in zip(prefixes, parts) if part is None]
        if missing:
            raise DataError(f"--split '{splits_string}' leaves no {('train', 'valid')[position]} documents in "
                            f"{', '.join(missing)}; every blended source needs documents in each split used")
        blended.append(BlendedSamples(parts, weights, wanted, cache_dir))
    return tuple(blended)
