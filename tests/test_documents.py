"""Per-document attention (`--no-use_global_causal_attn`, `modeling/documents.py`): a packed sample
gives, token by token, what its documents give run one at a time. The references: transformers'
own models (made inside the test) run on each document alone, for the logits of LLaMA 3, Gemma 2
(windows, soft-caps), GPT-2 (learned positions), DeepSeek-V3 (latent attention, yarn) and GPT-OSS
(sinks, windows); our single-card model on each document alone, for the gradients of the summed
loss (multi-token prediction's too); and the single card per document, for the ring of cp4 (LLaMA)
and of cp2 x tp2 x pp2 + SP (a DeepSeek-V3-shaped model with experts and a prediction layer; the
LLaMA run of that layout on 8 ranks was retired: the same ring, positions and pipeline, and GQA per
document in the ring worker's cases), positions restarted with attention across documents under
cp2 x pp2."""

from __future__ import annotations

import functools

import numpy as np
import paddle
import pytest

from modeling.attention_core import CORES, BlockwiseCore
from modeling.attention_core.dense import causal_mask
from modeling.documents import Documents, document_positions
from modeling.execution import Execution
from modeling.llama import LlamaForCausalLM
from paddle_pp.runtime.errors import UserError
from paddle_pp.runtime.layout import Layout
from paddle_pp.training.arguments import parse_args
from paddle_pp.training.run_plan import run_execution

import hf_models
from parity import EVAL_RTOL, TRAIN_TOL, assert_matches, layout_runs, our_model, write_model_files
from runs import PP2, TP2

END = 3  # the end-of-document token of these tests
LENGTHS = ((7, 9, 8), (5, 19))  # each row's documents (the last one cut by the sample's end)
CORE_CASES = {"dense": CORES["dense"], "blockwise": BlockwiseCore(5)}  # 5: documents and blocks cross
HF_TOLERANCE = 1e-5  # our logits against transformers' (the family tests' tolerance)


def packed_ids(vocab: int) -> np.ndarray:
    """[2, 24] ids: every document but a row's last ends with END; no other END anywhere."""
    ids = np.random.default_rng(11).integers(END + 1, vocab, size=(len(LENGTHS), sum(LENGTHS[0])))
    for row, lengths in enumerate(LENGTHS):
        ids[row, np.cumsum(lengths)[:-1] - 1] = END
    return ids


def documents(row: int):
    """(start, end) of each document in `row`."""
    ends = np.cumsum(LENGTHS[row])
    return list(zip(ends - np.asarray(LENGTHS[row]), ends))


@functools.cache
def folder(kind: str, root: str):
    from pathlib import Path

    return hf_models.make(kind, Path(root) / kind, hf_models.SEEDS.get(kind, 0))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("documents"))


@pytest.mark.parametrize("core", list(CORE_CASES))
@pytest.mark.parametrize("kind", ["llama3", "gemma2", "gpt2", "deepseek_v3", "gpt_oss"])
def test_a_packed_sample_gives_transformers_logits_of_each_document_alone(root, kind, core):
    path = folder(kind, root)
    model = our_model(path, Execution(attention=CORE_CASES[core], documents=(END,)))
    model.eval()
    ids = packed_ids(model.config.vocab_size)
    with paddle.no_grad():
        packed = model(paddle.to_tensor(ids)).numpy()
    for row in range(len(LENGTHS)):
        for start, end in documents(row):
            alone = hf_models.logits(path, ids[row:row + 1, start:end])
            np.testing.assert_allclose(packed[row:row + 1, start:end], alone, rtol=HF_TOLERANCE, atol=HF_TOLERANCE,
                                       err_msg=f"{kind}, {core}: row {row}, document [{start}, {end})")


