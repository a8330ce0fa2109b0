"""Starting from a model folder (`--model_name_or_path`) and generation: transformers and PaddleNLP
compute the reference losses on the batch the trainer reads (recipes: test_recipes.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import first_batch

from checkpoint.format import CheckpointError
from checkpoint.shards import ShardReader, TensorSpec, write_shard
from paddle_pp.interop.pretrained import PADDLENLP, TRANSFORMERS, UNIFIED, open_pretrained
from paddle_pp.training.arguments import parse_args
from paddle_pp.training.generation import load_generator
from paddle_pp.training.model_config import ModelSourceError, model_config

import hf_models
from runs import REPO, RESUME_STEP, SHARDED_TP_PP_SAVING, TOKENIZER, pretrain

LOSS_RTOL = 1e-5  # step 1's loss is a forward of the same fp32 weights on the same batch
SHAPE = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)  # the runs' MODEL flags, GQA on
STEPS = ("--max_steps", "3", "--warmup_steps", "1", "--eval_steps", "0")


def _with_tokenizer(folder: Path) -> Path:
    shutil.copy(TOKENIZER / "tokenizer.model", folder)
    return folder


@pytest.fixture(scope="module")
def transformers_folder(transformers4_folders) -> Path:
    """A transformers LlamaForCausalLM with random weights, saved by transformers itself."""
    return transformers4_folders / "llama"


def _paddlenlp_folder(folder: Path, safetensors: bool) -> Path:
    import paddle
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    paddle.seed(1)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(folder, safe_serialization=safetensors,
                                                           max_shard_size="200KB")
    return _with_tokenizer(folder)


@pytest.fixture(scope="module")
def first_rows(data_cache) -> np.ndarray:
    """The 8 samples of step 1 of a 3-step run on the shipped corpus (PaddleNLP's sample order)."""
    return first_batch(data_cache, TOKENIZER, 3)


@pytest.fixture(scope="module")
def launched(run_workers_module, data_cache, tmp_path_factory):
    """Launch run_pretrain.py (MODEL flags + `flags`) as job `tag`, into `out` or a new folder;
    (rank 0's result, output dir)."""
    def run(tag: str, nproc: int, flags: tuple[str, ...], out: Path | None = None):
        out = out or tmp_path_factory.mktemp(tag)
        return pretrain(run_workers_module, data_cache, out, nproc, flags, tag)[0], out

    return run


def _paddlenlp_loss(folder: Path, rows: np.ndarray) -> float:
    import paddle
    from paddlenlp.transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(folder))
    model.eval()
    with paddle.no_grad():
        return float(model(paddle.to_tensor(rows[:, :-1]), labels=paddle.to_tensor(rows[:, 1:]))[0])


@pytest.mark.multiproc
def test_a_transformers_llama_trains_and_the_same_command_resumes_its_own_checkpoint(
        transformers_folder, first_rows, launched):
    """(Starting under tp2 x pp2 and tp2 + SP: tests/test_family_training.py.)"""
    start = ("--model_name_or_path", str(transformers_folder), *STEPS)
    single, out = launched("hf_single", 1, start + ("--save_steps", "3"))
    np.testing.assert_allclose(single["losses"][0], hf_models.loss(transformers_folder, first_rows), rtol=LOSS_RTOL)
    assert single["losses"][2] < single["losses"][0]
    # the same command again, now resuming its own checkpoint: the folder's config equals the saved one
    resumed, _ = launched("hf_single_again", 1, start + ("--max_steps", "4", "--resume_from_checkpoint", "latest"), out)
    assert resumed["trained_steps"] == [4]


@pytest.mark.multiproc
@pytest.mark.parametrize("safetensors", [True, False], ids=["sharded_safetensors", "pdparams"])
def test_a_paddlenlp_save_pretrained_folder_starts_at_paddlenlps_loss(
        safetensors, first_rows, launched, tmp_path):
    folder = _paddlenlp_folder(tmp_path / "nlp", safetensors)
    assert len(list(folder.glob("*.safetensors" if safetensors else "*.pdparams"))) > 1  # sharded
    result, _ = launched(f"nlp_{safetensors}", 1, ("--model_name_or_path", str(folder), *STEPS))
    np.testing.assert_allclose(result["losses"][0], _paddlenlp_loss(folder, first_rows), rtol=LOSS_RTOL)


def test_folders_are_recognised_with_their_config(transformers_folder, pretrain_run, tmp_path):
    hf = open_pretrained(transformers_folder)
    assert (hf.kind, hf.config["num_key_value_heads"], hf.config["rope_theta"]) == (TRANSFORMERS, 2, 50000.0)
    _, saved = pretrain_run(SHARDED_TP_PP_SAVING)
    ours = open_pretrained(saved / f"checkpoint-{RESUME_STEP}")
    assert (ours.kind, ours.config["hidden_size"]) == (UNIFIED, 64)
    assert open_pretrained(_paddlenlp_folder(tmp_path / "nlp", True)).kind == PADDLENLP
    config_only = open_pretrained(_paddlenlp_folder(tmp_path / "pd", False), weights=False)  # a resume: no pickle load
    assert (config_only.kind, config_only.config["num_key_value_heads"]) == (PADDLENLP, 2)
    with pytest.raises(CheckpointError, match="opened for its config only"):
        config_only.read("lm_head.weight", None, 1, 0)


