"""LLaMA under tp2, pp2 x vpp2, pp3 (uneven stages) and DualPipeV on pp4 equals the single-card model:
eval loss (rtol 1e-6), then 3 AdamW steps (losses and every gathered parameter within 1e-5), from one
single-card initial state. (dp2, sharding2 and pp2 ran here too; the trainer's runs cover each of them,
with more axes beside: tests/test_trainer.py, test_checkpoint.py, test_sharding_stages.py.)

The config uses GQA (4 heads, 2 kv heads), so every TP layout here also covers split kv heads. The
reference computes attention with the dense core. The blockwise core with uneven blocks under
tp2 x pp2 + SP against the dense single card: tests/test_documents.py (per document, which adds
masks to the same blocks); the trainer's runs take the blockwise core on CPU in every layout.
"""

from __future__ import annotations

import paddle
import pytest

from modeling.llama import LlamaConfig, LlamaForCausalLM

from parity import assert_matches, assert_same_logits, layout_runs, write_model_files
from runs import PP2, TP2

pytestmark = pytest.mark.multiproc

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
LAYOUTS = {
    "tp2": (2, TP2),
    "pp2_vpp2": (2, PP2 + ("--virtual_pp_degree", "2", "--accumulate_steps", "4")),
    "pp3_uneven": (3, ("--pipeline_parallel_degree", "3")),  # 8 layers: 2, 3, 3 (placement.chunk_starts)
    # Paddle's DualPipeVParallel: 8 chunks of one layer in a V; stages 1 and 2 pass both ways
    "pp4_dualpipev": (4, ("--pipeline_parallel_degree", "4", "--pipeline_schedule", "DualPipeV",
                          "--accumulate_steps", "8")),
}


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory):
    return write_model_files(tmp_path_factory.mktemp("llama"), "llama", CONFIG, LlamaForCausalLM)


@pytest.fixture(scope="module")
def llama_run(run_workers_module, llama_files):
    """Each layout is launched once per module, whichever tests read it."""
    return layout_runs(run_workers_module, llama_files, LAYOUTS)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_llama_layout_matches_single_card(llama_run, name):
    assert_matches(name, llama_run(name), llama_run("single"))


def test_tp2_weights_load_into_paddlenlp_llama(llama_run):
    """Weights gathered from tp2 load by name into PaddleNLP's LlamaForCausalLM; logits match ours
    (tp2 x pp2 of the trainer: tests/test_trainer.py)."""
    import paddlenlp.transformers as nlp

    _, params = llama_run("tp2")
    ours = LlamaForCausalLM(LlamaConfig(**CONFIG))
    ours.set_state_dict({k: paddle.to_tensor(v) for k, v in params.items()})
    theirs = nlp.LlamaForCausalLM(nlp.LlamaConfig(**CONFIG))
    missing, unexpected = theirs.set_state_dict({k: paddle.to_tensor(v) for k, v in params.items()})
    assert not missing and not unexpected
    assert_same_logits(ours, theirs, CONFIG["vocab_size"], seed=7)
