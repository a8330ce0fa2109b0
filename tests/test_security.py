"""Model folders are data: a pickled file that would run code when loaded is refused by the trainer
(every rank, before any process group), generate, merge and conversion, naming the file and the
global, and never runs; every file Paddle and PaddleNLP write for state dicts still loads, equal to
`paddle.load`'s answer."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from paddle_pp.interop.pickled import UnsafePickleError, load_pickled
from paddle_pp.interop.pretrained import PADDLENLP, open_pretrained
from paddle_pp.runtime.launch import LaunchError

from runs import MODEL, REPO, SCRIPT, TOKENIZER

SHAPE = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


class _RunsCode:
    """Unpickling this calls os.system: what a hostile .pdparams can do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _hostile(path: Path, marker: Path, protocol: int = 4) -> Path:
    path.write_bytes(pickle.dumps({"llama.embed_tokens.weight": _RunsCode(marker)}, protocol=protocol))
    return path


def _paddlenlp_model(folder: Path) -> Path:
    """PaddleNLP's own LLaMA saved by its save_pretrained as pickled weights, with our tokenizer."""
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    paddle.seed(2)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(folder, safe_serialization=False)
    (folder / "tokenizer.model").write_bytes((TOKENIZER / "tokenizer.model").read_bytes())
    return folder


def _equal(ours, theirs) -> bool:
    if isinstance(theirs, dict):
        return isinstance(ours, dict) and ours.keys() == theirs.keys() and all(_equal(ours[k], theirs[k]) for k in theirs)
    if isinstance(theirs, np.ndarray):
        return isinstance(ours, np.ndarray) and ours.dtype == theirs.dtype and np.array_equal(ours, theirs)
    return type(ours) is type(theirs) and ours == theirs


@pytest.mark.parametrize("protocol", [2, 4])
def test_every_state_file_paddle_writes_loads_as_paddle_load_gives_it(protocol, tmp_path):
    """A layer's state dict (with its name table), an AdamW state with fp32 master weights and its
    scheduler, plain numpy and Python values: written by paddle.save itself."""
    paddle.seed(0)
    layer = paddle.nn.Linear(8, 4)
    optimizer = paddle.optimizer.AdamW(learning_rate=paddle.optimizer.lr.CosineAnnealingDecay(1e-3, 10),
                                       parameters=layer.parameters(), multi_precision=True)
    layer(paddle.ones([2, 8])).sum().backward()
    optimizer.step()
    files = {"layer.pdparams": layer.state_dict(), "adamw.pdopt": optimizer.state_dict(),
             "scheduler.pdparams": optimizer._learning_rate.state_dict(),
             "values.pdparams": {"array": np.arange(6, dtype=np.int64).reshape(2, 3), "lr": 0.5, "step": 3,
                                 "nested": {"names": ["a", "b"], "bf16": paddle.ones([3]).astype("bfloat16")}}}
    for name, state in files.items():
        paddle.save(state, str(tmp_path / name), protocol=protocol)
        for keep in (False, True):
            theirs = paddle.load(str(tmp_path / name), return_numpy=True, keep_name_table=keep)
            assert _equal(load_pickled(tmp_path / name, keep_name_table=keep), theirs), name


def test_paddlenlp_pickled_folders_still_start_a_model(tmp_path):
    """PaddleNLP's save_pretrained pdparams, whole and sharded, open through the data-only loader."""
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    whole = _paddlenlp_model(tmp_path / "whole")
    paddle.seed(2)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(tmp_path / "sharded", safe_serialization=False,
                                                           max_shard_size="100KB")
    assert len(list((tmp_path / "sharded").glob("*.pdparams"))) > 1
    for folder in (whole, tmp_path / "sharded"):
        pretrained = open_pretrained(folder)
        assert pretrained.kind == PADDLENLP
        theirs = paddle.load(str(whole / "model_state.pdparams"), return_numpy=True)
        for name, array in theirs.items():
            np.testing.assert_array_equal(pretrained.read(name, None, 1, 0), array)


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_hostile_pdparams_is_refused_naming_file_and_global_and_never_runs(protocol, tmp_path):
    folder = _paddlenlp_model(tmp_path / "model")
    marker = tmp_path / "pwned"
    _hostile(folder / "model_state.pdparams", marker, protocol)
    with pytest.raises(UnsafePickleError, match=r"model_state\.pdparams asks to load the Python global "
                                                r"(posix|os)\.system.*--allow_unsafe_pickle"):
        open_pretrained(folder)
    assert not marker.exists()


