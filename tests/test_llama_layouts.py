"""LLaMA in every layout equals the single-card model: eval loss (rtol 1e-6), then 3 AdamW steps
(losses and every gathered parameter within 1e-5), from one single-card initial state.

The config uses GQA (4 heads, 2 kv heads), so every TP layout here also covers split kv heads.
"""

from __future__ import annotations

import json

import numpy as np
import paddle
import pytest

from modeling.llama.config import LlamaConfig
from modeling.llama.modeling import LlamaForCausalLM

pytestmark = pytest.mark.multiproc

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
EVAL_RTOL, TRAIN_TOL = 1e-6, 1e-5
TP2, PP2 = ["--tensor_parallel_degree", "2"], ["--pipeline_parallel_degree", "2"]
SHARDING2 = ["--sharding_parallel_degree", "2", "--sharding", "stage1"]
LAYOUTS = {
    "tp2": (2, TP2),
    "pp2": (2, PP2),
    "tp2pp2": (4, TP2 + PP2),
    "dp2": (2, []),
    "sharding2": (2, SHARDING2),
    "dp2_sharding2_tp2_pp2": (16, TP2 + PP2 + SHARDING2),
}


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory):
    base = tmp_path_factory.mktemp("llama")
    paddle.seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    np.savez(base / "init.npz", **{k: v.numpy() for k, v in model.state_dict().items()})
    (base / "config.json").write_text(json.dumps(CONFIG))
    return base


def run_llama(run, files, nproc, flags, tag):
    out = files / f"{tag}.npz"
    results = run("llama_worker.py", nproc, [*flags, "--config", files / "config.json", "--init", files / "init.npz",
                                            "--out", out], timeout=300, tag=tag)
    return results, dict(np.load(out))


@pytest.fixture(scope="module")
def single_card(run_workers_module, llama_files):
    (result,), params = run_llama(run_workers_module, llama_files, 1, [], "single")
    return result, params


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_llama_layout_matches_single_card(run_workers_module, llama_files, single_card, name):
    nproc, flags = LAYOUTS[name]
    results, params = run_llama(run_workers_module, llama_files, nproc, flags, name)
    reference, reference_params = single_card
    assert len({tuple(r["losses"]) for r in results}) == 1, f"{name}: ranks disagree"
    np.testing.assert_allclose(results[0]["eval_loss"], reference["eval_loss"], rtol=EVAL_RTOL)
    np.testing.assert_allclose(results[0]["losses"], reference["losses"], rtol=TRAIN_TOL)
    assert sorted(params) == sorted(reference_params), f"{name}: gathered names differ from single card"
    for key, value in reference_params.items():
        np.testing.assert_allclose(params[key], value, rtol=TRAIN_TOL, atol=TRAIN_TOL, err_msg=f"{name}: {key}")


def test_tp2pp2_weights_load_into_paddlenlp_llama(run_workers_module, llama_files, single_card):
    """Weights gathered from tp2 x pp2 load by name into PaddleNLP's LlamaForCausalLM; logits match ours."""
    import paddlenlp.transformers as nlp

    _, params = run_llama(run_workers_module, llama_files, 4, TP2 + PP2, "tp2pp2_export")
    ours = LlamaForCausalLM(LlamaConfig(**CONFIG))
    ours.set_state_dict({k: paddle.to_tensor(v) for k, v in params.items()})
    theirs = nlp.LlamaForCausalLM(nlp.LlamaConfig(**CONFIG))
    missing, unexpected = theirs.set_state_dict({k: paddle.to_tensor(v) for k, v in params.items()})
    assert not missing and not unexpected
    ours.eval(), theirs.eval()
    ids = paddle.to_tensor(np.random.default_rng(7).integers(0, CONFIG["vocab_size"], size=(2, 12)))
    theirs_logits = theirs(ids)
    theirs_logits = theirs_logits[0] if isinstance(theirs_logits, (tuple, list)) else theirs_logits
    np.testing.assert_allclose(ours(ids).numpy(), theirs_logits.numpy(), rtol=1e-6, atol=1e-6)
