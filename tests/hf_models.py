"""Model folders as users bring them, made by transformers itself, and transformers' own answers on
them (loss on a batch, logits), under whichever transformers this process imports.

Imported by the tests (transformers 4.x from the venv) and run as a script under transformers 5
(`transformers5`: the same venv's torch, transformers 5 from `.venv/transformers5` on PYTHONPATH),
so both generations save the folders and compute the references. Nothing here reads our code.

    python hf_models.py serve                                one command a line of stdin (JSON), as `transformers5`
                                                             sends them: torch and transformers 5 imported once
    python hf_models.py make ROOT ROWS.npy IDS.npy KIND...   save each KIND model as ROOT/KIND, with its
                                                             loss on ROWS (ROOT/KIND.json) and logits on IDS
                                                             (ROOT/KIND.npy); under transformers 5 an MoE
                                                             KIND also as ROOT/KIND_fused, re-saved with
                                                             save_original_format=False
    python hf_models.py logits IDS.npy FOLDER...             each saved folder's logits on IDS (FOLDER.npy)
    python hf_models.py with_prediction_layers FOLDER DEPTH ROWS.npy IDS.npy
                                                             (transformers 5) FOLDER given DEPTH multi-token
                                                             prediction layers, then as below
    python hf_models.py recurrent_rule RULE INPUTS.npz ANSWERS.npz
                                                             (transformers 5) its chunked and token-by-token
                                                             functions of RULE (gated_delta, kimi_delta) on
                                                             INPUTS: outputs, states, gradients
    python hf_models.py greedy IDS.npy COUNT FOLDER...     each folder's greedy generation of COUNT tokens after
                                                             IDS (FOLDER.greedy.npy)
    python hf_models.py encoded TEXTS.json FOLDER...        each folder's tokenizer's ids of each text, with and
                                                             without special tokens (FOLDER.encoded.json)
    python hf_models.py ssd INPUTS.npz ANSWERS.npz         (transformers 5) Mamba-2's scan on INPUTS (`ssd_answers`)
    python hf_models.py prediction_answers ROWS.npy IDS.npy FOLDER...
                                                             (transformers 5) MtpModel's answers on each
                                                             folder with one (FOLDER.mtp.npz)
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import select
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TRANSFORMERS5 = REPO / ".venv" / "transformers5"  # installed by the README's setup command
SHAPE = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             max_position_embeddings=64)  # the runs' MODEL flags
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # shorter than the runs' 32 tokens: the scaling shows
# kind -> (transformers class, config class, config fields): one per case a user brings
KINDS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(SHAPE, num_key_value_heads=2, rope_theta=50000.0)),
    "llama_tied": ("LlamaForCausalLM", "LlamaConfig", dict(SHAPE, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama3": ("LlamaForCausalLM", "LlamaConfig", dict(SHAPE, num_key_value_heads=2, rope_theta=500000.0,
                                                       rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True)),
    "llama_linear": ("LlamaForCausalLM", "LlamaConfig", dict(SHAPE, num_key_value_heads=2, attention_bias=True,
                                                             rope_scaling={"rope_type": "linear", "factor": 2.0},
                                                             mlp_bias=True)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(SHAPE, num_key_value_heads=2, sliding_window=8)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(SHAPE, num_key_value_heads=2, tie_word_embeddings=True,
                                                      rope_theta=1000000.0)),
    "qwen2_window": ("Qwen2ForCausalLM", "Qwen2Config", dict(SHAPE, num_key_value_heads=2, use_sliding_window=True,
                                                             sliding_window=8, max_window_layers=2)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(SHAPE, num_key_value_heads=2, head_dim=32)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(SHAPE, num_key_value_heads=2, head_dim=32)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=4096, n_embd=64, n_layer=4, n_head=4, n_positions=64,
                                                   n_inner=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    # the families of attention that differs per layer: windows of 8 keys (shorter than the 24-token logits
    # batch and the runs' 32 tokens), caps small enough to bend the tiny models' scores and logits
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(SHAPE, num_key_value_heads=2, head_dim=32,
                                                         query_pre_attn_scalar=24, sliding_window=8,
                                                         attn_logit_softcapping=0.5, final_logit_softcapping=2.0)),
    # Gemma 3's q/k norms make scores O(head_dim): at scale 24^-1/2 its attention is near one-hot and 20 steps
    # amplify fp32 summation noise past 1e-4 in any two layouts (pp2 included); its own scalar (256) is smooth
    # one key/value head, as Gemma 3 270M and 1B have: under tp2 each rank holds the projections whole
    "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(SHAPE, num_key_value_heads=1, head_dim=32,
                                                                  query_pre_attn_scalar=256, sliding_window=8,
                                                                  sliding_window_pattern=2, rope_theta=50000.0,
                                                                  rope_local_base_freq=5000.0,
                                                                  rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(SHAPE, num_key_value_heads=2, partial_rotary_factor=0.75, pad_token_id=0,
                                                   original_max_position_embeddings=16, sliding_window=8,
                                                   rope_scaling={"type": "longrope",
                                                                 "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
                                                                 "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]})),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(SHAPE, num_key_value_heads=2)),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", dict(SHAPE, num_key_value_heads=2, no_rope_layer_interval=2, pad_token_id=0,
                                                            use_sliding_window=True, sliding_window=8)),
    "granite": ("GraniteForCausalLM", "GraniteConfig", dict(SHAPE, num_key_value_heads=2, embedding_multiplier=12.0,
                                                            residual_multiplier=0.22, attention_multiplier=0.03,
                                                            logits_scaling=4.0)),
    "ernie4_5": ("Ernie4_5ForCausalLM", "Ernie4_5Config", dict(SHAPE, num_key_value_heads=2, head_dim=32,
                                                               use_bias=True)),
    "mpt": ("MptForCausalLM", "MptConfig", dict(vocab_size=4096, d_model=64, n_heads=4, n_layers=4, max_seq_len=64,
                                                attn_config={"clip_qkv": 0.12})),
}

MOE = dict(SHAPE, num_key_value_heads=2, num_experts_per_tok=2)
DEEPSEEK = dict(SHAPE, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32, num_experts_per_tok=2,
                first_k_dense_replace=1, num_nextn_predict_layers=0)
# mixture-of-experts kinds (4 experts, top-2; kept apart from KINDS, which every family test walks)
MOE_KINDS = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(MOE, head_dim=32, num_experts=4, moe_intermediate_size=32,
                                                                norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(MOE, num_experts=4, moe_intermediate_size=32,
                                                                shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(MOE, num_local_experts=4)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(MOE, num_experts=4)),
    # DeepSeek-class routers: 8 experts in 2 groups (one kept), correction biases that change the choice, a dense
    # first layer, shared experts; V3 with yarn (mscale_all_dim), V2 without a q latent and group_limited_greedy
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        DEEPSEEK, q_lora_rank=32, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.707,
                      "mscale_all_dim": 1.0})),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(
        DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy", n_group=2, topk_group=1,
        routed_scaling_factor=16.0)),
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(
        MOE, head_dim=16, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32, n_group=2, topk_group=1,
        routed_scaling_factor=1.5, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True,
        partial_rotary_factor=0.5, num_nextn_predict_layers=0)),
    # softmax routing with a [1, E] correction bias (moe_statics), clamped renormalisation, a shared expert, a dense
    # first layer (moe_layer_start_index)
    "ernie4_5_moe": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", dict(
        SHAPE, num_key_value_heads=2, head_dim=16, moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
        moe_num_shared_experts=1, moe_layer_start_index=1, router_aux_loss_coef=0.01)),
    # sinks, windows of 8 on even layers, yarn (no truncation), stacked interleaved experts with biases
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(
        MOE, head_dim=16, num_local_experts=4, sliding_window=8,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 16})),
}
# kinds of transformers 5 only whose token mixers differ per layer (recurrent beside attention): both mixer kinds on
# each of two pipeline stages; Gated DeltaNet with fewer key heads than value heads
LINEAR, FULL = "linear_attention", "full_attention"
MAMBA2 = dict(mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2)
FALCON_H1 = dict(SHAPE, num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
                 embedding_multiplier=5.0, lm_head_multiplier=0.25, key_multiplier=0.5, attention_in_multiplier=1.5,
                 attention_out_multiplier=0.75, ssm_in_multiplier=1.25, ssm_out_multiplier=0.5,
                 ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 0.8], mlp_multipliers=[1.5, 0.5], time_step_limit=(0.0, 1.3),
                 rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
GRANITE_HYBRID = dict(SHAPE, intermediate_size=32, num_key_value_heads=2, layer_types=["mamba", "attention"] * 2,
                      mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, shared_intermediate_size=48,
                      num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01, embedding_multiplier=12.0,
                      residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0,
                      time_step_limit=(0.0, 1.3))
HYBRID_KINDS = {
    "qwen3_5_text": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(
        SHAPE, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, layer_types=[LINEAR, FULL, LINEAR, FULL],
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True})),
    # Olmo-Hybrid as released: no rotary (rope_parameters null), beta doubled, OLMo-2's attention layers
    "olmo_hybrid": ("OlmoHybridForCausalLM", "OlmoHybridConfig", dict(
        SHAPE, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, layer_types=[LINEAR, FULL, LINEAR, FULL], pad_token_id=1, eos_token_id=2)),
    # Falcon-H1: attention and Mamba-2 side by side in every layer, every muP multiplier off 1, dt clamped above
    "falcon_h1": ("FalconH1ForCausalLM", "FalconH1Config", FALCON_H1),
    # Nemotron-H: each layer one part (Mamba-2 in 2 groups of 4 heads, attention without rotary, a ReLU^2 MLP)
    "nemotron_h": ("NemotronHForCausalLM", "NemotronHConfig", dict(
        SHAPE, num_key_value_heads=2, head_dim=16, hybrid_override_pattern="M*-M*-", **MAMBA2)),
}
# the MoE kinds of those (transformers 5 only): Qwen3.5-MoE, the same layers with 4 experts (top-2) and a gated shared
# expert in every layer; Qwen3-Next, with Qwen2-MoE's experts (a dense MLP in layer 1) and its grouped projections
HYBRID_LAYERS = {key: value for key, value in HYBRID_KINDS["qwen3_5_text"][2].items() if key != "intermediate_size"}
HYBRID_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
HYBRID_MOE_KINDS = {
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", dict(HYBRID_LAYERS, **HYBRID_EXPERTS)),
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(HYBRID_LAYERS, intermediate_size=128,
                                                                    mlp_only_layers=[1], **HYBRID_EXPERTS)),
    # Kimi Linear: Kimi Delta Attention (a decay per key channel) in layers 1 and 3, latent attention without
    # rotary in 2 and 4 (1-based, as its linear_attn_config counts), DeepSeek-V3's experts after a dense layer 1
    "kimi_linear": ("KimiLinearForCausalLM", "KimiLinearConfig", dict(
        SHAPE, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4],
                                                     "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Nemotron 3's layers: Mamba-2, attention and latent experts (ReLU^2, routed at 32 of 64 wide) on each stage
    "nemotron_h_moe": ("NemotronHForCausalLM", "NemotronHConfig", dict(
        SHAPE, num_key_value_heads=2, head_dim=16, hybrid_override_pattern="M*EM*E", n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, moe_latent_size=32,
        **MAMBA2)),
    # Granite 4.0-H as released: NoPE, Granite's multipliers, legacy layer names, dt clamped above, GraniteMoE's experts
    # beside the shared MLP
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", GRANITE_HYBRID),
}
# Gemma 4 attends at scale 1 with normalised q and k: at norm weights near one the tiny models' scores reach
# +-head_dim, attention is near one-hot and 20 steps amplify fp32 summation noise past 1e-4 in any two layouts (one
# card's micro-batches of 1 and 2 included); a quarter of that is smooth. Its released soft-cap (30) as well: a cap of
# 3 on logits near 1 amplifies the same noise
GEMMA4_QK_SCALE = 0.25
GEMMA4_TEXT = dict(SHAPE, num_key_value_heads=1, head_dim=16, global_head_dim=32, num_global_key_value_heads=2,
                   attention_k_eq_v=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                   hidden_size_per_layer_input=8, vocab_size_per_layer_input=4096, num_kv_shared_layers=2,
                   use_double_wide_mlp=True, final_logit_softcapping=30.0)
# transformers 5 only, compared on logits in one process (tests/test_model_folders.py): Granite 4.0-H without experts,
# rotary on its attention layers; Falcon-H1 with each order of its optional gated norm
VARIANT_KINDS = {"granitemoehybrid_dense": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", dict(
    GRANITE_HYBRID, num_local_experts=0, position_embedding_type="rope")),
    # Falcon-H1 with Mamba-2's gated norm, normalising before the gate and after it
    "falcon_h1_norm_first": ("FalconH1ForCausalLM", "FalconH1Config", dict(
        FALCON_H1, mamba_rms_norm=True, mamba_norm_before_gate=True)),
    "falcon_h1_gate_first": ("FalconH1ForCausalLM", "FalconH1Config", dict(
        FALCON_H1, mamba_rms_norm=True, mamba_norm_before_gate=False)),
    # Gemma 4 31B's layers: full layers with their keys as values (one head), no per-layer inputs, no shared keys and
    # values; a soft-cap of 3 on these logits (near 1) bends them
    "gemma4_text_31b": ("Gemma4ForCausalLM", "Gemma4TextConfig", dict(
        GEMMA4_TEXT, num_key_value_heads=2, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
        num_kv_shared_layers=0, use_double_wide_mlp=False, final_logit_softcapping=3.0))}
# dense families of 2025-26 only transformers 5 has, declared on what exists: OLMo 3's windows on three layers of four
# with a rotary per layer type (YaRN-like scaling on full layers only), Seed-OSS's q/k/v biases without an o bias
DECLARED_KINDS = {
    "olmo3": ("Olmo3ForCausalLM", "Olmo3Config", dict(SHAPE, num_key_value_heads=2, sliding_window=8, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0}})),
    "seed_oss": ("SeedOssForCausalLM", "SeedOssConfig", dict(SHAPE, num_key_value_heads=2, head_dim=32,
                                                             attention_dropout=0.0, residual_dropout=0.0)),
    # Hunyuan: q/k norms after the rotary, its releases' fixed-alpha NTK rotary
    "hunyuan_v1_dense": ("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config", dict(
        SHAPE, num_key_value_heads=2, head_dim=16, rope_parameters={"rope_type": "dynamic", "alpha": 50.0, "factor": 1.0,
                                                                    "rope_theta": 10000.0})),
    # Apertus: per-head q/k norms, an ungated MLP with its learned xIELU, llama3-scaled rotary
    "apertus": ("ApertusForCausalLM", "ApertusConfig", dict(SHAPE, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE)),
    # Gemma 4 E2B's shape: per-layer embeddings, the last two layers reusing the keys and values of the first two
    # (one of each type, so under pp2 they cross the stage) with MLPs twice as wide, one key/value head on
    # sliding layers, full layers twice as wide with their keys as values (two heads)
    "gemma4_text": ("Gemma4ForCausalLM", "Gemma4TextConfig", GEMMA4_TEXT),
}
LLAMA4_TEXT = dict(SHAPE, num_key_value_heads=2, head_dim=16, intermediate_size=32, intermediate_size_mlp=128,
                   num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=8,
                   floor_scale=4, attn_scale=0.1, rope_scaling=LLAMA3_ROPE)
MISTRAL4_TEXT = dict(SHAPE, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
                     qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32,
                     num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, rope_parameters={
                         "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0,
                         "llama_4_scaling_beta": 0.1})
# multimodal folders (transformers 5 only) whose language model trains: Qwen3.5's, a vision tower of two blocks beside
MULTIMODAL_KINDS = {"qwen3_5_multimodal": ("Qwen3_5ForConditionalGeneration", "Qwen3_5Config", dict(
    text_config=HYBRID_KINDS["qwen3_5_text"][2], vision_config=dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
        spatial_merge_size=2, temporal_patch_size=2))),
    # Kimi K2.5's folders: a DeepSeek-V3 text model (its routing groups, a dense first layer) beside a MoonViT tower
    "kimi_k25_multimodal": ("Kimi_K25ForConditionalGeneration", "Kimi_K25Config", dict(
        text_config=dict(MOE_KINDS["deepseek_v3"][2], model_type="deepseek_v3"), tie_word_embeddings=False,
        projection_hidden_size=32, vision_config=dict(
            patch_size=4, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2, num_attention_heads=2,
            num_hidden_layers=2, hidden_size=32, intermediate_size=64))),
    # Llama 4's folders: its text model (experts, chunks, NoPE layers) beside a vision encoder and its projector
    "llama4_multimodal": ("Llama4ForConditionalGeneration", "Llama4Config", dict(
        text_config=dict(LLAMA4_TEXT, num_local_experts=4, model_type="llama4_text"), vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
            patch_size=4, vision_output_dim=32, projector_input_dim=64, projector_output_dim=64))),
    # Mistral Small 4's folders: a Mistral 4 text model (latent attention, softmax groups) beside a Pixtral tower
    "mistral3_multimodal": ("Mistral3ForConditionalGeneration", "Mistral3Config", dict(
        text_config=dict(MISTRAL4_TEXT, model_type="mistral4"), tie_word_embeddings=False, spatial_merge_size=1,
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
            patch_size=4, head_dim=16))),
    # Mistral Small 3.x's folders: a Mistral text model (windows of 8) beside the same Pixtral tower
    "mistral3_small_multimodal": ("Mistral3ForConditionalGeneration", "Mistral3Config", dict(
        text_config=dict(KINDS["mistral"][2], model_type="mistral"), tie_word_embeddings=False, spatial_merge_size=1,
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
            patch_size=4, head_dim=16))),
    # Gemma 4 E2B/E4B's folders: the text model under model.language_model, a vision and an audio tower beside
    "gemma4_multimodal": ("Gemma4ForConditionalGeneration", "Gemma4Config", dict(
        text_config=GEMMA4_TEXT, vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                    num_attention_heads=2, patch_size=4),
        audio_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                          output_proj_dims=32))),
    # Gemma 3 4B-27B's folders: a SigLIP tower of 16 patches pooled to 4 image tokens
    "gemma3_multimodal": ("Gemma3ForConditionalGeneration", "Gemma3Config", dict(
        text_config=KINDS["gemma3_text"][2], mm_tokens_per_image=4, vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
            patch_size=4)))}
# mixtures of experts of 2025-26 only transformers 5 has, declared on what exists: GLM-4.7-Flash (DeepSeek-V3's layers,
# dense or with experts as mlp_layer_types says), Llama 4, Mistral 4 and Hunyuan-A13B
SPARSE_ATTENTION = dict(SHAPE, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32,
                        num_experts_per_tok=2, n_group=2, topk_group=1, index_topk=8, index_head_dim=16, index_n_heads=4)
DECLARED_MOE_KINDS = {"glm4_moe_lite": ("Glm4MoeLiteForCausalLM", "Glm4MoeLiteConfig", dict(
    SHAPE, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32, num_experts_per_tok=2, n_group=2,
    topk_group=1, mlp_layer_types=["dense", "sparse", "sparse", "dense"])),
    # Llama 4: chunks of 8 on its rotary layers 0 and 2 (interleaved pairs, llama3 scaling, L2 q/k norms), NoPE layers
    # 1 and 3 with their queries' temperature changing every 4 positions, experts (top-1, input-scaled) beside a
    # shared expert on layers 1 and 3, dense MLPs twice as wide on 0 and 2
    "llama4_text": ("Llama4ForCausalLM", "Llama4TextConfig", dict(LLAMA4_TEXT, num_local_experts=4)),
    # Mistral Small 4: latent attention with its queries scaled by position (every 8 positions here), softmax groups
    "mistral4": ("Mistral4ForCausalLM", "Mistral4Config", MISTRAL4_TEXT),
    # Hunyuan-A13B: Hunyuan's attention, softmax top-2 of 4 experts beside an ungated shared MLP
    "hunyuan_v1_moe": ("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config", dict(
        SHAPE, num_key_value_heads=2, head_dim=16, intermediate_size=32, num_experts=4, moe_topk=2,
        rope_parameters={"rope_type": "dynamic", "alpha": 50.0, "factor": 1.0, "rope_theta": 10000.0})),
    # DeepSeek-V3.2 and GLM-5: DeepSeek-V3's layers with sparse attention, each query's 8 best keys of the 24; GLM-5.2's
    # layers 1 and 2 reusing layer 0's selection (across the stage boundary under pp2)
    "deepseek_v32": ("DeepseekV32ForCausalLM", "DeepseekV32Config", dict(SPARSE_ATTENTION, first_k_dense_replace=1)),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", "GlmMoeDsaConfig", dict(SPARSE_ATTENTION, mlp_layer_types=[
        "dense", "sparse", "dense", "sparse"], indexer_types=["full", "shared", "shared", "full"])),
    # Gemma 4 26B-A4B: top-2 of 4 experts beside every layer's dense MLP (its scaled router, per-expert scales), on
    # E2B's layers (per-layer inputs, shared keys and values)
    "gemma4_text_moe": ("Gemma4ForCausalLM", "Gemma4TextConfig", dict(
        GEMMA4_TEXT, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)),
    # Hy3: per-head q/k norms, a dense first layer, sigmoid routing with a correction bias times a scale, a shared MLP
    "hy_v3": ("HYV3ForCausalLM", "HYV3Config", dict(
        SHAPE, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        initializer_range=0.02)),  # its default (0.006) leaves the logits near zero
    # MiniMax-M2: q/k norms over the whole projections, the rotary on half of each head, sigmoid routing with a bias
    "minimax_m2": ("MiniMaxM2ForCausalLM", "MiniMaxM2Config", dict(
        SHAPE, num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        rotary_dim=8))}
ROUTED_KINDS = {**MOE_KINDS, **HYBRID_MOE_KINDS, **DECLARED_MOE_KINDS}  # their router weights spread (ROUTER_SCALE)
STACKED_ON_DISK = ("gpt_oss",)  # kinds whose experts both versions store stacked (no per-expert layout)
FUSED = "_fused"  # suffix of a kind's folder re-saved by transformers 5 in its in-memory layout (fused experts)
RESAVED_FUSED = ("hy_v3",)  # kinds beside MOE_KINDS re-saved so (Hy3's in-memory names differ from its folders')
ROUTER_SCALE = 30.0  # router weights times this: scores spread, so test tokens sit far from top-k ties
SIGMOID_ROUTER_SCALE = 10.0  # sigmoid routers' (30 would saturate their scores at 0 and 1: ties again)
SIGMOID_ROUTED = ("deepseek_v3", "glm4_moe", "kimi_linear", "nemotron_h_moe", "glm4_moe_lite", "hy_v3")
BIAS_SCALE = 0.05  # correction biases drawn from U(0, this): they change which experts are chosen, and none is
# negative, where transformers 4.55 (groups left out filled with 0.0) and 5 (-inf) would route differently
SEEDS = {"qwen2_moe": 1, "deepseek_v3": 5, "gpt_oss": 6}  # kinds whose seed-0 weights route some token of the layout runs within 1e-4 of a tie

# the hub tokenizer a kind's folder ships (the others ship the repo's SentencePiece tokenizer.model)
KIND_TOKENIZERS = {"llama3": "llama3", "qwen2": "qwen2", "llama_tied": "smollm"}
# hub tokenizer folders: transformers' fast class -> what transformers saves for it
TOKENIZER_STYLES = {"llama3": "PreTrainedTokenizerFast",  # tokenizer.json alone, its template beginning a text (Llama 3)
                    "qwen2": "Qwen2TokenizerFast",  # vocab.json, merges.txt and tokenizer.json (Qwen2/3)
                    "smollm": "GPT2TokenizerFast",  # the same under tokenizer_class GPT2Tokenizer (SmolLM)
                    "gemma": "GemmaTokenizerFast"}  # add_bos_token: true in tokenizer_config.json (Gemma, LLaMA 2)
BEGINS = {"llama3": "<|begin_of_text|>", "gemma": "<bos>"}  # the token a style's folder begins every text with
# special tokens a style's class expects in the vocabulary (transformers 5's Gemma class fails without its <unk>)
STYLE_SPECIALS = {"gemma": ["<bos>", "<unk>", "<pad>"], "llama3": ["<|begin_of_text|>"]}


def hub_tokenizer(style: str, folder: Path, corpus: Path, vocab_size: int = 4096) -> Path:
    """A byte-level BPE trained on `corpus` with `tokenizers`, saved by transformers' fast tokenizer
    class of `style` as a hub folder holds it: Llama 3's template in tokenizer.json, Gemma's
    add_bos_token in tokenizer_config.json (its class writes the template too)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    begins = BEGINS.get(style)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(corpus)], trainers.BpeTrainer(vocab_size=vocab_size,
                                                        special_tokens=["<|endoftext|>", *STYLE_SPECIALS.get(style, [])],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    if style == "llama3":
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{begins} $A", pair=f"{begins} $A {begins} $B", special_tokens=[(begins, tokenizer.token_to_id(begins))])
    getattr(transformers, TOKENIZER_STYLES[style])(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                                   **({"bos_token": begins} if begins else {})).save_pretrained(folder)
    return Path(folder)


def encoded(texts: list[str], folder: Path) -> list[dict[str, list[int]]]:
    """Each text's ids as the folder's tokenizer gives them by default (`with`: its special tokens) and
    without special tokens."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    return [{"with": tokenizer(text).input_ids, "without": tokenizer(text, add_special_tokens=False).input_ids}
            for text in texts]


def make(kind: str, folder: Path, seed: int = 0) -> Path:
    """A KIND model with random weights, saved by transformers; vectors (norm scales, biases) moved
    off their initial ones and zeros, so a wrongly mapped one shows in the logits."""
    import torch
    import transformers

    model_class, config_class, fields = {**KINDS, **ROUTED_KINDS, **HYBRID_KINDS, **VARIANT_KINDS, **DECLARED_KINDS,
                                         **MULTIMODAL_KINDS}[kind]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
                if kind.startswith("gemma4") and name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.mul_(GEMMA4_QK_SCALE)
            elif name.endswith(("gate.weight", "router.weight", "router.proj.weight")) and kind in ROUTED_KINDS \
                    and not name.endswith("per_layer_input_gate.weight"):  # Gemma 4's per-layer inputs' gate: no router
                param.mul_(SIGMOID_ROUTER_SCALE if kind in SIGMOID_ROUTED else ROUTER_SCALE)
            elif name.endswith("e_score_correction_bias"):  # ERNIE 4.5's: a parameter [1, E] (moe_statics)
                param.copy_(BIAS_SCALE * torch.rand_like(param))
            elif name.endswith("experts.gate_up_proj") and kind == "gpt_oss":
                param.normal_(0.0, 0.5)  # wide enough for its SwiGLU clamps (at 7) to cut some values
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(BIAS_SCALE * torch.rand_like(buffer))
            elif name.endswith("layer_scalar"):  # Gemma 4's, stored: off one, so a layer without it shows
                buffer.copy_(0.5 + torch.rand_like(buffer))
    model.save_pretrained(folder, safe_serialization=True)
    return Path(folder)


def reference_model(folder: Path):
    """The folder's model as transformers builds it for text (a multimodal folder's own class, a text
    folder's causal LM), with eager attention (the reference: transformers 4.x's default SDPA drops
    Gemma 2's soft-cap), in eval mode."""
    import transformers

    architecture = json.loads((Path(folder) / "config.json").read_text()).get("architectures", [""])[0]
    # the folder's own class (transformers 5.23's auto classes leave Mistral4ForCausalLM out)
    model_class = getattr(transformers, architecture, transformers.AutoModelForCausalLM)
    return model_class.from_pretrained(str(folder), attn_implementation="eager").eval()


def loss(folder: Path, rows: np.ndarray) -> float:
    """transformers' mean next-token cross entropy of `rows` (inputs rows[:, :-1], labels rows[:, 1:])."""
    import torch

    model = reference_model(folder)
    with torch.no_grad():
        logits = model(torch.tensor(rows[:, :-1])).logits
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       torch.tensor(rows[:, 1:]).reshape(-1)))