@pytest.mark.parametrize("core", list(CORE_CASES))
@pytest.mark.parametrize("kind", ["llama3", "gemma2", "gpt2", "deepseek_v3", "gpt_oss"])
def test_positions_restart_under_attention_across_documents_as_transformers_computes_them(root, kind, core):
    """`--reset_position_ids` (PaddleFormers' `use_global_causal_attn: true`): the packed sample's
    logits equal transformers' on the whole row, causal over it, at position ids that restart after
    every end-of-document token (rotary, yarn's and learned positions; windows and sinks still count
    sequence positions)."""
    path = folder(kind, root)
    model = our_model(path, Execution(attention=CORE_CASES[core], documents=(END,), within_documents=False))
    model.eval()
    ids = packed_ids(model.config.vocab_size)
    with paddle.no_grad():
        packed = model(paddle.to_tensor(ids)).numpy()
    positions = np.concatenate([np.concatenate([np.arange(end - start) for start, end in documents(row)])[None]
                                for row in range(len(LENGTHS))])
    np.testing.assert_allclose(packed, hf_models.logits(path, ids, positions), rtol=HF_TOLERANCE, atol=HF_TOLERANCE,
                               err_msg=f"{kind}, {core}")
    whole = hf_models.logits(path, ids)  # positions 0..n-1: what the restart changes
    assert np.abs(packed - whole)[:, LENGTHS[0][0]:].max() > 1e-3


def _summed_loss(model, ids: np.ndarray, labels: np.ndarray):
    logits = model(paddle.to_tensor(ids))
    return logits, paddle.nn.functional.cross_entropy(logits, paddle.to_tensor(labels).unsqueeze(-1), reduction="sum")


@pytest.mark.parametrize("core", list(CORE_CASES))
@pytest.mark.parametrize("kind", ["llama3", "gemma2", "gpt2"])
def test_a_packed_sample_trains_as_its_documents_one_at_a_time(root, kind, core):
    """Logits (rtol 1e-6, atol 1e-6 of the largest) and the gradient of every parameter (rtol 1e-5, atol 1e-5 of the model's
    largest gradient entry: k's bias has a zero gradient, which the two summation orders round
    apart) of the summed loss:
    the packed sample per document against each document alone in one causal stream, every label
    kept (a document's last token predicts the next document's first, as PaddleFormers trains)."""
    path = folder(kind, root)
    packed_model = our_model(path, Execution(attention=CORE_CASES[core], documents=(END,)))
    alone_model = our_model(path, Execution(attention=CORE_CASES[core]))
    tokens = packed_ids(packed_model.config.vocab_size)
    labels = np.roll(tokens, -1, axis=1)
    packed, loss = _summed_loss(packed_model, tokens, labels)
    loss.backward()
    for row in range(len(LENGTHS)):
        for start, end in documents(row):
            alone, part = _summed_loss(alone_model, tokens[row:row + 1, start:end], labels[row:row + 1, start:end])
            part.backward()
            np.testing.assert_allclose(packed.numpy()[row:row + 1, start:end], alone.numpy(), rtol=EVAL_RTOL,
                                       atol=EVAL_RTOL * np.abs(alone.numpy()).max())
    alone_grads = {name: param.grad.numpy() for name, param in alone_model.named_parameters()}
    scale = max(np.abs(grad).max() for grad in alone_grads.values())
    for name, param in packed_model.named_parameters():
        np.testing.assert_allclose(param.grad.numpy(), alone_grads[name], rtol=TRAIN_TOL, atol=TRAIN_TOL * scale,
                                   err_msg=f"{kind}, {core}: {name}")


PREDICTING = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                  v_head_dim=8, num_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, moe_intermediate_size=16,
                  first_k_dense_replace=1, num_nextn_predict_layers=1, num_nextn_predict_lambda=0.5,
                  max_position_embeddings=64, aux_loss_alpha=0.0)  # a balance loss is the whole sample's statistic


