"""Each family's TP plan is the truth about its model: one process builds the single-card model and
compares every parameter with the table, at every tp the config allows; a table that disagrees is
named. (Every multi-process job runs the same check on each rank's TP and pipeline model as it
builds it, `ModelFamily.check_built`, so the tp2/pp/vpp layout tests cover the split forms.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import paddle
import pytest

from modeling.family import PlanMismatchError
from modeling.placement import COLUMN, ROW, TPPlanError, local_shape
from modeling.registry import FAMILIES, UnknownModelError, config_from_dict

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             max_position_embeddings=16)
CONFIGS = {  # each family with what sets it apart: GQA, tied embeddings, biases, q/k norms, head_dim
    "llama": dict(SHAPE, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    "mistral": dict(SHAPE, num_key_value_heads=2, sliding_window=None),
    "qwen2": dict(SHAPE, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(SHAPE, num_key_value_heads=2, head_dim=12),
    "gemma": dict(SHAPE, num_key_value_heads=2, head_dim=12),
    "gpt": dict(SHAPE),
    "qwen3_moe": dict(SHAPE, num_key_value_heads=2, head_dim=12, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, decoder_sparse_step=2),
    "qwen2_moe": dict(SHAPE, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, mlp_only_layers=[1]),
    "mixtral": dict(SHAPE, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2),
    "olmoe": dict(SHAPE, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2),
    "gemma2": dict(SHAPE, num_key_value_heads=2, head_dim=12, sliding_window=8),
    "gemma3_text": dict(SHAPE, num_key_value_heads=2, head_dim=12, sliding_window=8, sliding_window_pattern=2),
    "phi3": dict(SHAPE, num_key_value_heads=2, partial_rotary_factor=0.5),
    "olmo2": dict(SHAPE, num_key_value_heads=2),
    "olmo3": dict(SHAPE, num_key_value_heads=2, sliding_window=4),
    "seed_oss": dict(SHAPE, num_key_value_heads=2, head_dim=12),
    "hunyuan_v1_dense": dict(SHAPE, num_key_value_heads=2, attention_bias=True),
    "hunyuan_v1_moe": dict(SHAPE, num_key_value_heads=2, num_experts=4, moe_topk=2),
    "smollm3": dict(SHAPE, num_key_value_heads=2, no_rope_layer_interval=2, tie_word_embeddings=True),
    "granite": dict(SHAPE, num_key_value_heads=2, attention_bias=True, residual_multiplier=0.2),
    "ernie4_5": dict(SHAPE, num_key_value_heads=2, use_bias=True),
    "deepseek_v3": dict(SHAPE, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, num_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
                        moe_intermediate_size=16, first_k_dense_replace=1),
    "deepseek_v2": dict(SHAPE, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        first_k_dense_replace=1),
    "llama4_text": dict(SHAPE, num_key_value_heads=2, intermediate_size=16, intermediate_size_mlp=64, num_experts=4,
                        num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=4),
    "mistral4": dict(SHAPE, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                     qk_rope_head_dim=4, v_head_dim=8, num_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
                     moe_intermediate_size=16, first_k_dense_replace=1, llama_4_scaling_beta=0.1),
    "glm4_moe_lite": dict(SHAPE, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                          qk_rope_head_dim=4, v_head_dim=8, num_experts=4, n_group=2, topk_group=1,
                          num_experts_per_tok=2, moe_intermediate_size=16, mlp_layer_types=["dense", "sparse"] * 2),
    "deepseek_v32": dict(SHAPE, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                         qk_rope_head_dim=4, v_head_dim=8, num_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
                         moe_intermediate_size=16, first_k_dense_replace=1, index_topk=4, index_head_dim=8,
                         index_n_heads=2),
    "glm_moe_dsa": dict(SHAPE, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        mlp_layer_types=["dense", "sparse"] * 2, index_topk=4, index_head_dim=8, index_n_heads=2,
                        index_topk_pattern="FSSF"),  # GLM-5.2's: layers 1 and 2 without an indexer
    "minimax_m2": dict(SHAPE, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, rotary_dim=4),
    "apertus": dict(SHAPE, num_key_value_heads=2),
    "hy_v3": dict(SHAPE, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    # Gemma 4: per-layer embeddings, full layers 16 wide with keys as values (one head), the last two layers reusing
    # the first two's keys and values, a buffer per layer, experts beside each dense MLP
    "gemma4_text": dict(SHAPE, num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
                        attention_k_eq_v=True, layer_types=["sliding_attention", "full_attention"] * 2,
                        hidden_size_per_layer_input=4, vocab_size_per_layer_input=64, num_kv_shared_layers=2,
                        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16),
    "glm4_moe": dict(SHAPE, num_key_value_heads=2, head_dim=8, num_experts=4, n_group=1, topk_group=1,
                     num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1, use_qk_norm=True,
                     attention_bias=True),
    "gpt_oss": dict(SHAPE, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, sliding_window=4),
    "ernie4_5_moe": dict(SHAPE, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, moe_num_shared_experts=1, moe_layer_start_index=1),
    "mpt": dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                max_position_embeddings=16, attn_config={"clip_qkv": 0.5}),
}
NEMOTRON_LAYERS = ["linear_attention", "full_attention", "mlp", "moe"]
# Gated DeltaNet beside gated attention (fewer key heads than value heads), dense and with experts
HYBRID = dict(SHAPE, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=8,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
CONFIGS |= {"qwen3_5_text": HYBRID,
            "qwen3_5_moe_text": dict(HYBRID, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                     shared_expert_intermediate_size=24),
            "qwen3_next": dict(HYBRID, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                               shared_expert_intermediate_size=24, mlp_only_layers=[1]),
            "olmo_hybrid": {key: value for key, value in HYBRID.items() if key != "head_dim"},
            "kimi_linear": dict(SHAPE, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8,
                                qk_rope_head_dim=4, v_head_dim=8, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=16, linear_attn_config={"kda_layers": [1, 3],
                                                                               "full_attn_layers": [2, 4],
                                                                               "num_heads": 4, "head_dim": 8}),
            # Mamba-2 (2 groups of 2 heads), attention without rotary, a ReLU^2 MLP, latent experts
            "nemotron_h": dict(SHAPE, num_key_value_heads=2, head_dim=8, layers_block_type=NEMOTRON_LAYERS,
                               mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
                               moe_latent_size=16),
            # Mamba-2 beside attention, GraniteMoE's experts beside a shared MLP (a fused gate | up on disk)
            "granitemoehybrid": dict(SHAPE, num_key_value_heads=2, layer_types=["mamba", "attention"] * 2,
                                     mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=2, num_experts=4,
                                     num_experts_per_tok=2, shared_intermediate_size=24),
            # attention and Mamba-2 side by side in every layer
            "falcon_h1": dict(SHAPE, num_key_value_heads=2, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_state=8,
                              mamba_n_groups=2, mamba_rms_norm=True)}


@pytest.fixture(params=sorted(FAMILIES))
def built(request):
    config = config_from_dict({"model_type": request.param, **CONFIGS[request.param]})
    paddle.seed(0)
    return FAMILIES[request.param], config, FAMILIES[request.param].causal_lm(config)


def test_single_card_state_dict_is_the_plan(built):
    family, config, model = built
    plan = family.tensor_plan(config)
    assert {name: tuple(p.shape) for name, p in model.state_dict().items()} == {n: r.shape for n, r in plan.items()}
    family.check_built(model, config, model.run, pp=1, stage=0)


def test_every_split_divides_and_reassembles_at_every_allowed_tp(built):
    family, config, _ = built
    allowed = []
    for tp in (1, 2, 4, 8):
        try:
            family.check_tensor_parallel(config, tp)
        except TPPlanError:
            continue
        allowed.append(tp)
        for name, row in family.tensor_plan(config).items():
            local, axis = local_shape(row.shape, row.placement.tp, tp), row.placement.tp
            if axis is None:
                assert local == row.shape, name
            else:
                assert local[axis] * tp == row.shape[axis], (name, tp)
    assert allowed[:2] == [1, 2]


def test_linears_split_by_column_or_row_and_every_layer_sits_on_one_stage(built):
    family, config, _ = built
    plan = family.tensor_plan(config)
    routers = {name for name in plan
               if name.endswith((".gate.weight", ".shared_expert_gate.weight", ".router.weight", ".router.bias",
                                   ".router.proj.weight"))}
    assert all(plan[name].placement.tp is None for name in routers), "every tp rank routes the same tokens"
    latents = {name for name in plan if name.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight",
                                                       "f_a_proj.weight", "g_a_proj.weight",  # Kimi Delta's low ranks
                                                       "fc1_latent_proj.weight", "fc2_latent_proj.weight"))}  # latent MoE
    assert all(plan[name].placement.tp is None for name in latents), "every head reads the whole latent"
    indexers = {name for name in plan if ".indexer." in name}  # sparse attention's: every rank selects the same keys
    assert all(plan[name].placement.tp is None and plan[name].tp_partial_grad is None for name in indexers)
    per_layer = {name for name in plan if name.endswith(("per_layer_input_gate.weight", "per_layer_projection.weight",
                                                         "per_layer_model_projection.weight"))}
    assert all(plan[name].placement.tp is None for name in per_layer), "Gemma 4's per-layer inputs: whole, token-local"
    assert all(row.placement.tp in (COLUMN, ROW) for name, row in plan.items()
               if row.linear and len(row.shape) == 2 and name not in routers | latents | indexers | per_layer)
    for pp, vpp in ((2, 1), (2, 2), (4, 1)):
        stages = {name: plan.stages(name, pp, vpp) for name in plan}
        assert all(len(held) == 1 for name, held in stages.items() if isinstance(plan[name].placement.stage, int))
        assert {s for held in stages.values() for s in held} == set(range(pp)), (pp, vpp)


def test_a_plan_that_disagrees_with_the_model_is_named(built, monkeypatch):
    family, config, model = built
    plan = family.tensor_plan(config)
    name = next(n for n, row in plan.items() if row.placement.tp == COLUMN)
    doubled = (2 * plan[name].shape[0], *plan[name].shape[1:])
    for tensors, message in (({**plan, name: dataclasses.replace(plan[name], shape=doubled)}, name),
                             ({n: r for n, r in plan.items() if n != name}, f"{name}: held but not planned")):
        monkeypatch.setattr(type(family), "tensor_plan", lambda self, _, t=tensors: dataclasses.replace(plan, tensors=t))
        with pytest.raises(PlanMismatchError, match=message):
            family.check_built(model, config, model.run, pp=1, stage=0)


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
def test_an_expert_parallel_rank_builds_only_its_experts_under_their_global_names(kind):
    """Expert rank 1 of ep2 holds experts 2 and 3 (named as on one card) and everything dense;
    `check_built` holds it to exactly that, and the planner counts the parameters it built."""
    from modeling.execution import Execution
    from paddle_pp.planning.memory import plan_layout
    from paddle_pp.runtime.experts import ExpertGroup
    from paddle_pp.runtime.layout import Layout

    family, config = FAMILIES[kind], config_from_dict({"model_type": kind, **CONFIGS[kind]})
    run = Execution(experts=ExpertGroup(2, 1, None, None, 2, "cpu"))
    model = family.causal_lm(config, run)
    family.check_built(model, config, run, pp=1, stage=0)
    plan, held = family.tensor_plan(config), set(model.state_dict())
    experts = {name for name, row in plan.items() if row.placement.expert is not None}
    assert held == set(plan) - {name for name in experts if plan[name].placement.expert < 2}
    assert {name.split(".experts.")[1].split(".")[0] for name in held & experts} == {"2", "3"}
    assert all(getattr(p, "no_sync", False) == (name in experts) for name, p in model.state_dict().items())
    whole, halved = (plan_layout(config, Layout(world_size=2, expert_parallel_degree=ep))[0].parameters
                     for ep in (1, 2))
    assert halved == sum(int(np.prod(p.shape)) for p in model.parameters())
    assert whole - halved == sum(int(np.prod(plan[name].shape)) for name in experts) // 2
    with pytest.raises(PlanMismatchError, match="experts.2.*held but not planned"):
        family.check_built(model, config, Execution(experts=ExpertGroup(2, 0, None, None, 2, "cpu")), pp=1, stage=0)


def test_expert_parallelism_is_refused_for_indivisible_experts_and_dense_models():
    from modeling.registry import LayoutModelError, validate_layout
    from paddle_pp.runtime.layout import Layout

    moe = config_from_dict({"model_type": "mixtral", **CONFIGS["mixtral"]})
    with pytest.raises(LayoutModelError, match="4 experts per layer, which do not split over --expert_parallel_degree 8"):
        validate_layout(moe, Layout(world_size=8, expert_parallel_degree=8))
    dense = config_from_dict({"model_type": "llama", **CONFIGS["llama"]})
    with pytest.raises(LayoutModelError, match="--expert_parallel_degree 2 with LlamaForCausalLM, which has no experts"):
        validate_layout(dense, Layout(world_size=2, expert_parallel_degree=2))


def test_unknown_family_and_indivisible_tp_are_user_errors():
    with pytest.raises(UnknownModelError, match="'bert' is not one of"):
        config_from_dict({"model_type": "bert"})
    config = config_from_dict({"model_type": "llama", **CONFIGS["llama"]})
    with pytest.raises(TPPlanError, match="num_attention_heads=4 is not divisible by --tensor_parallel_degree 8"):
        FAMILIES["llama"].check_tensor_parallel(config, 8)
    three = config_from_dict({"model_type": "llama", **CONFIGS["llama"], "num_attention_heads": 6,
                              "num_key_value_heads": 3})
    with pytest.raises(TPPlanError, match="num_key_value_heads=3 neither divides by nor divides --tensor_parallel_degree 2"):
        FAMILIES["llama"].check_tensor_parallel(three, 2)
    olmo2 = config_from_dict({"model_type": "olmo2", **CONFIGS["olmo2"]})
    with pytest.raises(TPPlanError, match="num_key_value_heads=2 is not divisible by --tensor_parallel_degree 4"):
        FAMILIES["olmo2"].check_tensor_parallel(olmo2, 4)  # its k norm spans the whole projection


def test_fewer_kv_heads_than_tp_ranks_leave_the_kv_projections_whole_on_every_rank():
    """2 kv heads over 4 tp ranks: the key/value projections (weights and biases) are held whole, their
    declared axis kept for the index; over 2 ranks they split as before; nothing else changes."""
    config = config_from_dict({"model_type": "llama", **CONFIGS["llama"]})
    FAMILIES["llama"].check_tensor_parallel(config, 4)
    plan = FAMILIES["llama"].tensor_plan(config)
    kv = {name for name in plan if name.rsplit(".", 2)[-2] in ("k_proj", "v_proj")}
    assert len(kv) == 4 * config.num_hidden_layers and plan.whole_at(4) == kv and not plan.whole_at(2)
    assert plan.axes() == plan.tp_axes(2) == plan.tp_axes(1)
    assert plan.tp_axes(4) == {name: None if name in kv else axis for name, axis in plan.axes().items()}
    name = min(n for n in kv if n.endswith("k_proj.weight"))
    assert plan[name].placement.local_shape(plan[name].shape, plan.mesh(tp=4)) == plan[name].shape
    assert plan[name].placement.local_shape(plan[name].shape, plan.mesh(tp=2))[1] == plan[name].shape[1] // 2


def test_uneven_pipeline_stages_keep_every_layer_and_give_the_first_stage_the_fewer():
    """Layers that do not divide over the stages are all kept, the shares differ by at most one, the
    first stage (which also holds the embedding) has the fewer, and so has the last (the head) unless
    every other stage needs the extra; every placement asks `layer_stage`, which agrees. Splits
    fleet cannot run are refused by name: a stage without a layer, uneven virtual chunks."""
    from modeling.pipeline import PipelineSplitError, check_stage_split
    from modeling.placement import chunk_starts, layer_stage

    assert list(chunk_starts(61, 16)) == [0, 3] + list(range(7, 56, 4)) + [58, 61]  # DeepSeek-V3 / Kimi-K2 over pp16
    for layers, chunks in ((61, 16), (8, 3), (5, 4), (8, 2), (27, 4)):
        sizes = np.diff(chunk_starts(layers, chunks))
        assert sizes.sum() == layers and sizes.max() - sizes.min() <= 1 and sizes[0] == sizes.min()
        assert sizes[-1] == sizes.min() or layers % chunks == chunks - 1
        assert [layer_stage(index, layers, chunks, 1) for index in range(layers)] == \
            [chunk for chunk, size in enumerate(sizes) for _ in range(size)]
    check_stage_split(61, 16, 1)
    with pytest.raises(PipelineSplitError, match="num_hidden_layers=3 is fewer than.*4 chunks"):
        check_stage_split(3, 4, 1)
    with pytest.raises(PipelineSplitError, match="does not divide into.*= 4 equal chunks.*drop --virtual_pp_degree"):
        check_stage_split(6, 2, 2)


def test_dualpipev_places_two_chunks_per_stage_in_a_v_with_the_head_on_the_first():
    """DualPipeV's V (fleet's `_segment_network_for_dualpipev`): 2 x pp chunks, stage s holding the s-th
    and the (2 pp - 1 - s)-th, so the first stage holds the first and the last layers, the embedding and
    what follows the decoder (the final norm, the head); the interleaved order is unchanged."""
    from modeling.placement import LAST, Mesh, Placement, chunk_stage, layer_stage

    assert [layer_stage(index, 8, 4, 1, v_shape=True) for index in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [layer_stage(index, 8, 2, 2) for index in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    stages = [layer_stage(index, 61, 16, 1, v_shape=True) for index in range(61)]  # DeepSeek-V3 over pp16
    assert sorted(set(stages)) == list(range(16)) and stages[0] == stages[-1] == 0
    # 32 chunks of 1 or 2 layers, the first and the last two of 1: the first stage, which also holds the
    # embedding and the head, gets the two thinnest
    assert [stages.count(stage) for stage in range(16)] == [2, 3] + [4] * 14
    assert [chunk_stage(chunk, 4, v_shape=True) for chunk in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert Placement(None, LAST).stages(Mesh(8, pp=4, v_shape=True)) == [0]
    assert Placement(None, LAST).stages(Mesh(8, pp=4)) == [3]