def logits(folder: Path, ids: np.ndarray, position_ids: np.ndarray | None = None) -> np.ndarray:
    """transformers' logits of `ids`, at `position_ids` when given: then with a mask of ones, which keeps
    attention causal over the whole row (without one, transformers reads restarting position ids as
    packed documents and masks across them)."""
    import torch

    model = reference_model(folder)
    extra = {} if position_ids is None else {"position_ids": torch.tensor(position_ids),
                                             "attention_mask": torch.ones(ids.shape, dtype=torch.long)}
    with torch.no_grad():
        return model(torch.tensor(ids), **extra).logits.numpy()


def make_with_answers(root: Path, rows: np.ndarray, ids: np.ndarray, kinds: list[str]) -> dict[str, dict]:
    """Each KIND saved as `root`/KIND, with transformers' loss on `rows` and logits on `ids` (files
    beside it, so a transformers 5 subprocess can hand them over)."""
    import transformers

    answers = {}
    for kind in kinds:
        folder = make(kind, root / kind, SEEDS.get(kind, 0))
        if kind in (*MOE_KINDS, *RESAVED_FUSED) and int(transformers.__version__.split(".")[0]) >= 5:  # experts stacked
            transformers.AutoModelForCausalLM.from_pretrained(str(folder)).save_pretrained(
                root / f"{kind}{FUSED}", save_original_format=False)
        answers[kind] = {"loss": loss(folder, rows), "version": transformers.__version__}
        (root / f"{kind}.json").write_text(json.dumps(answers[kind]))
        np.save(root / f"{kind}.npy", logits(folder, ids))
    return answers


