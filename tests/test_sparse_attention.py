"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) on one process: the selected-key core against dense
attention masked to the same selection, the indexer's KL loss against its formula written out in
numpy, transformers 5's logits with a top-k shorter than the sequence (and a selection that changes
them), the two losses reaching only their own weights, and the refusals. Their training under ep2 x dp2
x tp2 x pp2 + SP: tests/test_moe_starts.py."""

from __future__ import annotations

import json
import shutil

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from conftest import IDS

from modeling.attention_core.sparse import selected_attention
from modeling.blocks.indexer import (
    Selection,
    dense_target,
    every_score,
    indexer_loss,
    key_starts,
    selected_scores,
    visible_keys,
)
from modeling.config import ModelConfigError
from modeling.registry import LayoutModelError, config_from_dict, validate_layout
from paddle_pp.runtime.errors import UserError
from paddle_pp.runtime.layout import Layout
from paddle_pp.training.run_plan import plan_for

from parity import our_logits, our_model

FORWARD_TOL, GRADIENT_TOL = 1e-6, 1e-5
LOGITS_TOL = 1e-5
KINDS = ("deepseek_v32", "glm_moe_dsa")


def _selection(rng, batch: int, seq: int, k: int, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(indices, visible) of each query's k best keys by random scores among those it may see (earlier,
    inside its document): a short row's top-k is filled with keys it may not see."""
    position = np.arange(seq)
    seen = (position[None, None, :] <= position[None, :, None]) & (position[None, None, :] >= starts[:, :, None])
    indices = np.argsort(-np.where(seen, rng.normal(size=(batch, seq, seq)), -np.inf), axis=-1, kind="stable")[..., :k]
    return indices, np.take_along_axis(seen, indices, -1)


def test_the_selected_key_core_equals_dense_attention_masked_to_the_same_selection():
    """Two documents in the second row, 6 keys of 40 per query, 3 heads sharing keys 12 wide whose first 8
    channels are the values, blocks of 16 queries: output, each query's head-summed probabilities at its
    keys (the indexer's target) and the gradients of q and the keys equal dense softmax attention whose
    mask is the selection (forward 1e-6, gradients 1e-5)."""
    rng = np.random.default_rng(0)
    batch, seq, heads, dim, value_dim, k, scale = 2, 40, 3, 12, 8, 6, 0.3
    starts = np.zeros((batch, seq), np.int64)
    starts[1, 20:] = 20
    indices, visible = _selection(rng, batch, seq, k, starts)
    q_np, keys_np = rng.normal(size=(batch, seq, heads, dim)), rng.normal(size=(batch, seq, dim))
    dout = paddle.to_tensor(rng.normal(size=(batch, seq, heads, value_dim)).astype(np.float32))

    q, keys = (paddle.to_tensor(x.astype(np.float32), stop_gradient=False) for x in (q_np, keys_np))
    out, target = selected_attention(q, keys, paddle.to_tensor(indices), paddle.to_tensor(visible), value_dim, scale,
                                     block=16)
    (out * dout).sum().backward()

    q_ref, keys_ref = (paddle.to_tensor(x.astype(np.float32), stop_gradient=False) for x in (q_np, keys_np))
    mask = np.zeros((batch, seq, seq), bool)
    np.put_along_axis(mask, indices, visible, -1)
    scores = paddle.matmul(q_ref, keys_ref.unsqueeze(1), transpose_y=True) * scale  # [batch, seq, heads, seq]
    probs = F.softmax(paddle.where(paddle.to_tensor(mask).unsqueeze(2), scores, paddle.full([], -np.inf)), -1)
    reference = paddle.matmul(probs, keys_ref[..., :value_dim].unsqueeze(1))
    (reference * dout).sum().backward()

    np.testing.assert_allclose(out.numpy(), reference.numpy(), rtol=FORWARD_TOL, atol=FORWARD_TOL)
    summed = np.take_along_axis(probs.numpy().sum(2), indices, -1) * visible
    np.testing.assert_allclose(target.numpy(), summed, rtol=FORWARD_TOL, atol=FORWARD_TOL)
    np.testing.assert_allclose(q.grad.numpy(), q_ref.grad.numpy(), rtol=GRADIENT_TOL, atol=GRADIENT_TOL)
    np.testing.assert_allclose(keys.grad.numpy(), keys_ref.grad.numpy(), rtol=GRADIENT_TOL, atol=GRADIENT_TOL)


