"""PaddleNLP checkpoints trained with fused projections (`fuse_attention_qkv`, `fuse_attention_ffn`,
as all of PaddleNLP's benchmark recipes set them), made by PaddleNLP's own models inside the test:
our single-card model gives their logits (LLaMA with GQA, Qwen2 with q/k/v biases, GPT); each tp
rank reads its own pieces in place; the trainer starts from one under tp2 x pp2 at the single-card
loss, and its checkpoint exports back to the fused form that PaddleNLP loads with the same logits."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import paddle
import pytest
from conftest import IDS, first_batch

from modeling.registry import config_from_dict, family_of, plan_of
from paddle_pp.interop.pretrained import load_pretrained, open_pretrained

from hf_models import SHAPE  # the runs' MODEL flags
from parity import our_logits
from runs import PP2, REPO, TOKENIZER, TP2, Run

LOGITS_RTOL, LOSS_RTOL, EXPORT_TOL = 1e-6, 1e-5, 1e-4
FUSED = {"LlamaForCausalLM": ("LlamaConfig", dict(num_key_value_heads=2), ("fuse_attention_qkv", "fuse_attention_ffn")),
         "Qwen2ForCausalLM": ("Qwen2Config", dict(num_key_value_heads=2), ("fuse_attention_qkv", "fuse_attention_ffn")),
         "GPTForCausalLM": ("GPTConfig", dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                            ("fuse_attention_qkv",))}


def _paddlenlp_logits(model, ids: np.ndarray) -> np.ndarray:
    model.eval()
    with paddle.no_grad():
        out = model(paddle.to_tensor(ids))
    return (out[0] if isinstance(out, (tuple, list)) else out).numpy()


def _saved_by_paddlenlp(architecture: str, folder):
    """PaddleNLP's model with its fuse flags on (set after the config is built: its constructor resets
    them), random biases, saved with save_pretrained as safetensors; returns the model."""
    import paddlenlp.transformers as nlp

    config_class, extra, flags = FUSED[architecture]
    config = getattr(nlp, config_class)(**SHAPE, **extra)
    for flag in flags:
        setattr(config, flag, True)
    paddle.seed(5)
    model = getattr(nlp, architecture)(config)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.set_value(paddle.randn(param.shape) * 0.1)
    model.save_pretrained(str(folder), safe_serialization=True)
    for path in TOKENIZER.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    return model


@pytest.fixture(scope="module")
def fused_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("paddlenlp_fused")
    return {architecture: (root / architecture, _saved_by_paddlenlp(architecture, root / architecture))
            for architecture in FUSED}


@pytest.mark.parametrize("architecture", list(FUSED))
def test_a_fused_paddlenlp_folder_gives_paddlenlps_logits(fused_folders, architecture):
    from safetensors import safe_open

    folder, theirs = fused_folders[architecture]
    with safe_open(str(folder / "model.safetensors"), "np") as stored:
        assert any("qkv_proj" in name for name in stored.keys()) and not any("q_proj" in n for n in stored.keys())
    expected = _paddlenlp_logits(theirs, IDS)
    np.testing.assert_allclose(our_logits(folder, IDS), expected, rtol=LOGITS_RTOL,
                               atol=LOGITS_RTOL * np.abs(expected).max())


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_each_tp_rank_reads_its_own_pieces_of_the_fused_projections(fused_folders, architecture):
    """A rank's positioned read of q, k, v (and biases), gate and up at tp2 equals its split of the
    whole tensor: its kv heads are whole groups of the fused columns."""
    pretrained = open_pretrained(fused_folders[architecture][0])
    axes = plan_of(config_from_dict(pretrained.config)).axes()
    projections = [name for name in axes if any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj",
                                                                     "up_proj"))]
    assert len(projections) >= 5 * SHAPE["num_hidden_layers"]
    for name in projections:
        whole = pretrained.read(name, None, 1, 0)
        for rank in range(2):
            np.testing.assert_array_equal(pretrained.read(name, axes[name], 2, rank),
                                          np.split(whole, 2, axis=axes[name])[rank], err_msg=name)


@pytest.mark.multiproc
def test_a_fused_llama_checkpoint_trains_under_tp2_pp2_and_exports_back_fused(fused_folders, pretrain_run,
                                                                             data_cache, tmp_path):
    import paddlenlp.transformers as nlp

    folder, _ = fused_folders["LlamaForCausalLM"]
    steps = ("--max_steps", "2", "--eval_steps", "0", "--warmup_steps", "1", "--save_steps", "2")
    (result, *_), out = pretrain_run(Run("fused_llama_tp2pp2", 4, ("--model_name_or_path", str(folder),
                                                                   *steps) + TP2 + PP2))
    pretrained = open_pretrained(folder)
    config = config_from_dict(pretrained.config)
    model = family_of(config).causal_lm(config)
    load_pretrained(pretrained, model, plan_of(config).axes(), None)
    rows = paddle.to_tensor(first_batch(data_cache, folder, 2))
    with paddle.no_grad():
        expected, _ = model(rows[:, :-1], labels=rows[:, 1:])
    np.testing.assert_allclose(result["losses"][0], float(expected), rtol=LOSS_RTOL)

    checkpoint, export = out / "checkpoint-2", tmp_path / "fused_export"
    done = subprocess.run([sys.executable, str(REPO / "tools" / "reshard.py"), "weights", str(checkpoint), str(export),
                           "--fuse_attention_qkv", "--fuse_attention_ffn"], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    saved = json.loads((export / "config.json").read_text())
    assert saved["fuse_attention_qkv"] and saved["fuse_attention_ffn"]
    config = nlp.LlamaConfig.from_pretrained(str(export))
    config.fuse_attention_qkv = config.fuse_attention_ffn = True  # as PaddleNLP's run_pretrain.py sets them
    theirs = nlp.LlamaForCausalLM.from_pretrained(str(export), config=config)
    assert any("qkv_proj" in name for name in theirs.state_dict())
    np.testing.assert_allclose(_paddlenlp_logits(theirs, IDS), our_logits(checkpoint, IDS), rtol=EXPORT_TOL,
                               atol=EXPORT_TOL)