def dequantized(folder: Path, ids: np.ndarray, suffixes: tuple[str, ...]) -> None:
    """transformers' logits of an MXFP4 folder loaded dequantized (`Mxfp4Config(dequantize=True)`, fp32),
    and the tensors it dequantized (names ending in `suffixes`), saved beside the folder."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager").eval()
    with torch.no_grad():
        np.save(f"{folder}.npy", model(torch.tensor(ids)).logits.float().numpy())
    np.savez(f"{folder}.npz", **{name: param.detach().float().numpy() for name, param in model.named_parameters()
                                 if name.endswith(suffixes)})


def fp8_dequantized(folder: Path, block: list[int]) -> None:
    """Each FP8 weight of `folder` (with its `_scale_inv`) as transformers dequantizes it
    (`finegrained_fp8._dequantize_fp8_weight`, float32), saved beside the folder."""
    import torch
    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    tensors = load_file(str(folder / "model.safetensors"))
    np.savez(f"{folder}.npz", **{name: _dequantize_fp8_weight(weight, tensors[name + "_scale_inv"], block,
                                                               torch.float32).numpy()
                                 for name, weight in tensors.items() if name + "_scale_inv" in tensors})


def with_prediction_layers(folder: Path, depth: int, seed: int = 0) -> None:
    """`folder` (a transformers 5 DeepSeek-V3 or GLM-4.5 folder whose config counts no prediction layer)
    given `depth` multi-token prediction layers as released folders store them (DeepSeek-V3's layer 61:
    its decoder layer's tensors with experts one by one, `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`,
    and copies of the embedding and head), made by transformers 5.23's `MtpModel` (random, vectors and
    router moved off their initial values as `make` moves them); the layers `MtpModel.from_pretrained`
    reads back must be the ones written."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "num_nextn_predict_layers": depth}))
    torch.manual_seed(seed)
    made = MtpModel(transformers.AutoModelForCausalLM.from_pretrained(str(folder)), depth)
    with torch.no_grad():  # every value set here: MtpModel leaves its stacked experts uninitialized
        for name, param in made.named_parameters():
            if not name.startswith("layers."):
                continue  # the main model's embedding and head
            if param.dim() == 1:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, config.get("initializer_range", 0.02))
                if name.endswith("gate.weight"):
                    param.mul_(SIGMOID_ROUTER_SCALE)
        for name, buffer in made.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(BIAS_SCALE * torch.rand_like(buffer))
    main = load_file(str(folder / "model.safetensors"))
    released = {}
    for k in range(depth):  # each layer's copies of the embedding and head
        layer = f"model.layers.{config['num_hidden_layers'] + k}"
        released |= {f"{layer}.embed_tokens.weight": main["model.embed_tokens.weight"],
                     f"{layer}.shared_head.head.weight": main["lm_head.weight"]}
    for name, tensor in made.state_dict().items():
        if not name.startswith("layers."):
            continue
        _, k, key = name.split(".", 2)
        layer = f"model.layers.{config['num_hidden_layers'] + int(k)}"
        key = key.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        if key == "mlp.experts.gate_up_proj":  # [E, 2I, H], gate rows first
            for expert, fused in enumerate(tensor):
                gate, up = fused.chunk(2)
                released[f"{layer}.mlp.experts.{expert}.gate_proj.weight"] = gate
                released[f"{layer}.mlp.experts.{expert}.up_proj.weight"] = up
        elif key == "mlp.experts.down_proj":
            for expert, down in enumerate(tensor):
                released[f"{layer}.mlp.experts.{expert}.down_proj.weight"] = down
        else:
            released[f"{layer}.{key}"] = tensor
    save_file({**main, **{name: value.clone().contiguous() for name, value in released.items()}},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    read, wrote = _prediction_model(folder)[1].state_dict(), made.state_dict()
    assert read.keys() == wrote.keys() and all(torch.equal(read[k], wrote[k]) for k in read), "MtpModel read back"


def _prediction_model(folder: Path):
    """(transformers' model of `folder`, its `MtpModel` read from the folder), eager attention."""
    import transformers
    from transformers.modeling_layers import MtpModel

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
    # transformers finds the prediction layers by the main model's ignored keys, written for 61 layers
    first, depth = model.config.num_hidden_layers, model.config.num_nextn_predict_layers
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{layer}\..*" for layer in range(first, first + depth)]
    return model, MtpModel.from_pretrained(model).eval()


def prediction_answers(folder: Path, rows: np.ndarray, ids: np.ndarray) -> None:
    """transformers 5.23's answers on a folder with multi-token prediction layers, saved beside it
    (`<folder>.mtp.npz`): the next-token logits on `ids` and each prediction layer's, [depth, ...]
    (`MtpModel.forward_layer` as its drafting loop chains them: depth k on the previous depth's output,
    or the main model's final hidden states, and the tokens k further, at positions k further; the
    last k positions embed token 0: the sample has none beyond), and on `rows` the next-token loss
    and each depth's (the tokens k + 1 further)."""
    import torch

    model, mtp = _prediction_model(folder)

    def answers(tokens: np.ndarray):
        inputs = torch.tensor(tokens)
        out = model(inputs, output_hidden_states=True)
        hidden, predicted = out.hidden_states[-1], []
        for k in range(1, len(mtp.layers) + 1):
            ahead = torch.cat([inputs[:, k:], torch.zeros_like(inputs[:, :k])], dim=1)
            positions = torch.arange(k, inputs.shape[1] + k).expand(inputs.shape)
            hidden = mtp.forward_layer(k - 1, hidden, positions, None, input_ids=ahead)
            predicted.append(mtp._project_to_logits(hidden))
        return out.logits, predicted

    def mean_loss(logits, targets):
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))

    with torch.no_grad():
        logits, predicted = answers(ids)
        row_logits, row_predicted = answers(rows[:, :-1])
        labels = torch.tensor(rows)
        mtp_losses = [mean_loss(each[:, :-k], labels[:, k + 1:]) for k, each in enumerate(row_predicted, start=1)]
    np.savez(f"{folder}.mtp.npz", logits=logits.numpy(), predicted=torch.stack(predicted).numpy(),
             loss=mean_loss(row_logits, labels[:, 1:]), mtp_losses=np.array(mtp_losses))