def test_the_indexer_loss_is_the_kl_from_the_normalised_attention_to_the_index_softmax_at_the_selection():
    """mean over queries of sum_s p_s (log p_s - log softmax(I)_s) over each query's visible selected keys,
    p the target normalised, I_s = sum_j w_j relu(q_j . k_s / sqrt(d)): written out in numpy (1e-6)."""
    rng = np.random.default_rng(1)
    batch, seq, heads, dim, k = 2, 12, 3, 8, 5
    indices, visible = _selection(rng, batch, seq, k, np.zeros((batch, seq), np.int64))
    q, keys, weights = rng.normal(size=(batch, seq, heads, dim)), rng.normal(size=(batch, seq, dim)), \
        rng.normal(size=(batch, seq, heads))
    target = rng.uniform(0.1, 1.0, size=(batch, seq, k)) * visible
    selection = Selection(paddle.to_tensor(indices), paddle.to_tensor(visible))
    scores = selected_scores(*(paddle.to_tensor(x.astype(np.float32)) for x in (q, keys, weights)), selection)
    loss = indexer_loss(scores, selection.visible, paddle.to_tensor(target.astype(np.float32)))

    total = 0.0
    for b in range(batch):
        for t in range(seq):
            chosen = indices[b, t][visible[b, t]]
            scores = np.array([np.sum(weights[b, t] * np.maximum(q[b, t] @ keys[b, s] / np.sqrt(dim), 0))
                               for s in chosen])
            log_index = scores - scores.max() - np.log(np.exp(scores - scores.max()).sum())
            p = target[b, t][visible[b, t]] / target[b, t][visible[b, t]].sum()
            total += np.sum(p * (np.log(p) - log_index))
    np.testing.assert_allclose(float(loss), total / (batch * seq), rtol=FORWARD_TOL)