@pytest.mark.parametrize("core", list(CORE_CASES))
def test_a_packed_sample_trains_its_prediction_layer_as_its_documents_one_at_a_time(core):
    """Multi-token prediction (a DeepSeek-V3-shaped model with one prediction layer, lambda 0.5) on the
    packed sample per document against each document alone in one causal stream: every depth-1
    prediction whose embedded token (the next one) is in its position's document counts (a document's
    last token embeds the next document's first token and is not counted, as the alone run has no
    such token), so the loss is the count-weighted mix of the documents' next-token and prediction
    losses, and its gradient, for every parameter, that mix of theirs (rtol 1e-5, atol 1e-5 of the
    largest entry); the documents' positions reach the prediction layer's attention and the loss."""
    from modeling.registry import config_from_dict, family_of

    config = config_from_dict(PREDICTING)
    paddle.seed(3)
    packed_model = family_of(config).causal_lm(config, Execution(attention=CORE_CASES[core], documents=(END,)))
    alone_model = family_of(config).causal_lm(config, Execution(attention=CORE_CASES[core]))
    alone_model.set_state_dict(packed_model.state_dict())
    tokens = packed_ids(config.vocab_size)
    labels = np.roll(tokens, -1, axis=1)
    packed_model.criterion(packed_model(paddle.to_tensor(tokens)), paddle.to_tensor(labels)).backward()
    parts = [(tokens[row:row + 1, start:end], labels[row:row + 1, start:end])
             for row in range(len(LENGTHS)) for start, end in documents(row)]
    main_count, ahead_count = sum(ids.size for ids, _ in parts), sum(ids.size - 1 for ids, _ in parts)
    mixed = paddle.zeros([])
    for ids, part_labels in parts:  # each document's (mean next-token loss, weighted mean prediction loss)
        logits, part_labels = alone_model(paddle.to_tensor(ids)), paddle.to_tensor(part_labels)
        main = alone_model.criterion(logits[0], part_labels)
        ahead = alone_model.criterion(logits, part_labels) - main
        mixed = mixed + main * ids.size / main_count + ahead * (ids.size - 1) / ahead_count
    mixed.backward()
    alone_grads = {name: param.grad.numpy() for name, param in alone_model.named_parameters()}
    scale = max(np.abs(grad).max() for grad in alone_grads.values())
    assert np.abs(alone_grads["deepseek_v3.layers.2.eh_proj.weight"]).max() > 0
    for name, param in packed_model.named_parameters():
        np.testing.assert_allclose(param.grad.numpy(), alone_grads[name], rtol=TRAIN_TOL, atol=TRAIN_TOL * scale,
                                   err_msg=f"{core}: {name}")


CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
BLOCKWISE = ("--attention", "blockwise", "--block", "6", "--documents", str(END))


CP2, CP4 = ("--context_parallel_degree", "2"), ("--context_parallel_degree", "4")
CP2_TP2_PP2_SP = (8, CP2 + TP2 + PP2 + ("--sequence_parallel",) + BLOCKWISE)
LAYOUTS = {"cp4": (4, CP4 + BLOCKWISE)}


ACROSS = ("--across_documents",)
# Restarted positions need the ring and the pipeline's p2p, not tp (sequence parallelism gathers whole
# sequences before attention): cp2 x pp2 on 4 ranks rather than the 8 of the per-document run. Its layers
# recompute whole in backward, reading the positions again after the stage sent them (which fleet then
# frees: the stage hands on a copy, `documents.handed_across`).
ACROSS_LAYOUTS = {"cp2_pp2": (4, CP2 + PP2 + BLOCKWISE + ACROSS + ("--recompute", "full"))}


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    return write_model_files(tmp_path_factory.mktemp("llama_documents"), "llama", CONFIG, LlamaForCausalLM)


@pytest.fixture(scope="module")
def documents_runs(run_workers_module, model_files):
    return layout_runs(run_workers_module, model_files, LAYOUTS, ("--documents", str(END)))


@pytest.fixture(scope="module")
def predicting_runs(run_workers_module, tmp_path_factory):
    from modeling.deepseek import DeepseekV3ForCausalLM

    # with DeepSeek-V3's sequence-wise balance loss (a whole sequence's statistic, pooled over the ring under cp)
    fields = {key: value for key, value in PREDICTING.items() if key != "model_type"} | {"aux_loss_alpha": 0.1}
    files = write_model_files(tmp_path_factory.mktemp("predicting_documents"), "deepseek_v3", fields,
                              DeepseekV3ForCausalLM)
    return layout_runs(run_workers_module, files, {"cp2_tp2_pp2_sp": CP2_TP2_PP2_SP},
                       ("--documents", str(END)))


@pytest.fixture(scope="module")
def across_runs(run_workers_module, model_files):
    return layout_runs(run_workers_module, model_files, ACROSS_LAYOUTS, ("--documents", str(END)) + ACROSS)