def transformers5_loss(folder: Path, rows: np.ndarray) -> float:
    """`loss` under transformers 5 (a subprocess), for the folders only it reads."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        np.save(Path(scratch) / "rows.npy", rows)
        transformers5("loss", Path(scratch) / "rows.npy", Path(scratch) / "loss.json", folder)
        return json.loads((Path(scratch) / "loss.json").read_text())["loss"]


def transformers5(*args) -> None:
    """Run one of this file's commands under transformers 5 (see the module doc), in the session's one
    transformers 5 process: importing torch and transformers 5 costs 8-10 s here, paid once."""
    _transformers5_server().run([str(arg) for arg in args])


class _Server:
    """This file running `serve` under transformers 5: a command a line on its stdin, a JSON reply a
    line on its stdout; what the commands print goes to a log whose tail a failure reports."""

    TIMEOUT = 600.0

    def __init__(self):
        if not (TRANSFORMERS5 / "transformers").is_dir():
            raise FileNotFoundError(f"transformers 5 is not installed in {TRANSFORMERS5}: run the README's setup "
                                    "command")
        self.log = tempfile.NamedTemporaryFile(prefix="transformers5_", suffix=".log", delete=False)
        self.process = subprocess.Popen([sys.executable, __file__, "serve"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True,
                                        env={**os.environ, "PYTHONPATH": str(TRANSFORMERS5)})
        atexit.register(self.close)

    def run(self, argv: list[str]) -> None:
        self.process.stdin.write(json.dumps(argv) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], self.TIMEOUT)
        reply = self.process.stdout.readline() if ready else ""
        if not reply:
            self.process.kill()
            _transformers5_server.cache_clear()
            raise RuntimeError(f"transformers 5 gave no answer to {argv}:\n{self._log_tail()}")
        error = json.loads(reply)["error"]
        if error:
            raise RuntimeError(f"transformers 5 failed on {argv}:\n{error}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process.stdout.close()
        self.log.close()
        os.unlink(self.log.name)

    def _log_tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]


@functools.cache
def _transformers5_server() -> _Server:
    return _Server()


def serve() -> None:
    """(transformers 5) Run each JSON command line of stdin as `command` would, replying on stdout."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what a command or a library prints, from Python or C, goes to the log, never to the replies
    for line in sys.stdin:
        try:
            command(json.loads(line))
            error = None
        except Exception:  # reported to the test that sent it; the next command still runs
            error = traceback.format_exc()
        replies.write(json.dumps({"error": error}) + "\n")
        replies.flush()


