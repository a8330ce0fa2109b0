"""Multi-head latent attention (DeepSeek-V3's MLA: low-rank q and kv, a rotary key shared by every head,
q/k heads of 24 and v heads of 16, yarn with mscale) in every layout equals the single-card model:
eval loss (rtol 1e-6), then 3 SGD steps (losses and every gathered parameter within 1e-5: with SGD a
parameter's move is its clipped gradient, so every gradient is compared, the shared rotary key's
through `kv_a_proj_with_mqa`'s), from one single-card initial state.

Under tp2 the latent projections are whole on each rank and the rotary key's gradient is summed
over tp (without the sum `kv_a_proj_with_mqa` drifts from single card); under tp2 + SP the whole
weights' gradients are each rank's heads' part, summed at the update; under cp2 the ring carries
the expanded k and v (v narrower than q and k) around the blockwise kernel.
"""

from __future__ import annotations

import pytest

from modeling.deepseek import DeepseekV3ForCausalLM

from parity import assert_matches, layout_runs, write_model_files
from runs import TP2

pytestmark = pytest.mark.multiproc

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, first_k_dense_replace=2, num_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
              moe_intermediate_size=16, max_position_embeddings=64,
              rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                            "mscale": 0.707, "mscale_all_dim": 1.0})
SGD = ("--optimizer", "sgd", "--seq", "16")
BLOCKWISE = ("--attention", "blockwise", "--block", "6")
LAYOUTS = {
    "tp2": (2, TP2 + SGD),
    "tp2_sp_blockwise": (2, TP2 + ("--sequence_parallel",) + SGD + BLOCKWISE),
    "cp2_ring": (2, ("--context_parallel_degree", "2") + SGD + BLOCKWISE),
}


@pytest.fixture(scope="module")
def mla_files(tmp_path_factory):
    return write_model_files(tmp_path_factory.mktemp("mla"), "deepseek_v3", CONFIG, DeepseekV3ForCausalLM)


@pytest.fixture(scope="module")
def mla_run(run_workers_module, mla_files):
    return layout_runs(run_workers_module, mla_files, LAYOUTS, SGD)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_latent_attention_matches_single_card(mla_run, name):
    assert_matches(name, mla_run(name), mla_run("single"))
