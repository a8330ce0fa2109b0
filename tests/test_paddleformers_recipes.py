"""PaddleFormers' pretraining recipes as its examples/config/pt/ write them (`--config recipe.yaml`,
`stage: PT`): read with PaddleFormers' meaning (its degree names and defaults, attention per
document, its recompute fields), each field modelled, named as changing nothing, or refused with
the fix; and one shaped like its full_offline_data.yaml trains on one process from a transformers
Qwen3 folder, step 1 at the loss transformers gives each document of the batch run alone."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import yaml

from paddle_pp.data.preprocess import ensure_corpus
from paddle_pp.data.source import build_data, dataset_sizes, plan_data
from paddle_pp.training.arguments import parse_args

import hf_models
from runs import CORPUS, REPO, SCRIPT

LOSS_RTOL = 1e-5  # step 1's loss is a forward of the same fp32 weights on the same batch

# examples/config/pt/full_offline_data.yaml (PaddleFormers 66ba238) as written; the tests change its data
# path, model and output folder, and what CPU and a tiny model need
FULL_OFFLINE_DATA = """
### data
dataset_type: "pretrain"
input_dir: "1.0 ./data/pre-training/demo_data/data-1-part0"
split: "998,2"
max_seq_len: 8192
mix_strategy: concat
### model
model_name_or_path: Qwen/Qwen3-0.6B-Base
_attn_implementation: flashmask
### finetuning
# base
stage: PT
fine_tuning: full
seed: 23
do_train: true
do_eval: true
per_device_eval_batch_size: 1
per_device_train_batch_size: 1
num_train_epochs: 1
max_steps: 100
eval_iters: 10
eval_steps: 100
evaluation_strategy: steps
save_steps: 100
save_strategy: steps
logging_steps: 1
gradient_accumulation_steps: 4
logging_dir: ./vdl_log
output_dir: ./checkpoints/qwen3-pt-full-offline
disable_tqdm: true
eval_accumulation_steps: 16
# train
warmup_steps: 20
learning_rate: 1.0e-5
# performance
tensor_model_parallel_size: 1
pipeline_model_parallel_size: 1
sharding: stage1
recompute_granularity: full
recompute_method: uniform
recompute_num_layers: 1
bf16: true
fp16_opt_level: O2
load_checkpoint_format: flex_checkpoint
save_checkpoint_format: flex_checkpoint
"""
# the parallel and communication fields of examples/config/pt/full_tp_pp_ep.yaml (f85ac72) as written
TP_PP_EP = """
tensor_model_parallel_size: 2
pipeline_model_parallel_size: 2
sequence_parallel: true
use_expert_parallel: true
expert_model_parallel_size: 4
split_param: true
amp_master_grad: true
clear_every_step_cache: true
partial_send_recv: false
batch_p2p_comm: false
tp_sync_param: true
sync_grad: true
weight_decay: 0.0
adam_beta2: 0.999
moe_router_bias_update_rate: 0.0
moe_token_dispatcher_type: deepep
save_safetensors: false
overlap_p2p_comm: false
"""
# the data fields of examples/config/pt/full_tp_pp.yaml (14435de): PaddleFormers' online jsonl data
ONLINE_DATA = """
train_dataset_type: erniekit
eval_dataset_type: erniekit
train_dataset_path: ./tests/fixtures/dummy/pt/train.jsonl
train_dataset_prob: "1.0"
packing: true
"""


def _write(tmp_path, text: str, **changes) -> str:
    values = yaml.safe_load(text) | changes
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def _parse(tmp_path, text: str, *flags, **changes):
    return parse_args(["--config", _write(tmp_path, text, **changes), *flags])


def test_paddleformers_offline_recipe_reads_with_its_meaning(tmp_path, capsys):
    args = _parse(tmp_path, FULL_OFFLINE_DATA)
    layout, model, data, optim, output, ckpt = (args.layout, args.model, args.data, args.optim, args.output,
                                               args.checkpoint)
    assert (layout.tensor_parallel_degree, layout.pipeline_parallel_degree) == (1, 1)
    assert layout.sharding == "stage1" and layout.sharding_parallel_degree == -1  # every data-parallel rank
    assert layout.hybrid_parallel_topo_order == "sharding_first"  # PaddleFormers' default order
    assert model.recompute and model.recompute_granularity == "full"
    assert not model.use_global_causal_attn and model.use_flash_attention  # per document; flashmask
    across = _parse(tmp_path, FULL_OFFLINE_DATA, use_global_causal_attn=True).model  # positions still restart
    assert across.use_global_causal_attn and across.reset_position_ids
    assert data.input_dir == "1.0 ./data/pre-training/demo_data/data-1-part0" and data.split == "998,2"
    assert data.max_seq_length == 8192 and data.seed == 23 and data.gradient_accumulation_steps == 4
    assert optim.bf16 and optim.learning_rate == 1e-5 and optim.warmup_steps == 20 and optim.max_steps == 100
    assert optim.lr_scheduler_type == "linear" and optim.min_learning_rate == 0.0 and optim.weight_decay == 0.0
    assert optim.warmup_from_zero  # its Trainer's warmup: peak x step / warmup (tests/test_paddleformers.py)
    assert output.eval_iters == 10 and output.eval_steps == 100 and output.do_eval and output.disable_progress_bar
    assert ckpt.save_steps == 100 and ckpt.resume_from_checkpoint == "latest"
    assert not ckpt.save_to_hf and _parse(tmp_path, FULL_OFFLINE_DATA, save_to_hf=True).checkpoint.save_to_hf
    notes = capsys.readouterr().err
    assert "save_checkpoint_format" in notes and "mix_strategy" in notes and "PaddleFormers' defaults" in notes
    # its tp x pp x ep recipe's degrees and flat communication booleans
    args = _parse(tmp_path, FULL_OFFLINE_DATA + TP_PP_EP)
    assert (args.layout.tensor_parallel_degree, args.layout.pipeline_parallel_degree,
            args.layout.expert_parallel_degree, args.layout.sequence_parallel) == (2, 2, 4, True)
    assert args.optim.moe_router_bias_update_rate == 0.0 and args.optim.amp_master_grad
    assert "tp_sync_param" in capsys.readouterr().err
    assert _parse(tmp_path, FULL_OFFLINE_DATA + TP_PP_EP, use_dualpipev=True).layout.pipeline_schedule == "DualPipeV"


@pytest.mark.parametrize("text, changes, words", [
    (FULL_OFFLINE_DATA + ONLINE_DATA, {}, "train_dataset_type, train_dataset_path"),
    (FULL_OFFLINE_DATA, {"dataset_type": "iterable"}, "tools/preprocess_data.py"),
    (FULL_OFFLINE_DATA, {"stage": "DPO"}, "stage='DPO'"),
    (FULL_OFFLINE_DATA, {"fine_tuning": "qlora"}, "fine_tuning='qlora' (full or LoRA)"),
    (FULL_OFFLINE_DATA, {"fp16_opt_level": "O1"}, "fp16_opt_level='O1'"),
    (FULL_OFFLINE_DATA.replace("fp16_opt_level: O2\n", ""), {}, "fp16_opt_level left to PaddleFormers' default O1"),
    (FULL_OFFLINE_DATA, {"tensor_parallel_degree": 2}, "tensor_model_parallel_size and tensor_parallel_degree"),
    (FULL_OFFLINE_DATA, {"recompute_granularity": "selective"}, "recompute_granularity='selective'"),
    (FULL_OFFLINE_DATA, {"sep_parallel_size": 2}, "sep_parallel_size=2"),
    (FULL_OFFLINE_DATA, {"_attn_implementation": "flex"}, "_attn_implementation='flex'"),
    (FULL_OFFLINE_DATA, {"eval_iters": -1}, "do_eval without eval_iters"),
    (FULL_OFFLINE_DATA, {"a_new_field": 1}, "a_new_field=1 (a field paddle-pp does not know"),
    (FULL_OFFLINE_DATA, {"min_lr": 1e-6}, "linear schedule decays to 0 and never reads min_lr"),
    (FULL_OFFLINE_DATA, {"best_unbalanced_scheduler": True}, "VPPFhenBInBalancedMemory is not wired"),
], ids=["online_data", "iterable", "dpo", "qlora", "o1", "o1_by_default", "two_spellings", "selective", "sep",
        "attention", "eval_iters", "unknown", "min_lr_linear", "best_unbalanced"])
def test_what_a_paddleformers_recipe_asks_and_this_trainer_does_not_do_is_refused_by_name(tmp_path, capsys, text,
                                                                                       changes, words):
    with pytest.raises(SystemExit) as exit_info:
        _parse(tmp_path, text, **changes)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(re.escape(words), err) and "PaddleFormers recipe" in err and "Traceback" not in err


# examples/config/sft/lora.yaml (PaddleFormers 34f1ec2) as written but for the template (its default, custom, is
# PaddleFormers' Python templates: refused, below) and a finite max_steps (its -1 runs epochs)
LORA_SFT = """
train_dataset_type: erniekit
eval_dataset_type: erniekit
train_dataset_path: ./tests/fixtures/dummy/sft/train.jsonl
train_dataset_prob: "1.0"
eval_dataset_path: ./tests/fixtures/dummy/sft/eval.jsonl
eval_dataset_prob: "1.0"
max_seq_len: 8192
packing: false
mix_strategy: concat
template_backend: jinja
model_name_or_path: Qwen/Qwen3-Next-80B-A3B-Instruct
attn_impl: flashmask
lora: true
lora_rank: 8
stage: SFT
fine_tuning: lora
seed: 23
do_train: true
do_eval: true
per_device_eval_batch_size: 1
per_device_train_batch_size: 1
num_train_epochs: 1
max_steps: 100
eval_steps: 100
evaluation_strategy: steps
save_steps: 100
save_strategy: steps
logging_steps: 1
gradient_accumulation_steps: 4
logging_dir: ./vdl_log
output_dir: ./checkpoints/qwen3-sft-lora
disable_tqdm: true
eval_accumulation_steps: 16
warmup_steps: 20
learning_rate: 1.0e-4
tensor_parallel_degree: 1
pipeline_parallel_degree: 1
pipeline_parallel_config: enable_dynamic_shape enable_clear_every_step_cache
sharding: stage2
recompute: true
bf16: true
fp16_opt_level: O2
unified_checkpoint: true
"""


def test_a_paddleformers_sft_recipe_reads_as_chat_fine_tuning_with_lora(tmp_path):
    """stage SFT: its chat sources, packing and sequence length as ours, LoRA of rank 8 at alpha 2r (what
    PaddleFormers trains), the loss per optimizer step; packing true packs."""
    args = _parse(tmp_path, LORA_SFT)
    data, model = args.data, args.model
    assert data.train_dataset_path == "./tests/fixtures/dummy/sft/train.jsonl" and data.train_dataset_prob == "1.0"
    assert data.eval_dataset_path == "./tests/fixtures/dummy/sft/eval.jsonl" and data.max_seq_length == 8192
    assert not data.packing and data.truncation_strategy == "delete"
    assert model.lora and model.lora_rank == 8 and model.lora_alpha == -1.0 and not model.rslora
    assert args.optim.calculate_per_token_loss and args.layout.sharding == "stage2"
    assert _parse(tmp_path, LORA_SFT, packing=True, truncation_strategy="left").data.packing


@pytest.mark.parametrize("changes, words", [
    ({"template_backend": "custom", "template": "qwen3"}, "template_backend='custom'"),
    ({"split_multi_turn": True}, "split_multi_turn=True"),
    ({"eval_dataset_prob": "0.3,0.7"}, "eval_dataset_prob='0.3,0.7'"),
    ({"train_dataset_type": "pretrain"}, "train_dataset_type='pretrain'"),
    ({"fine_tuning": "full", "max_prompt_len": 1024}, "max_prompt_len=1024"),
])
def test_what_a_paddleformers_sft_recipe_asks_and_is_not_modelled_is_refused(tmp_path, capsys, changes, words):
    with pytest.raises(SystemExit):
        _parse(tmp_path, LORA_SFT, **changes)
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def _per_document_loss(folder, samples: np.ndarray, end: int) -> float:
    """transformers' mean next-token cross entropy of `samples`, each document of each sample run alone
    (a document ends after `end`; every label kept, as PaddleFormers trains)."""
    total, count = 0.0, 0
    for sample in samples:
        inputs, labels = sample[:-1], sample[1:]
        starts = [0] + [i + 1 for i in range(len(inputs) - 1) if inputs[i] == end] + [len(inputs)]
        for start, stop in zip(starts, starts[1:]):
            logits = hf_models.logits(folder, inputs[None, start:stop])[0].astype(np.float64)
            shifted = logits - logits.max(-1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
            total -= log_probs[np.arange(stop - start), labels[start:stop]].sum()
            count += stop - start
    return total / count


@pytest.mark.multiproc
def test_a_paddleformers_recipe_trains_per_document_from_a_transformers_folder(transformers4_folders, data_cache,
                                                                              tmp_path):
    """full_offline_data.yaml with the shipped corpus, a transformers Qwen3 folder, 32 tokens and 3
    steps (no bf16 on CPU): flashmask runs as the dense core (on CPU the faster at 32 tokens), each
    layer is recomputed, sharding
    stage1 spans the one process, and step 1's loss is transformers' on each document alone."""
    folder = transformers4_folders / "qwen3"
    prefix = ensure_corpus(CORPUS, folder, data_cache)
    recipe = _write(tmp_path, FULL_OFFLINE_DATA, input_dir=f"1.0 {prefix}", model_name_or_path=str(folder),
                    max_seq_len=32, max_steps=3, warmup_steps=1, eval_steps=3, eval_iters=1, bf16=False,
                    output_dir=str(tmp_path / "out"), logging_dir=str(tmp_path / "vdl"))
    done = subprocess.run([sys.executable, str(SCRIPT), "--config", recipe, "--data_cache", str(data_cache)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "attention inside documents" in done.stderr and "attention: dense core" in done.stderr
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and "eval_loss" in records[-1]
    args = parse_args(["--config", recipe, "--data_cache", str(data_cache)])
    plan = plan_data(args.data.input_dir, args.data.corpus, folder, data_cache, args.data.split, "mmap", 32, 23,
                     dataset_sizes(4, 3, 3, 1), 4096)
    train, _ = build_data(plan)
    samples = np.stack([train[i] for i in range(4)]).astype(np.int64)
    assert (samples[:, :-1] == 2).sum() >= 2  # documents end inside the batch (3 times): attention is cut there
    expected = _per_document_loss(folder, samples, end=2)
    np.testing.assert_allclose(records[0]["loss"], expected, rtol=LOSS_RTOL)


def test_an_output_dir_holding_a_paddleformers_checkpoint_is_refused_not_overwritten(transformers4_folders, data_cache,
                                                                                    tmp_path):
    """PaddleFormers' flex checkpoint-2 in output_dir (no 'latest' marker of ours): a run saving at step 2
    would have replaced it; it stops before training, naming the folder, and the files stay."""
    out = tmp_path / "out"
    flex = out / "checkpoint-2" / "model_state"
    flex.mkdir(parents=True)
    (flex / "0.metadata").write_bytes(b"flex metadata")
    folder = transformers4_folders / "qwen3"
    recipe = _write(tmp_path, FULL_OFFLINE_DATA, input_dir=f"1.0 {ensure_corpus(CORPUS, folder, data_cache)}",
                    model_name_or_path=str(folder), max_seq_len=32, max_steps=2,
                    warmup_steps=1, save_steps=2, eval_iters=1, bf16=False, output_dir=str(out))
    done = subprocess.run([sys.executable, str(SCRIPT), "--config", recipe, "--data_cache", str(data_cache)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "holds checkpoint-2 that paddle-pp did not write" in done.stderr and "Traceback" not in done.stderr
    assert (flex / "0.metadata").read_bytes() == b"flex metadata"