# rule -> (transformers 5 model module, its chunked function, its token-by-token function)
RECURRENT_RULES = {"gated_delta": ("qwen3_5", "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
                   "kimi_delta": ("kimi_linear", "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")}
RULE_INPUTS = ("q", "k", "v", "g", "beta")


def recurrent_rule_answers(rule: str, inputs: Path, answers: Path) -> None:
    """(transformers 5) Its chunked and token-by-token functions of `rule` on INPUTS.npz (q, k, v, g,
    beta as its functions take them, `chunk`, and output weights `w`): each one's output, final state
    and the gradients of (output * w).sum() by every input, into ANSWERS.npz as `<form>_<name>`."""
    import importlib

    import torch

    module, chunked, token_by_token = RECURRENT_RULES[rule]
    functions = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    given = dict(np.load(inputs))
    out = {}
    for form, name in (("chunked", chunked), ("token", token_by_token)):
        tensors = {key: torch.tensor(given[key], requires_grad=True) for key in RULE_INPUTS}
        extra = {"chunk_size": int(given["chunk"])} if form == "chunked" else {}
        output, state = getattr(functions, name)(*(tensors[key] for key in RULE_INPUTS), initial_state=None,
                                                 output_final_state=True, **extra)
        (output * torch.tensor(given["w"])).sum().backward()
        out |= {f"{form}_output": output.detach().numpy(), f"{form}_state": state.detach().numpy()}
        out |= {f"{form}_d{key}": tensors[key].grad.numpy() for key in RULE_INPUTS}
    np.savez(answers, **out)


def greedy(ids: np.ndarray, count: int, folder: Path) -> np.ndarray:
    """transformers' own greedy `generate` of `count` tokens after each row of `ids`, with its cache."""
    import torch

    with torch.no_grad():
        out = reference_model(folder).generate(torch.tensor(ids), max_new_tokens=count, do_sample=False,
                                               eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:].numpy()


SSD_INPUTS = ("x", "dt", "A", "B", "C")


def ssd_answers(inputs: Path, answers: Path) -> None:
    """(transformers 5) Nemotron-H's Mamba-2 scan (`mamba2_chunk_scan`, torch's reference form) on
    INPUTS.npz (x [B, T, H, P], dt [B, T, H] after its softplus, A [H], B and C [B, T, G, N], `chunk`,
    output weights `w`): its output, final state [B, H, P, N] and the gradients of (output * w).sum()
    by each input, into ANSWERS.npz."""
    import torch
    from transformers.models.nemotron_h import modeling_nemotron_h

    given = dict(np.load(inputs))
    tensors = {key: torch.tensor(given[key], requires_grad=True) for key in SSD_INPUTS}
    output, state = modeling_nemotron_h.mamba2_chunk_scan(*(tensors[key] for key in SSD_INPUTS),
                                                          chunk_size=int(given["chunk"]), return_final_states=True)
    (output * torch.tensor(given["w"])).sum().backward()
    np.savez(answers, output=output.detach().numpy(), state=state.detach().numpy(),
             **{f"d{key}": tensors[key].grad.numpy() for key in SSD_INPUTS})


def command(argv: list[str]) -> None:
    """One command of the module doc."""
    name, *rest = argv
    if name == "make":
        root, rows, ids, *kinds = rest
        make_with_answers(Path(root), np.load(rows), np.load(ids), kinds)
    elif name == "with_prediction_layers":
        folder, depth, rows, ids = rest
        with_prediction_layers(Path(folder), int(depth))
        prediction_answers(Path(folder), np.load(rows), np.load(ids))
    elif name == "prediction_answers":
        rows, ids, *folders = rest
        for folder in folders:
            prediction_answers(Path(folder), np.load(rows), np.load(ids))
    elif name == "loss":
        rows, answer, folder = rest
        Path(answer).write_text(json.dumps({"loss": loss(Path(folder), np.load(rows))}))
    elif name == "greedy":
        ids, count, *folders = rest
        for folder in folders:
            np.save(f"{folder}.greedy.npy", greedy(np.load(ids), int(count), Path(folder)))
    elif name == "encoded":
        texts, *folders = rest
        for folder in folders:
            Path(f"{folder}.encoded.json").write_text(json.dumps(encoded(json.loads(Path(texts).read_text()),
                                                                         Path(folder))))
    elif name == "ssd":
        inputs, answers = rest
        ssd_answers(Path(inputs), Path(answers))
    elif name == "recurrent_rule":
        rule, inputs, answers = rest
        recurrent_rule_answers(rule, Path(inputs), Path(answers))
    elif name == "fp8_dequantized":
        folder, *block = rest
        fp8_dequantized(Path(folder), [int(size) for size in block])
    elif name == "dequantized":
        ids, folder, *suffixes = rest
        dequantized(Path(folder), np.load(ids), tuple(suffixes))
    else:
        ids, *folders = rest
        for folder in folders:
            np.save(f"{folder}.npy", logits(Path(folder), np.load(ids)))


if __name__ == "__main__":
    serve() if sys.argv[1:] == ["serve"] else command(sys.argv[1:])
