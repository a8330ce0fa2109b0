"""Decoder layers whose token mixer is recurrent (Qwen3.5's Gated DeltaNet beside its gated attention),
one process, fp32: packed documents (`--use_global_causal_attn false`) each give the logits and the
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
FIELDS = dict(model_type="qwen3_5_text", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
              linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
              layer_types=["linear_attention", "full_attention"])


def _model(documents: bool):
    """The same weights either way (seeded), chunks of 4 tokens, 2 per span."""
    paddle.seed(3)
    config = config_from_dict(dict(FIELDS))
    run = Execution(recurrent=RecurrentCore(4, span_chunks=2), documents=(END,) if documents else None)
    return family("qwen3_5_text").causal_lm(config, run)


@pytest.mark.parametrize("lengths", [(6, 11, 3), (8, 8, 4)], ids=["inside_chunks", "at_span_edges"])
def test_packed_documents_each_give_what_they_give_alone(lengths):
    """A row of documents, each ending at END: per document, its logits and the gradient of its
    weighted logits by each parameter equal its own run alone (1e-5)."""
    rng = np.random.default_rng(4)
    documents = [np.append(rng.integers(2, 64, length - 1), END) for length in lengths]
    weights = [rng.standard_normal((1, len(document), 64)).astype(np.float32) for document in documents]
    packed = _model(documents=True)
    logits = packed(paddle.to_tensor(np.concatenate(documents)[None]))
    (logits * paddle.to_tensor(np.concatenate(weights, axis=1))).sum().backward()
    packed_grads = {name: param.grad.numpy() for name, param in packed.named_parameters()}
    alone = _model(documents=False)
    start = 0
    for document, weight in zip(documents, weights):
        own = alone(paddle.to_tensor(document[None]))
        np.testing.assert_allclose(logits.numpy()[:, start:start + len(document)], own.numpy(), rtol=TOL, atol=TOL)
        (own * paddle.to_tensor(weight)).sum().backward()
        start += len(document)
    for name, param in alone.named_parameters():  # gradients accumulated over the documents run alone
        np.testing.assert_allclose(packed_grads[name], param.grad.numpy(), rtol=TOL, atol=TOL, err_msg=name)