def _fleet_folder(folder: Path, marker: Path, hostile: str) -> Path:
    """Fleet per-rank files of our LLaMA as PaddleNLP's Trainer writes them (one rank), with the file
    named `hostile` replaced by one that runs code."""
    from modeling.registry import config_from_dict, family_of

    folder.mkdir()
    config = config_from_dict({"model_type": "llama", **SHAPE})
    model = family_of(config).causal_lm(config)
    optimizer = paddle.optimizer.AdamW(learning_rate=paddle.optimizer.lr.CosineAnnealingDecay(1e-3, 10),
                                       parameters=model.parameters())
    model(paddle.to_tensor([[1, 2, 3]]), labels=paddle.to_tensor([[2, 3, 4]]))[0].backward()
    optimizer.step()
    paddle.save(model.state_dict(), str(folder / "model_state.pdparams"))
    paddle.save(optimizer.state_dict(), str(folder / "optimizer.pdopt"))
    paddle.save(optimizer._learning_rate.state_dict(), str(folder / "scheduler.pdparams"))
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 1, "consumed_samples": 1}))
    _hostile(folder / hostile, marker)
    return folder


def _tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=REPO)


@pytest.mark.parametrize("hostile", ["model_state.pdparams", "optimizer.pdopt", "scheduler.pdparams"])
def test_the_merge_tool_refuses_hostile_fleet_files_and_a_trusted_folder_merges_with_the_flag(hostile, tmp_path):
    marker = tmp_path / "pwned"
    folder = _fleet_folder(tmp_path / "fleet", marker, hostile)
    refused = _tool(str(REPO / "tools" / "reshard.py"), "merge", str(folder), str(tmp_path / "merged"))
    assert refused.returncode == 1 and f"{folder / hostile} asks to load the Python global" in refused.stderr, \
        refused.stderr[-2000:]
    assert not marker.exists() and not (tmp_path / "merged").exists()
    if hostile == "scheduler.pdparams":  # the flag hands a trusted folder to paddle.load, code and all
        (folder / hostile).unlink()
        paddle.save({"last_epoch": 1, "last_lr": 1e-3}, str(folder / hostile))
        trusted = _tool(str(REPO / "tools" / "reshard.py"), "merge", str(folder), str(tmp_path / "merged"),
                        "--allow_unsafe_pickle")
        assert trusted.returncode == 0, trusted.stderr[-2000:]


def test_generate_and_conversion_refuse_a_hostile_folder_and_convert_a_trusted_one(tmp_path):
    marker = tmp_path / "pwned"
    hostile = _hostile(_paddlenlp_model(tmp_path / "hostile") / "model_state.pdparams", marker).parent
    for args in ([str(REPO / "tools" / "generate.py"), str(hostile), "--prompt", "The"],
                 [str(REPO / "tools" / "convert_hf.py"), "import", str(hostile), str(tmp_path / "converted")]):
        refused = _tool(*args)
        assert refused.returncode in (1, 2) and "model_state.pdparams asks to load the Python global" in refused.stderr, \
            refused.stderr[-2000:]
    assert not marker.exists()
    trusted = _paddlenlp_model(tmp_path / "trusted")
    converted = _tool(str(REPO / "tools" / "convert_hf.py"), "import", str(trusted), str(tmp_path / "safe"),
                      "--allow_unsafe_pickle")
    assert converted.returncode == 0, converted.stderr[-2000:]
    assert not list((tmp_path / "safe").glob("*.pdparams")) and list((tmp_path / "safe").glob("*.safetensors"))
    assert open_pretrained(tmp_path / "safe").config["hidden_size"] == SHAPE["hidden_size"]


@pytest.mark.multiproc
def test_the_trainer_refuses_a_hostile_folder_on_every_rank_before_any_process_group(run_workers, data_cache,
                                                                                     tmp_path):
    marker = tmp_path / "pwned"
    folder = _hostile(_paddlenlp_model(tmp_path / "model") / "model_state.pdparams", marker).parent
    with pytest.raises(LaunchError) as error:
        run_workers(SCRIPT, 2, [*MODEL, "--model_name_or_path", str(folder), "--tensor_parallel_degree", "2",
                                "--data_cache", str(data_cache), "--output_dir", str(tmp_path / "out")], timeout=200)
    for rank in (0, 1):
        log = error.value.rank_logs[rank]
        assert "run_pretrain.py: error:" in log and "asks to load the Python global" in log, log[-2000:]
        assert "ProcessGroup" not in log and "init_parallel_env" not in log
    assert not marker.exists()
