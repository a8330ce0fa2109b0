"""Fine-tuning on chat data (`run_finetune.py`, `paddle_pp/data/chat.py`, `sft.py`) and the loss per optimizer
step (`modeling/step_loss.py`). The references: transformers' `apply_chat_template` (its ids, and its assistant
mask where a template marks generation), made on tokenizer folders transformers itself saves; each packed sample
run alone; the single card with one micro-batch a step."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import paddle
import pytest
from chat_data import (
    CONVERSATIONS,
    LLAMA3,
    TEMPLATES,
    TOOL_CONVERSATION,
    chat_tokenizer,
    jargon_chats,
    write_jsonl,
)

from checkpoint.format import GRADIENTS, MODEL
from modeling.execution import Execution
from modeling.loss import IGNORE_INDEX
from modeling.registry import config_from_dict, family_of
from paddle_pp.data.chat import ChatTemplate, conversation
from paddle_pp.data.errors import DataError
from paddle_pp.data.sft import SampleEncoder, SFTPlan, build_rows
from paddle_pp.data.tokenizer import load_text_tokenizer
from paddle_pp.training.arguments import parse_args
from paddle_pp.training.run_plan import TrainingConfigError, fine_tuning

from runs import CORPUS

STEP_TOL = 1e-6  # the loss per step: the same sums in another order
END_OF_TURN = {"llama3": "<|eot_id|>", "qwen": "<|im_end|>", "gemma": "<end_of_turn>", "chatml_generation": "<|im_end|>"}


@functools.cache
def _tokenizer(style: str, root: str) -> Path:
    return chat_tokenizer(style, Path(root) / style, CORPUS)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("chat_tokenizers"))
    return lambda style: _tokenizer(style, root)


def _transformers(folder: Path, record: dict, mask: bool = False) -> dict:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    return tokenizer.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=True,
                                         return_dict=True, return_assistant_tokens_mask=mask)


@pytest.mark.parametrize("style", ["llama3", "qwen", "gemma", "chatml_generation"])
def test_samples_are_transformers_chat_template_ids_with_the_assistant_turns_trained(tokenizers, style):
    """Ids equal apply_chat_template's, multi-turn with a system prompt (and Qwen's tool call, tool result and tools
    list); the trained tokens are each assistant turn's content and end-of-turn tokens, and with {% generation %}
    blocks exactly transformers' assistant mask; labels are the next id where trained."""
    import transformers

    folder = tokenizers(style)
    encoder = SampleEncoder(load_text_tokenizer(folder))
    for record in CONVERSATIONS + ([TOOL_CONVERSATION] if style == "qwen" else []):
        expected = _transformers(folder, record, mask=style == "chatml_generation")
        ids, trained = encoder.ids_and_mask(record, "sample")
        assert ids.tolist() == expected["input_ids"]
        if "assistant_masks" in expected:
            assert trained.astype(int).tolist() == expected["assistant_masks"]
        turns = [m for m in record["messages"] if m["role"] == "assistant"]
        text = transformers.AutoTokenizer.from_pretrained(str(folder)).decode(ids[trained].tolist())
        assert all(turn["content"] in text for turn in turns)
        assert text.count(END_OF_TURN[style]) == len(turns)  # each turn's end trained, no turn's start
        assert not any(start in text for start in ("<|im_start|>", "<|start_header_id|>", "<start_of_turn>"))
        sample = encoder.sample(record, "sample")
        np.testing.assert_array_equal(sample.inputs, ids[:-1])
        np.testing.assert_array_equal(sample.labels, np.where(trained[1:], ids[1:], IGNORE_INDEX))


