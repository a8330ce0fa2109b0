"""Decoder layers whose token mixer is recurrent (Qwen3.5's Gated DeltaNet beside its gated attention,
Kimi Linear's Kimi Delta Attention beside latent attention, Nemotron-H's Mamba-2 beside attention and Falcon-H1's
beside it in one layer), one process, fp32: packed documents (`--use_global_causal_attn false`) each give the logits and the
gradients their document gives alone (the conv window and the state restart at every document, in
chunks and spans the documents cross). Against transformers: tests/test_family_training.py (folders
started under tp2 x pp2 + SP) and tests/test_recurrent_core.py (the rule)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from modeling.execution import Execution
from modeling.recurrent_core import RecurrentCore
from modeling.registry import config_from_dict, family

TOL = 1e-5
END = 1  # the end-of-document token of these rows
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
             max_position_embeddings=64)
FIELDS = {
    "qwen3_5_text": dict(SHAPE, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                         linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"]),
    "kimi_linear": dict(SHAPE, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, num_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,
                        linear_attn_config={"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2, "head_dim": 8}),
    "nemotron_h": dict(SHAPE, num_key_value_heads=1, head_dim=16, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8,
                       n_groups=2, layers_block_type=["linear_attention", "full_attention"]),
    "falcon_h1": dict(SHAPE, num_key_value_heads=1, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=2),
}


def _model(model_type: str, documents: bool):
    """The same weights either way (seeded), chunks of 4 tokens, 2 per span."""
    paddle.seed(3)
    config = config_from_dict(dict(FIELDS[model_type], model_type=model_type))
    run = Execution(recurrent=RecurrentCore(4, span_chunks=2), documents=(END,) if documents else None)
    return family(model_type).causal_lm(config, run)


@pytest.mark.parametrize("model_type", list(FIELDS))
@pytest.mark.parametrize("lengths", [(6, 11, 3), (8, 8, 4)], ids=["inside_chunks", "at_span_edges"])
def test_packed_documents_each_give_what_they_give_alone(model_type, lengths):
    """A row of documents, each ending at END: per document, its logits and the gradient of its
    weighted logits by each parameter equal its own run alone (1e-5)."""
    rng = np.random.default_rng(4)
    documents = [np.append(rng.integers(2, 64, length - 1), END) for length in lengths]
    weights = [rng.standard_normal((1, len(document), 64)).astype(np.float32) for document in documents]
    packed = _model(model_type, documents=True)
    logits = packed(paddle.to_tensor(np.concatenate(documents)[None]))
    (logits * paddle.to_tensor(np.concatenate(weights, axis=1))).sum().backward()
    packed_grads = {name: param.grad.numpy() for name, param in packed.named_parameters()}
    alone = _model(model_type, documents=False)
    start = 0
    for document, weight in zip(documents, weights):
        own = alone(paddle.to_tensor(document[None]))
        np.testing.assert_allclose(logits.numpy()[:, start:start + len(document)], own.numpy(), rtol=TOL, atol=TOL)
        (own * paddle.to_tensor(weight)).sum().backward()
        start += len(document)
    for name, param in alone.named_parameters():  # gradients accumulated over the documents run alone
        np.testing.assert_allclose(packed_grads[name], param.grad.numpy(), rtol=TOL, atol=TOL, err_msg=name)