def _rewrite(folder: Path, change) -> Path:
    """A copy of a transformers folder whose tensors `change` ({name: array} -> {name: array}) edits."""
    reader = ShardReader(folder / "model.safetensors")
    tensors = change({name: reader.read(name) for name in sorted(reader.names)})
    write_shard(folder / "model.safetensors", [TensorSpec(n, a.dtype, a.shape) for n, a in tensors.items()],
                tensors.values(), {"format": "pt"})
    return folder


def _edit_config(folder: Path, **fields) -> Path:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | fields))
    return folder


BAD_FOLDERS = {
    "missing_tensor": (lambda f: _rewrite(f, lambda t: {k: v for k, v in t.items() if "layers.3.mlp.up" not in k}),
                       "model.layers.3.mlp.up_proj.weight: missing"),
    "wrong_shape": (lambda f: _rewrite(f, lambda t: t | {"model.norm.weight": np.ones(32, np.float32)}),
                    "model.norm.weight: shape [32] in the folder, the model needs [64]"),
    "unexpected_tensor": (lambda f: _rewrite(f, lambda t: t | {"model.extra.bias": np.ones(4, np.float32)}),
                          "model.extra.bias: not a tensor of LlamaForCausalLM"),
    "rope_scaling": (lambda f: _edit_config(f, rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type 'dynamic'"),
    "architecture": (lambda f: _edit_config(f, model_type="deepseek_v4"),
                     "model_type 'deepseek_v4'.*DeepSeek-V4 is not modelled"),
    "no_config": (lambda f: (f / "config.json").unlink() or f, "no config.json"),
    "no_weights": (lambda f: (f / "model.safetensors").unlink() or f, "no weights found"),
}


@pytest.mark.parametrize("case", sorted(BAD_FOLDERS))
def test_a_folder_that_does_not_fit_fails_naming_the_tensor_or_field(transformers_folder, tmp_path, case):
    make, message = BAD_FOLDERS[case]
    folder = make(Path(shutil.copytree(transformers_folder, tmp_path / case)))
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        open_pretrained(folder)


@pytest.mark.parametrize("flags, vocab, message", [
    (("--hidden_size", "128"), 4096, "--hidden_size 128 contradicts"),
    (("--max_seq_length", "128"), 4096, "exceeds the model's max_position_embeddings 64"),
    ((), 5000, "the tokenizer has 5000 tokens but"),
], ids=["shape_flag", "sequence", "vocabulary"])
def test_flags_or_a_tokenizer_that_contradict_the_folder_fail(transformers_folder, flags, vocab, message):
    args = parse_args(["--model_name_or_path", str(transformers_folder), *flags])
    with pytest.raises(ModelSourceError, match=message):
        model_config(args.model, args.data.max_seq_length, vocab, open_pretrained(transformers_folder), args.given)


def test_flags_equal_to_the_folder_or_without_its_weights_are_accepted(transformers_folder):
    pretrained = open_pretrained(transformers_folder)
    same = parse_args(["--model_name_or_path", str(transformers_folder), "--hidden_size", "64"])
    assert model_config(same.model, 32, 4096, pretrained, same.given).hidden_size == 64
    other = parse_args(["--model_name_or_path", str(transformers_folder), "--no-continue_training",
                        "--num_hidden_layers", "2"])
    assert model_config(other.model, 32, 4096, pretrained, other.given).num_hidden_layers == 2


def test_greedy_generation_matches_transformers_generate(transformers_folder):
    import torch
    import transformers

    generator = load_generator(transformers_folder)
    prompt = generator.tokenizer.encode("The hacker ethic")
    ours = generator.token_ids(prompt, 12)
    model = transformers.LlamaForCausalLM.from_pretrained(str(transformers_folder)).eval()
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs


def test_generate_prints_text_from_a_trained_checkpoint_and_a_seed_repeats_it(pretrain_run):
    _, saved = pretrain_run(SHARDED_TP_PP_SAVING)
    checkpoint = saved / f"checkpoint-{RESUME_STEP}"
    command = [sys.executable, str(REPO / "tools" / "generate.py"), str(checkpoint), "--prompt", "The hacker",
               "--top_p", "0.9", "--seed", "7", "--max_new_tokens", "16"]
    runs = [subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO) for _ in range(2)]
    assert all(done.returncode == 0 for done in runs), runs[0].stderr[-2000:]
    text = runs[0].stdout.strip()
    assert text.startswith("The hacker") and len(text) > len("The hacker") and runs[1].stdout == runs[0].stdout
    generator = load_generator(checkpoint)
    assert generator.complete("The hacker", 16, 0.9, seed=8) != generator.complete("The hacker", 16, 0.9, seed=7)