@pytest.mark.multiproc
def test_per_document_training_under_cp4_matches_the_single_card(documents_runs):
    """Eval loss (1e-6), 3 AdamW steps and every parameter after them (1e-5) against one card's dense
    core, all per document (an end-of-document token at about one position in six of 16): the ring
    of cp4 (three ring steps of 2-token chunks, queries that see none of a step's keys), with the
    blockwise kernel's blocks of 6 crossing chunks and documents."""
    assert_matches("cp4", documents_runs("cp4"), documents_runs("single"))


@pytest.mark.multiproc
def test_restarted_positions_under_cp_and_pp_match_the_single_card(across_runs, documents_runs):
    """`--reset_position_ids`: the same checks with attention across documents under cp2 x pp2 with
    full recompute (positions found over the ring, carried through the pipeline and read again by the
    recomputation, the ring's plain causal attention); and the run is not the per-document one (its
    losses differ)."""
    assert_matches("cp2_pp2", across_runs("cp2_pp2"), across_runs("single"))
    (across,), _ = across_runs("single")
    (within,), _ = documents_runs("single")
    assert abs(across["eval_loss"] - within["eval_loss"]) > 1e-4 * abs(within["eval_loss"])


@pytest.mark.parametrize("window", [None, 3])
def test_flashmasks_rows_are_the_mask_the_other_cores_apply(window):
    """The int32 rows handed to Paddle's flashmask on GPU (key j unseen from row ends[j] on), spelled
    out as a mask, are the causal, per-document (and windowed) mask the dense core applies."""
    ids = packed_ids(64)
    documents = Documents.of(document_positions(paddle.to_tensor(ids), (END,)))
    ends = documents.key_ends(window).numpy()[:, 0, :, 0]
    rows = np.arange(ids.shape[1])[:, None]
    from_flashmask = (rows >= np.arange(ids.shape[1])[None, :])[None] & (rows[None] < ends[:, None, :])
    dense = causal_mask(ids.shape[1], 1, window).numpy()[None] & documents.visible(1).numpy()[:, 0]
    np.testing.assert_array_equal(from_flashmask, dense)


CPU = Layout(world_size=1, device="cpu")


def test_the_flag_sets_the_tokenizers_end_token_and_refuses_what_it_cannot_keep():
    per_document = parse_args(["--no-use_global_causal_attn"]).model
    execution, notes = run_execution(per_document, CPU, None, 64, 2)
    assert execution.documents == (2,) and any("ends at token 2" in note for note in notes)
    assert run_execution(parse_args([]).model, CPU, None, 64, 2)[0].documents is None
    under_cp = run_execution(per_document, Layout(world_size=2, device="cpu", context_parallel_degree=2), None, 64, 2)
    assert under_cp[0].documents == (2,)
    restarted, notes = run_execution(parse_args(["--reset_position_ids"]).model, CPU, None, 64, 2)
    assert restarted.documents == (2,) and not restarted.within_documents
    assert any("attention across documents (--reset_position_ids)" in note for note in notes)
    assert run_execution(per_document, CPU, None, 64, 2)[0].within_documents
    for flags in (["--no-use_global_causal_attn"], ["--reset_position_ids"]):
        with pytest.raises(UserError, match=f"{flags[0]}: the tokenizer has no end-of-sequence token"):
            run_execution(parse_args(flags).model, CPU, None, 64, None)


@pytest.mark.multiproc
def test_multi_token_prediction_and_experts_per_document_under_cp_tp_pp_and_sp_match_the_single_card(
        predicting_runs):
    """A DeepSeek-V3-shaped model (MoE layers with a sequence-wise balance loss and correction biases, a
    prediction layer) per document under cp2 x tp2 x pp2 + SP (the positions cross the pipeline's p2p; a
    document begun on the other rank): the prediction layer on the last stage,
    its next tokens' embeddings, labels and document positions found along the whole sequence across
    the ring, the routers' counts and balance statistics pooled over it; eval loss (1e-6), 3 AdamW steps
    and every parameter (1e-5) against one card's."""
    assert_matches("cp2_tp2_pp2_sp", predicting_runs("cp2_tp2_pp2_sp"), predicting_runs("single"))