def test_spans_from_successive_renderings_equal_transformers_generation_mask(tokenizers):
    """Llama 3's template without generation blocks (spans found as what each turn adds) trains the tokens
    transformers' assistant mask marks on the same template with its assistant turns in generation blocks."""
    folder = tokenizers("llama3")
    tagged = LLAMA3.replace("{{ content }}", "{% if message['role'] == 'assistant' %}{{ content.split('<|end_header_id|>"
                                             "\n\n')[0] + '<|end_header_id|>\n\n' }}{% generation %}{{ content.split("
                                             "'<|end_header_id|>\n\n')[1] }}{% endgeneration %}{% else %}{{ content }}"
                                             "{% endif %}")
    import transformers

    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    encoder = SampleEncoder(load_text_tokenizer(folder))
    for record in CONVERSATIONS:
        expected = theirs.apply_chat_template(record["messages"], chat_template=tagged, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
        ids, trained = encoder.ids_and_mask(record, "sample")
        assert ids.tolist() == expected["input_ids"] and sum(expected["assistant_masks"]) > 0
        assert trained.astype(int).tolist() == expected["assistant_masks"]


def test_erniekit_turns_labelled_zero_and_openai_weight_zero_are_not_trained(tokenizers):
    folder = tokenizers("qwen")
    encoder = SampleEncoder(load_text_tokenizer(folder))
    ernie = {"system": "Be brief.", "src": ["one?", "two?", "three?"], "tgt": ["first answer", "second answer",
                                                                              "third answer"], "label": [1, 0, 1]}
    ids, trained = encoder.ids_and_mask(ernie, "ernie")
    text = encoder.tokenizer.decode(ids[trained].tolist())
    assert "first answer" in text and "third answer" in text and "second" not in text
    # the same conversation in OpenAI's form renders the same ids
    messages = {"messages": [{"role": "system", "content": "Be brief."}] + [
        m for q, a, keep in zip(ernie["src"], ernie["tgt"], ernie["label"])
        for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a, "weight": keep})]}
    openai_ids, openai_trained = encoder.ids_and_mask(messages, "openai")
    unweighted = {"messages": list(conversation(messages, "openai").messages)}
    assert openai_ids.tolist() == ids.tolist() == _transformers(folder, unweighted)["input_ids"]
    np.testing.assert_array_equal(openai_trained, trained)


@pytest.mark.parametrize("record, message", [
    ({"prompt": "x"}, "neither 'messages'"),
    ({"src": ["a"], "tgt": ["b"], "label": [0]}, "trains nothing"),
    ({"src": ["a", "b"], "tgt": ["c"]}, "one entry per turn"),
    ({"src": "a", "tgt": "b", "is_system": 1}, "is_system"),
    ({"messages": [{"role": "user", "content": "a"}]}, "no assistant message"),
    ({"messages": [{"role": "robot", "content": "a"}]}, "role must be one of"),
])
def test_malformed_samples_are_refused_by_name(record, message):
    with pytest.raises(DataError, match=message):
        conversation(record, "data.jsonl:1")


def test_a_template_that_rewrites_earlier_turns_is_refused_by_name(tokenizers):
    folder = tokenizers("qwen")
    template = ChatTemplate(TEMPLATES["rewriting"][0], {}, "qwen3-like")
    record = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>x</think>b"},
                           {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    with pytest.raises(DataError, match="rewrites earlier turns"):
        template.trained_spans(conversation(record, "s"), "s")
    assert folder.is_dir()


def test_a_template_in_tokenizer_config_is_read_as_transformers_reads_it(tokenizers, tmp_path):
    """Folders written before chat_template.jinja existed keep the template in tokenizer_config.json."""
    import shutil

    folder = tmp_path / "old"
    shutil.copytree(tokenizers("gemma"), folder)
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(settings | {"chat_template": template}))
    ids, _ = SampleEncoder(load_text_tokenizer(folder)).ids_and_mask(CONVERSATIONS[1], "s")
    assert ids.tolist() == _transformers(folder, CONVERSATIONS[1])["input_ids"]


def _rows(folder: Path, path: Path, length: int, packing: bool, truncation: str = "delete", wanted: int = 8):
    plan = SFTPlan((path,), (1.0,), (), None, length, packing, truncation, 0, (wanted, 0))
    return build_rows(plan, SampleEncoder(load_text_tokenizer(folder)), 0, plan.train_paths, plan.train_probs, wanted)


def test_truncation_strategies_and_packing_keep_every_sample_whole(tokenizers, tmp_path):
    folder = tokenizers("qwen")
    path = write_jsonl(tmp_path / "chat.jsonl", jargon_chats(CORPUS, 40))
    lengths = [len(s) for s in _rows(folder, path, 4096, False, wanted=40).rows for s in s]
    limit = int(np.median(lengths))
    deleted = _rows(folder, path, limit, False, wanted=40)
    assert max(len(s) for row in deleted.rows for s in row) <= limit and "dropped" in deleted.notes[0]
    for strategy, kept in (("right", slice(0, limit)), ("left", slice(-limit, None))):
        cut = _rows(folder, path, limit, False, strategy, wanted=200)
        longest = max((s for row in cut.rows for s in row), key=len)
        assert len(longest) == limit
    packed = _rows(folder, path, 2 * limit, True, wanted=10)
    inputs, labels, positions = packed.batch(range(10))
    for row in range(10):  # each sample's positions restart at 0 and its ids are its own, in order
        samples, at = packed.rows[row], 0
        assert sum(len(s) for s in samples) <= 2 * limit and len(samples) >= 1
        for sample in samples:
            np.testing.assert_array_equal(inputs[row, at:at + len(sample)], sample.inputs)
            np.testing.assert_array_equal(positions[row, at:at + len(sample)], np.arange(len(sample)))
            at += len(sample)
        assert (labels[row, at:] == IGNORE_INDEX).all()


