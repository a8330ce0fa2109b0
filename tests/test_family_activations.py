"""The planner's activation model holds for the families whose layers differ (one process, fp32): what
each decoder layer keeps for backward, measured by sublayer (saved-tensor hooks), equals its
declaration's `saved_bytes` under the dense and the blockwise core, for a sliding and a full layer
of each (Gemma 2's soft-capped dense core keeps its tanh; Qwen3.5's Gated DeltaNet and gated attention; OLMo-2's post-norms and projection-wide
q/k norms; Phi-3's partial rotary; MPT's ALiBi, bias-free LayerNorms and q/k/v clipping; Granite's
residual multiplier; SmolLM3's NoPE layers; ERNIE 4.5's interleaved rotary and biases; DeepSeek's
latent attention with and without a q latent); what a layer's
training forward leaves allocated under each recompute granularity equals the model's `kept`; and
the planner's per-stage total is the sum of its layers' own models. tp and SP do not change what a
part keeps per head or position (tests/test_sequence_parallel.py measures them on real ranks)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from modeling.attention_core import CORES
from modeling.documents import document_positions, state
from modeling.execution import Execution, Recompute
from modeling.registry import config_from_dict, family
from paddle_pp.planning.memory import decoder_activation_bytes
from paddle_pp.runtime.layout import Layout
from paddle_pp.training.activations import held_bytes, rotary_constants, saved_activation_bytes
from paddle_pp.training.run_plan import plan_for

BATCH, SEQ = 2, 64
BASE = dict(vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=SEQ)
FAMILIES = {  # model_type -> our config fields (layer 0 sliding where the family slides)
    "gemma2": dict(BASE, head_dim=16, sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3_text": dict(BASE, head_dim=16, sliding_window=8, sliding_window_pattern=2),
    "olmo2": dict(BASE),
    "olmo3": dict(BASE, sliding_window=8),
    "seed_oss": dict(BASE, head_dim=24),
    "hunyuan_v1_dense": dict(BASE),
    "phi3": dict(BASE, partial_rotary_factor=0.5, sliding_window=8),
    "mpt": dict(vocab_size=512, hidden_size=96, num_hidden_layers=2, num_attention_heads=6,
                max_position_embeddings=SEQ, attn_config={"clip_qkv": 0.5}),
    "granite": dict(BASE, residual_multiplier=0.2, embedding_multiplier=3.0),
    "smollm3": dict(BASE, no_rope_layer_interval=2),
    "ernie4_5": dict(BASE, head_dim=16, use_bias=True),
    # latent attention only (every layer dense): its q and kv latents, their norms, 24-wide q/k heads, 16-wide v
    "deepseek_v3": dict(BASE, num_key_value_heads=6, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=2, num_experts=4, n_group=1,
                        topk_group=1, num_experts_per_tok=2),
    # Gated DeltaNet (layer 0: fewer key heads than value heads, d_k 16, d_v 8) and gated attention (layer 1)
    "qwen3_5_text": dict(BASE, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"]),
    # its Gated DeltaNet with the write strength doubled (layer 0), OLMo-2's post-norm attention (layer 1)
    "olmo_hybrid": dict(BASE, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"]),
    # Kimi Delta Attention (layer 0: a decay per key channel through a rank-8 projection, the sigmoid-gated norm)
    # and latent attention without rotary (layer 1), dense MLPs
    "kimi_linear": dict(BASE, num_key_value_heads=6, q_lora_rank=None, kv_lora_rank=20, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=2, num_experts=4,
                        num_experts_per_tok=2, linear_attn_config={"kda_layers": [1], "full_attn_layers": [2],
                                                                    "num_heads": 6, "head_dim": 8}),
    # Mamba-2 (layer 0: 3 groups of 2 heads, a conv bias) and attention without rotary (layer 1), each alone
    "nemotron_h": dict(BASE, head_dim=16, mamba_num_heads=6, mamba_head_dim=8, ssm_state_size=8, n_groups=3,
                       layers_block_type=["linear_attention", "full_attention"]),
    # attention and Mamba-2 side by side (its norm before the gate, muP multipliers), the MLP's multipliers
    "falcon_h1": dict(BASE, head_dim=16, mamba_d_ssm=48, mamba_n_heads=6, mamba_d_state=8, mamba_n_groups=3,
                      mamba_rms_norm=True, key_multiplier=0.5, attention_in_multiplier=1.5, ssm_in_multiplier=1.25,
                      ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 0.8], mlp_multipliers=[1.5, 0.5]),
    "deepseek_v2": dict(BASE, num_key_value_heads=6, q_lora_rank=None, kv_lora_rank=20, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=2, num_experts=4, n_group=1,
                        topk_group=1, num_experts_per_tok=2),
    # sparse attention (every layer dense): the indexer's 3 heads pick 16 of 64 keys, latent attention absorbed
    "deepseek_v32": dict(BASE, num_key_value_heads=6, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=2, num_experts=4, n_group=1,
                         topk_group=1, num_experts_per_tok=2, index_topk=16, index_head_dim=16, index_n_heads=3),
    # GLM-5.2's: layer 0 runs its indexer (16 of 64 keys) and hands its selection on, layer 1 attends to it
    "glm_moe_dsa": dict(BASE, num_key_value_heads=6, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, mlp_layer_types=["dense", "dense"], num_experts=4, n_group=1,
                        topk_group=1, num_experts_per_tok=2, index_topk=16, index_head_dim=16, index_n_heads=3,
                        indexer_types=["full", "shared"]),
    # the learned xIELU activation of an ungated MLP
    "apertus": dict(BASE),
    # Gemma 4: per-layer inputs; layer 0 (full: 32-wide heads, one key/value head, the proportional rotary) stores
    # its keys and values, layer 1 (full too: the last layer is) reuses them with an MLP twice as wide
    "gemma4_text": dict(BASE, head_dim=16, num_key_value_heads=1, global_head_dim=32, sliding_window=8,
                        layer_types=["full_attention", "full_attention"], hidden_size_per_layer_input=8,
                        vocab_size_per_layer_input=512, num_kv_shared_layers=1, use_double_wide_mlp=True),
    # Gemma 4 31B's full layers: keys as values (two heads of 32), the proportional rotary; no per-layer inputs
    "gemma4_text_31b": dict(BASE, model_type="gemma4_text", head_dim=16, global_head_dim=32,
                            num_global_key_value_heads=2, attention_k_eq_v=True, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0),
}


def _carried(layer, config) -> tuple[paddle.Tensor, ...]:
    """What travels into a Gemma 4 layer (`blocks/carried.py`): its per-layer inputs, the keys and values it
    reuses (in the sharing layer type's geometry), each requiring its gradient; into a GLM-5.2 shared layer
    the selection it reuses (each query's nearest earlier keys, as `handed_on` spells them)."""
    shapes = []
    for name in getattr(layer.declared, "carried_in", ()):
        if name == "selection":
            positions = np.arange(SEQ)[:, None] - np.arange(config.index_topk)[None, :]
            return (paddle.to_tensor(np.broadcast_to(np.where(positions >= 0, positions, -1), (BATCH,) + positions.shape)
                                     .astype(np.float32)),)
        if name.startswith("per_layer_input"):
            shapes.append([BATCH, SEQ, config.hidden_size_per_layer_input])
        else:
            full = name.startswith("full")
            heads = config.num_global_key_value_heads if full and config.attention_k_eq_v else config.num_key_value_heads
            shapes.append([BATCH, SEQ, heads, config.global_head_dim if full else config.head_dim])
    carried = tuple(paddle.randn(shape) for shape in shapes)
    for tensor in carried:
        tensor.stop_gradient = False
    return carried


def _layers(model):
    return next(layers for name, layers in model.named_sublayers() if name.endswith(".layers"))


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("core", ["dense", "blockwise"])
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_each_layers_saved_bytes_equal_its_declarations_model(model_type, core, documents):
    """Per document too: each layer's rotary rows gathered by document position, the dense core's
    mask per batch row."""
    config = config_from_dict({"model_type": model_type, **FAMILIES[model_type]})
    model_type = config.model_type
    run = Execution(attention=CORES[core], documents=(0,) if documents else None)
    layers = _layers(family(model_type).causal_lm(config, run))
    layers.train()
    ids = paddle.to_tensor(np.random.default_rng(5).integers(0, 8, size=(BATCH, SEQ)))
    positions = document_positions(ids, (0,)) if documents else None
    for index, layer in enumerate(layers):
        hidden = paddle.randn([BATCH, SEQ, config.hidden_size])
        hidden.stop_gradient = False
        carried = _carried(layer, config)
        measured = saved_activation_bytes(layer, lambda: layer(state(hidden, positions, carried)),
                                          rotary_constants(layer, SEQ))
        assert measured == family(model_type).layer_saved_bytes(config, run, BATCH, SEQ, index=index), index
    workload = plan_for(config, Layout(world_size=1), "--per_device_train_batch_size", str(BATCH), "--max_seq_length",
                        str(SEQ), "--attention_core", core, f"--use_global_causal_attn={not documents}").workload()
    assert decoder_activation_bytes(config, Layout(world_size=1), workload, 0) == sum(
        family(model_type).layer_activations(config, run, BATCH, SEQ, index=i).kept for i in range(2))


@pytest.mark.parametrize("core", ["dense", "blockwise"])
def test_a_prediction_layers_saved_bytes_equal_its_declarations_model(core):
    """A multi-token prediction layer (its decoder layer dense here: an MoE's own model assumes
    balanced routing) keeps what its declaration says: the decoder layer's, its two input norms',
    the projection's input and the shared head's norm."""
    fields = dict(FAMILIES["deepseek_v3"], first_k_dense_replace=3, num_nextn_predict_layers=1)
    config = config_from_dict(dict(model_type="deepseek_v3", **fields))
    run = Execution(attention=CORES[core])
    layer = _layers(family("deepseek_v3").causal_lm(config, run))[config.num_hidden_layers]
    layer.train()
    hidden, embeddings = (paddle.randn([BATCH, SEQ, config.hidden_size]) for _ in range(2))
    hidden.stop_gradient = embeddings.stop_gradient = False
    measured = saved_activation_bytes(layer, lambda: layer(state(hidden, None, (embeddings,))),
                                      rotary_constants(layer, SEQ))
    declared = config.prediction_layer(1).saved_bytes(run, BATCH, SEQ, 4)
    assert measured == {name: size for name, size in declared.items() if size}
    assert {"enorm", "hnorm", "eh_proj", "shared_head.norm"} <= set(measured)


@pytest.mark.parametrize("model_type", ["gemma2", "olmo2", "mpt", "qwen3_5_text"])
def test_what_each_recompute_granularity_keeps_equals_the_model(model_type):
    """Paddle's CPU allocator: a layer's training forward leaves allocated, beyond its input, the
    model's `kept` under full, full_attn and core_attn recompute, for the sandwich (Gemma 2), post
    (OLMo-2) and LayerNorm (MPT) layers and a Gated DeltaNet layer (Qwen3.5's linear layer)."""
    config = config_from_dict(dict(model_type=model_type, **FAMILIES[model_type]))
    layer_input = BATCH * SEQ * config.hidden_size * 4
    for core in ("dense", "blockwise"):
        for granularity in (None, "full", "full_attn", "core_attn"):
            run = Execution(attention=CORES[core], recompute=Recompute(granularity))
            layer = _layers(family(model_type).causal_lm(config, run))[0]
            layer.train()
            hidden = paddle.randn([BATCH, SEQ, config.hidden_size])
            hidden.stop_gradient = False
            layer(hidden)  # the constants first used here (rotary tables, masks)
            kept = family(model_type).layer_activations(config, run, BATCH, SEQ, index=0).kept
            assert held_bytes(lambda: layer(hidden)) == kept - layer_input, (core, granularity)