def test_the_warm_ups_target_is_dense_attention_summed_over_heads_and_its_scores_cover_every_visible_key():
    """The dense warm-up's target (every key each query may see, two documents in one row, blocks of
    queries) is softmax(scale q.k) summed over heads, written out in numpy (1e-6); its index scores over
    every key agree with the selection's at the keys a selection names."""
    rng = np.random.default_rng(2)
    batch, seq, heads, dim, scale = 2, 20, 3, 8, 0.4
    positions = np.tile(np.arange(seq), (batch, 1))
    positions[1, 12:] = np.arange(seq - 12)
    q, k = rng.normal(size=(batch, seq, heads, dim)), rng.normal(size=(batch, seq, heads, dim))
    starts = key_starts(paddle.to_tensor(positions), batch, seq)
    target = dense_target(paddle.to_tensor(q.astype(np.float32)), paddle.to_tensor(k.astype(np.float32)), starts,
                          scale).numpy()
    expected = np.zeros((batch, seq, seq))
    for b in range(batch):
        for t in range(seq):
            seen = np.arange(t - positions[b, t], t + 1)
            for h in range(heads):
                scores = scale * k[b, seen, h] @ q[b, t, h]
                expected[b, t, seen] += np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
    np.testing.assert_allclose(target, expected, rtol=FORWARD_TOL, atol=FORWARD_TOL)
    np.testing.assert_array_equal(visible_keys(starts, seq).numpy(), expected > 0)
    index_q, index_k, weights = (paddle.to_tensor(x.astype(np.float32)) for x in (
        rng.normal(size=(batch, seq, heads, dim)), rng.normal(size=(batch, seq, dim)), rng.normal(size=(batch, seq, heads))))
    indices, visible = _selection(rng, batch, seq, 4, starts.numpy())
    picked = selected_scores(index_q, index_k, weights, Selection(paddle.to_tensor(indices), paddle.to_tensor(visible)))
    np.testing.assert_allclose(picked.numpy(), np.take_along_axis(every_score(index_q, index_k, weights).numpy(),
                                                                  indices, -1), rtol=FORWARD_TOL, atol=FORWARD_TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_a_sparse_attention_folder_gives_transformers_logits_and_its_selection_matters(kind, moe_folders, tmp_path):
    """transformers 5's DeepSeek-V3.2 / GLM-5 (8 of 24 keys per query, their indexers rotating by halves /
    interleaved pairs) and ours give the same logits (1e-5); the same folder told to keep every key gives
    other logits (by more than 1e-3), so the comparison saw the selection."""
    folder = moe_folders["transformers5"] / kind
    ours = our_logits(folder, IDS)
    np.testing.assert_allclose(ours, np.load(f"{folder}.npy"), rtol=LOGITS_TOL, atol=LOGITS_TOL)
    dense = tmp_path / kind
    shutil.copytree(folder, dense)
    config = json.loads((dense / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps({**config, "index_topk": IDS.shape[1]}))
    assert np.abs(our_logits(dense, IDS) - ours).max() > 1e-3


def test_the_language_model_loss_never_reaches_the_indexer_and_the_indexer_loss_only_reaches_it(moe_folders):
    """One training forward and backward of DeepSeek-V3.2's folder with the indexer loss weighted 0, then
    1: at 0 every indexer weight's gradient is zero (its inputs are detached, the selection carries no
    gradient); at 1 they are not, and every other gradient is unchanged (bit for bit)."""
    grads = []
    for coef in (0.0, 1.0):
        model = our_model(moe_folders["transformers5"] / "deepseek_v32")
        model.run.indexers.coef = coef
        model.train()
        ids = paddle.to_tensor(IDS)
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.reshape([-1, logits.shape[-1]]), ids[:, 1:].reshape([-1])).backward()
        grads.append({name: param.grad.numpy() for name, param in model.named_parameters() if param.grad is not None})
    (lm_only, both) = grads
    indexer = [name for name in both if ".indexer." in name]
    assert indexer and lm_only.keys() == both.keys()
    for name in both:
        if name in indexer:
            assert not lm_only[name].any() and np.abs(both[name]).max() > 0, name
        else:
            np.testing.assert_array_equal(lm_only[name], both[name], err_msg=name)


def test_sparse_attention_is_refused_by_name_under_context_parallelism_and_where_a_selection_cannot_travel():
    """cp needs the index keys other ranks hold; GLM-5.2's shared layers (`indexer_types` as transformers
    derives it from `index_topk_freq`) take their selection from the layer before them that selects: a
    first layer with none to take, and the interleaved schedules (one cached shape for what travels
    between stages), are named before any process group; 1F1B plans."""
    config = config_from_dict(dict(SMALL_DSA))
    with pytest.raises(LayoutModelError, match="decoder layer 0's sparse attention selects .* cp other ranks hold"):
        validate_layout(config, Layout(world_size=2, context_parallel_degree=2))
    glm = dict(SMALL_DSA, model_type="glm_moe_dsa", num_hidden_layers=4, index_topk_freq=2)
    assert config_from_dict(dict(glm)).indexer_types == ["full", "full", "shared", "full"]
    with pytest.raises(ModelConfigError, match="indexer_types starts with 'shared'"):
        config_from_dict(dict(glm, indexer_types=["shared", "full", "full", "full"])).validate()
    with pytest.raises(LayoutModelError, match="--virtual_pp_degree 2 with GlmMoeDsaForCausalLM: what its layers hand"):
        validate_layout(config_from_dict(dict(glm)), Layout(world_size=2, pipeline_parallel_degree=2,
                                                            virtual_pp_degree=2))
    validate_layout(config_from_dict(dict(glm)), Layout(world_size=2, pipeline_parallel_degree=2))


SMALL_DSA = {"model_type": "deepseek_v32", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 16,
             "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4,
             "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "index_topk": 4,
             "index_head_dim": 16, "index_n_heads": 2, "first_k_dense_replace": 2}


@pytest.mark.parametrize("layout, flags, refused", [
    (dict(world_size=2, sharding_parallel_degree=2, sharding="stage2"), (), "--sharding stage2: its gradient buffers"),
    (dict(world_size=2), (), "under pure data parallelism: paddle.DataParallel's reducer"),
], ids=["stage2", "pure_dp"])
def test_the_dense_warm_up_is_refused_where_its_frozen_weights_cannot_be_followed(layout, flags, refused):
    """Before any process group, by name, with the fix: the warm-up under stage2 (its gradient buffers fix
    the trained weights) and under pure data parallelism (the reducer fixes them), and a warm-up asked of
    a model without indexers; stage1 plans."""
    config = config_from_dict(dict(SMALL_DSA))
    with pytest.raises(UserError, match=refused):
        plan_for(config, Layout(**layout), "--indexer_dense_warmup_steps", "2", *flags)
    llama = config_from_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
    with pytest.raises(UserError, match="--indexer_dense_warmup_steps 2: llama has no sparse attention indexer"):
        plan_for(llama, Layout(world_size=1), "--indexer_dense_warmup_steps", "2")
    assert plan_for(config, Layout(world_size=2, sharding_parallel_degree=2, sharding="stage1"),
                    "--indexer_dense_warmup_steps", "2").execution.indexers.coef == 1.0


def test_the_run_says_its_sparse_layers_take_the_selected_key_core():
    """The run's attention core (here pinned blockwise) serves indexed layers only in a dense warm-up: the
    plan's notes say so by layer, rather than leaving the flag silently unused there."""
    notes = plan_for(config_from_dict(dict(SMALL_DSA)), Layout(world_size=1), "--attention_core", "blockwise").notes
    assert any("decoder layers 0, 1 attend to the keys their indexer (or an earlier layer's) selects with the selected-key core" in note
               and "the blockwise core only in a dense warm-up" in note for note in notes), notes