CONFIG = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)


def test_a_packed_row_trains_as_its_samples_one_at_a_time(tokenizers, tmp_path):
    """The loss per step over a packed row (positions from the data, attention inside each sample, padding) and
    each parameter's gradient equal its samples run alone, one causal stream each, summed over the same count
    (loss rtol 1e-6; gradients rtol 1e-6, atol 1e-6 of the largest entry)."""
    folder = tokenizers("qwen")
    rows = _rows(folder, write_jsonl(tmp_path / "chat.jsonl", jargon_chats(CORPUS, 24)), 512, True, wanted=2)
    inputs, labels, positions = rows.batch([0, 1])
    count = int((labels != IGNORE_INDEX).sum())
    config = config_from_dict(CONFIG | {"vocab_size": load_text_tokenizer(folder).vocab_size})
    paddle.seed(3)
    packed_model = family_of(config).causal_lm(config, Execution(documents=()))
    alone_model = family_of(config).causal_lm(config, Execution())
    alone_model.set_state_dict(packed_model.state_dict())
    packed_model.run.step_loss.set_step(count, 1, 1)
    alone_model.run.step_loss.set_step(count, 1, 1)
    loss = packed_model.criterion(packed_model((paddle.to_tensor(inputs), paddle.to_tensor(positions))),
                                  paddle.to_tensor(labels))
    loss.backward()
    alone = 0.0
    for row in range(2):
        for sample in rows.rows[row]:
            part = alone_model.criterion(alone_model(paddle.to_tensor(sample.inputs[None])),
                                         paddle.to_tensor(sample.labels[None]))
            part.backward()
            alone += float(part)
    assert sum(len(r) for r in rows.rows[:2]) > 2
    np.testing.assert_allclose(float(loss), alone, rtol=STEP_TOL)
    grads = {name: p.grad.numpy() for name, p in alone_model.named_parameters()}
    scale = max(np.abs(g).max() for g in grads.values())
    for name, param in packed_model.named_parameters():
        np.testing.assert_allclose(param.grad.numpy(), grads[name], rtol=STEP_TOL, atol=STEP_TOL * scale, err_msg=name)


@pytest.mark.parametrize("flags, message", [
    (["--packing"], "--packing packs fine-tuning samples"),
    (["--train_dataset_path", "x.jsonl", "--do_eval"], "needs --eval_dataset_path"),
])
def test_fine_tuning_flags_that_cannot_combine_are_refused_in_the_plan(flags, message):
    config = config_from_dict(CONFIG | {"vocab_size": 64})
    with pytest.raises(TrainingConfigError, match=message):
        fine_tuning(parse_args(flags), config, Execution())


def test_packed_rows_keep_samples_apart_unless_only_positions_restart():
    """Packed samples are apart by the data's positions (no end-of-sequence token marks them); PaddleFormers'
    use_global_causal_attn: true (--reset_position_ids) lets attention span the row, positions still restarting."""
    config = config_from_dict(CONFIG | {"vocab_size": 64})
    for flags, within in (([], True), (["--reset_position_ids"], False)):
        execution, notes = fine_tuning(parse_args(["--train_dataset_path", "x.jsonl", "--packing", *flags]), config,
                                       Execution())
        assert execution.documents == () and execution.within_documents is within and notes
    unpacked, _ = fine_tuning(parse_args(["--train_dataset_path", "x.jsonl"]), config, Execution())
    assert unpacked.documents is None


def test_the_loss_per_step_refuses_prediction_layers_by_name():
    config = config_from_dict(dict(model_type="deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=16,
                                   qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_experts=4, n_group=1,
                                   topk_group=1, num_experts_per_tok=2, moe_intermediate_size=16,
                                   num_nextn_predict_layers=1))
    with pytest.raises(TrainingConfigError, match="multi-token prediction"):
        fine_tuning(parse_args(["--calculate_per_token_loss"]), config, Execution())


# The launches: a tiny LLaMA on chat data of mixed lengths (Qwen's template), 3 steps of 8 samples, each step saved
# with its gradients
SFT_MODEL = ("--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "2", "--num_attention_heads",
             "4", "--num_key_value_heads", "2", "--max_seq_length", "256", "--global_batch_size", "8", "--max_steps",
             "3", "--warmup_steps", "1", "--disable_progress_bar", "--attention_core", "blockwise", "--save_steps", "1",
             "--save_gradients", "--calculate_per_token_loss")
ACCUMULATE = {"acc1": (1, ("--per_device_train_batch_size", "8")),
              "acc4": (1, ("--per_device_train_batch_size", "2")),
              "mean4": (1, ("--per_device_train_batch_size", "2", "--no-calculate_per_token_loss")),
              "dp2": (2, ("--per_device_train_batch_size", "2")),
              "packed": (1, ("--per_device_train_batch_size", "2", "--packing")),
              "packed_cp2_pp2": (4, ("--per_device_train_batch_size", "2", "--packing", "--context_parallel_degree",
                                     "2", "--pipeline_parallel_degree", "2"))}


@pytest.fixture(scope="module")
def sft_runs(run_workers_module, tmp_path_factory, tokenizers):
    root = tmp_path_factory.mktemp("sft_runs")
    data = write_jsonl(root / "chat.jsonl", jargon_chats(CORPUS, 64))

    @functools.cache
    def run(name: str):
        nproc, flags = ACCUMULATE[name]
        out = root / name
        results = run_workers_module("pretrain_worker.py", nproc, [
            *SFT_MODEL, *flags, "--tokenizer_dir", tokenizers("qwen"), "--train_dataset_path", data,
            "--output_dir", out], tag=name)
        return results[0], out

    return run


def _tensors(out: Path, step: int, kind: str) -> dict[str, np.ndarray]:
    from checkpoint.unified_io import UnifiedReader

    reader = UnifiedReader(out / f"checkpoint-{step}", kind)
    return {name: reader.read(name) for name in reader.tensors}


def _assert_same_steps(result: dict, expected: dict, out: Path, reference: Path, weights_rtol: float = 1e-5) -> None:
    """Losses and grad norms of the 3 steps and step 1's gradients (each tensor's difference norm) within 1e-6; the
    weights after 3 updates within `weights_rtol` (Adam divides each gradient by its own size: summation-order noise
    in near-zero gradients, embedding rows of tokens a step barely sees, moves their weights by more)."""
    np.testing.assert_allclose(result["losses"], expected["losses"], rtol=STEP_TOL)
    np.testing.assert_allclose(result["grad_norms"], expected["grad_norms"], rtol=STEP_TOL)
    for step, kind, rtol in ((1, GRADIENTS, STEP_TOL), (3, MODEL, weights_rtol)):
        ours, theirs = _tensors(out, step, kind), _tensors(reference, step, kind)
        assert ours.keys() == theirs.keys() and ours
        for name, value in theirs.items():
            assert np.linalg.norm(ours[name] - value) <= rtol * np.linalg.norm(value), (kind, name)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["acc4", "dp2"])
def test_the_loss_per_step_is_the_same_for_any_accumulation_and_data_degree(sft_runs, name):
    """Masked chat samples: each micro-batch's supervised tokens differ, and the steps equal one micro-batch of 8 on
    one card (`_assert_same_steps`)."""
    expected, reference = sft_runs("acc1")
    result, out = sft_runs(name)
    _assert_same_steps(result, expected, out, reference)


@pytest.mark.multiproc
def test_a_mean_per_micro_batch_differs_on_the_same_data(sft_runs):
    """What PaddleFormers' SFT criterion computes: 4 micro-batches' means averaged is not one micro-batch's."""
    expected, _ = sft_runs("acc1")
    result, _ = sft_runs("mean4")
    assert abs(result["losses"][0] - expected["losses"][0]) > 100 * STEP_TOL * expected["losses"][0]
    assert abs(result["grad_norms"][0] / expected["grad_norms"][0] - 1) > 1e-3


@pytest.mark.multiproc
def test_packed_rows_train_alike_under_context_and_pipeline_parallelism(sft_runs):
    """Packed rows give their positions beside the ids through fleet's pipeline and around the cp ring: cp2 x pp2
    trains on the single card's steps (`_assert_same_steps`; the weights within 1e-4, the 20-step tolerance: the ring
    merges each query's partial softmaxes in another order, and k_proj's small gradients take that 1.5e-5 in 3 Adam
    steps)."""
    expected, reference = sft_runs("packed")
    result, out = sft_runs("packed_cp2_pp2")
    _assert_same_steps(result, expected, out, reference, weights_rtol=1e-4)
