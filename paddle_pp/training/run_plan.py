"""One plan of a run, made before any process group: what a job will compute and how, and every
refusal of its composition (layout x model x flags x dtype), each naming the flag or field and the fix.

`plan_run` is pure: it reads no file, makes no topology and writes nothing (of the machine it reads
the host memory per rank, for the CPU's choice of core, and a GPU's compute capability, for flash
attention's rules). The trainer builds from
it (`Pretrainer.__init__`), and so does `tools/reshard.py plan` (with the trainer's own flags), so the
two cannot disagree on whether a request runs: a rule about what may be combined is added here, once.
It decides, in this order:
1. the layout from the degree flags (`Layout`'s own checks) and the sequence length it can cut;
2. the batch plan: micro-batch, accumulation steps, global batch (a global batch that does not divide
   over the data replicas is refused), and the warmup within the steps;
3. the compute dtype (`precision.compute_dtype`: bf16/fp16 need a GPU, master gradients a half dtype);
4. the model's fit to the flags and the layout: dropout, fp16 with experts, `validate_layout` (tp,
   pp x vpp, ep, cp against every layer's attention), sparse attention's indexer training
   (`check_indexer_training`), each cp part long enough for a recurrent layer's conv window
   (`check_context_parts`);
5. the execution: the attention core (per layer where the run's core cannot compute a layer),
   recompute, kernels, documents, accumulation (`run_execution`);
6. the pipeline schedule fleet will run for these micro-batches, and what it cannot take of them or
   of the model (`planning.schedules`).
What needs the process groups (this rank's tp rank, the cp ring, the expert groups) is added to the
execution once they exist (`modeling.registry.execution_for`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from modeling.attention_core import CORES, DenseCost, Heads
from modeling.execution import Execution, choose_execution
from modeling.indexer_training import IndexerTraining
from modeling.lora import LoRA, adapted_paths
from modeling.registry import check_context_parts, core_notes, plan_of, validate_layout
from paddle_pp.planning.memory import Workload
from paddle_pp.planning.schedules import check_schedule_model, resolve_schedule
from paddle_pp.runtime.errors import UserError
from paddle_pp.runtime.host_memory import host_bytes_per_rank
from paddle_pp.runtime.layout import Layout
from paddle_pp.training import precision
from paddle_pp.training.arguments import (
    DataArguments,
    ModelArguments,
    OptimizerArguments,
    PretrainArguments,
    parse_args,
)
from paddle_pp.training.indexer_metrics import has_indexers
from paddle_pp.training.model_config import check_dropout


class TrainingConfigError(UserError, ValueError):
    """A pretraining request that cannot run as given."""


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int
    accumulate_steps: int
    global_batch: int


@dataclass(frozen=True)
class RunPlan:
    """What `plan_run` decided; `execution` holds the choices (the tp rank, the ring and the expert
    groups are added once the process groups exist), `notes` what the run prints at its start."""

    layout: Layout
    batches: BatchPlan
    warmup_steps: int
    compute_dtype: str | None
    seq_len: int
    execution: Execution
    schedule: str  # the pipeline's (`planning.schedules.resolve_schedule`; "" without one)
    notes: tuple[str, ...]

    @property
    def compute_bytes(self) -> int:
        return 4 if self.compute_dtype is None else 2

    def workload(self) -> Workload:
        """What the memory planner reads of this plan (`paddle_pp.planning.memory`)."""
        return Workload(micro_batch=self.batches.micro_batch, seq_len=self.seq_len,
                        accumulate_steps=self.batches.accumulate_steps, execution=self.execution)


def plan_batches(args: DataArguments, layout: Layout) -> BatchPlan:
    micro, replicas = args.per_device_train_batch_size, layout.data_replicas
    if args.global_batch_size == 0:
        return BatchPlan(micro, args.gradient_accumulation_steps, micro * args.gradient_accumulation_steps * replicas)
    if args.global_batch_size % (micro * replicas):
        raise TrainingConfigError(
            f"--global_batch_size {args.global_batch_size} is not divisible by --per_device_train_batch_size "
            f"{micro} x data replicas {replicas} (dp {layout.dp} x sharding {layout.sharding_degree}); "
            f"use a multiple of {micro * replicas}")
    return BatchPlan(micro, args.global_batch_size // (micro * replicas), args.global_batch_size)


def warmup_steps(args: OptimizerArguments, given: frozenset[str]) -> int:
    """PaddleNLP's rule (--warmup_steps when > 0, else --warmup_ratio x --max_steps), except that a
    --warmup_ratio given without --warmup_steps is not hidden by our default --warmup_steps."""
    if args.warmup_steps > 0 and not (args.warmup_ratio > 0 and "warmup_steps" not in given):
        steps = args.warmup_steps
    else:
        steps = math.ceil(args.warmup_ratio * args.max_steps)
    if not 0 <= steps <= args.max_steps:
        raise TrainingConfigError(f"--warmup_steps {steps} must lie in [0, --max_steps {args.max_steps}]")
    return steps


def run_execution(args: ModelArguments, layout: Layout, compute_dtype: str | None, head_dim: int,
                  end_of_document: int | None, dense_cost: DenseCost | None = None) -> tuple[Execution, list[str]]:
    """The run's attention core, recompute, fused kernels and document boundaries (the data's
    `end_of_document` token under --no-use_global_causal_attn) from the model flags
    (`choose_execution`; `dense_cost`: what the dense core would keep, for the CPU's choice), and
    notes on what was asked for and not taken on this device."""
    by_document = ("--no-use_global_causal_attn" if not args.use_global_causal_attn
                   else "--reset_position_ids" if args.reset_position_ids else None)
    if by_document is not None and end_of_document is None:
        raise TrainingConfigError(
            f"{by_document}: the tokenizer has no end-of-sequence token to find where documents end; "
            "use a tokenizer with one (the data must have been written with it after every document)")
    dense = ("--no-use_flash_attention" if not args.use_flash_attention
             else "--attention_core dense" if args.attention_core == "dense" else None)
    if layout.cp > 1 and dense:
        raise TrainingConfigError(
            f"--context_parallel_degree {layout.cp} with {dense}: the dense attention core keeps no "
            f"log-sum-exp, which ring attention merges partial results by; drop {dense} (context "
            "parallelism runs the blockwise kernel around the ring)")
    if args.recompute and args.pp_recompute_interval > 1:
        raise TrainingConfigError(
            f"--pp_recompute_interval {args.pp_recompute_interval}: recompute runs one decoder layer per segment "
            "here (PaddleNLP's 1, its default); segments of several layers are not implemented. Use "
            "--pp_recompute_interval 1, or --recompute_granularity to recompute less")
    sm = _compute_capability() if layout.device == "gpu" else None
    execution, notes = choose_execution(args.use_flash_attention, args.recompute, args.recompute_granularity,
                                        args.recompute_use_reentrant, args.use_fused_rope, args.use_fused_rms_norm,
                                        layout.device, compute_dtype, head_dim, sm,
                                        dense_cost if layout.cp == 1 else None, args.attention_core)
    execution = replace(execution, indexers=IndexerTraining(coef=args.indexer_loss_coef))
    if by_document is None:
        return execution, notes
    within = not args.use_global_causal_attn
    notes.append(f"{'attention inside documents' if within else 'attention across documents'} ({by_document}): "
                 f"each ends at token {end_of_document}, positions restart after it")
    return replace(execution, documents=(end_of_document,), within_documents=within), notes


def _compute_capability() -> tuple[int, int] | None:
    """This machine's GPU compute capability (None where no GPU is visible: a plan made elsewhere)."""
    import paddle

    if not (paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count()):
        return None
    return tuple(paddle.device.cuda.get_device_capability())


DENSE_MEMORY_SHARE = 4  # the dense core may keep up to a quarter of the host memory of each rank


def dense_cost_of(config, layout: Layout, micro_batch: int, accumulate_steps: int, seq_len: int,
                  recompute: bool) -> DenseCost:
    """What the dense core would keep on a rank beyond the blockwise core: one layer's probabilities
    per micro-batch by the cores' `saved_bytes` (fp32), times the layers a stage holds at once
    without recompute (each of its layers, for as many micro-batches as 1F1B keeps in flight on the
    first stage); with recompute, one layer's."""
    heads = Heads(max(1, config.num_attention_heads // layout.tp), max(1, config.num_key_value_heads // layout.tp),
                  config.head_dim, config.head_dim)
    per_layer = (CORES["dense"].saved_bytes(micro_batch, seq_len, heads, 4, False)
                 - CORES["blockwise"].saved_bytes(micro_batch, seq_len, heads, 4, False))
    layers = 1 if recompute else -(-config.num_hidden_layers // layout.pp) * min(layout.pp, accumulate_steps)
    return DenseCost(seq_len, per_layer * layers, host_bytes_per_rank(layout.world_size) // DENSE_MEMORY_SHARE)


def check_indexer_training(args: ModelArguments, config, layout: Layout) -> None:
    """Sparse attention's dense warm-up freezes every weight but the indexers for its first steps, which a
    model without indexers does not have, and which stage2/3's gradient buffers and paddle.DataParallel's
    reducer (pure data parallelism) cannot follow: both fix the trained parameters when they wrap. (Its
    indexer loss is injected inside the model as the MoE aux loss is, which fp16 refuses: every
    sparse-attention family has experts.)"""
    warmup = args.indexer_dense_warmup_steps
    if not has_indexers(config):
        if warmup:
            raise TrainingConfigError(f"--indexer_dense_warmup_steps {warmup}: {config.model_type} has no sparse "
                                      "attention indexer to warm up; drop the flag")
        return
    if warmup and layout.group_sharded_level is not None:
        raise TrainingConfigError(f"--indexer_dense_warmup_steps {warmup} with --sharding {layout.sharding_stage}: "
                                  "its gradient buffers are laid out for the weights trained when it wraps the model, "
                                  "and the warm-up trains the indexers only; use --sharding stage1")
    if warmup and layout.dp > 1 and layout.world_size == layout.dp:
        raise TrainingConfigError(f"--indexer_dense_warmup_steps {warmup} under pure data parallelism: "
                                  "paddle.DataParallel's reducer fixes the trained weights when it wraps the model; "
                                  f"use --sharding_parallel_degree {layout.dp} --sharding stage1 instead")


def fine_tuning(args: PretrainArguments, config, execution: Execution) -> tuple[Execution, list[str]]:
    """Chat fine-tuning's data against the flags: packed rows keep their samples apart by the positions the
    data gives (not by end-of-sequence tokens, which a chat sample holds at every turn's end; attention
    spans the row only with --reset_position_ids, PaddleFormers' use_global_causal_attn: true), and the
    loss per optimizer step weighs the next token's losses only."""
    data, optim, output = args.data, args.optim, args.output
    if optim.calculate_per_token_loss and config.mtp_depth:
        raise TrainingConfigError(f"--calculate_per_token_loss with {config.model_type}'s {config.mtp_depth} "
                                  "multi-token prediction layer(s): their losses are each depth's mean (not modelled "
                                  "per step); drop the flag or train without the prediction layers")
    if not data.train_dataset_path:
        if data.packing:
            raise TrainingConfigError("--packing packs fine-tuning samples (--train_dataset_path); pretraining data "
                                      "are packed rows already")
        return execution, []
    if output.do_eval and "do_eval" in args.given and not data.eval_dataset_path:
        raise TrainingConfigError("--do_eval with --train_dataset_path needs --eval_dataset_path (chat data to "
                                  "evaluate on)")
    notes = [] if optim.calculate_per_token_loss else [
        "the loss is a mean per micro-batch (--no-calculate_per_token_loss): with prompts masked, tokens of short "
        "answers weigh more, and accumulation and the data degree change the gradients"]
    if not data.packing:  # one sample a row, the padding after it: attention per document would change nothing
        return execution, notes
    within = not args.model.reset_position_ids  # the samples' ends are the data's, never end-of-sequence tokens
    notes.append(f"packed fine-tuning rows: positions restart at each sample, attention "
                 f"{'inside each sample' if within else 'across the row (--reset_position_ids)'}")
    return replace(execution, documents=(), within_documents=within), notes


def check_lora(args: PretrainArguments, config, layout: Layout) -> None:
    """LoRA's adapters against the model, the layout and the saves: some projection must be adapted, dropout's
    masks must agree across the tp ranks that share an input, the sparse-attention layers' absorbed kv_b_proj
    (used as a weight, not called) and their dense warm-up (which trains the indexers alone) take no adapters,
    and checkpoints in transformers' layout have no place for them."""
    lora = LoRA.of(config)
    if lora is None:
        return
    if args.checkpoint.save_to_hf:
        raise TrainingConfigError("--save_to_hf with --lora: a checkpoint whose weights are a transformers folder has "
                                  "no place for the adapters (transformers would load the base alone, and the folder "
                                  "would not resume); save unified checkpoints and write the adapters with "
                                  "tools/lora.py peft (or merged: tools/lora.py merge)")
    args = args.model
    adapted = adapted_paths(plan_of(config))
    if not adapted:
        raise TrainingConfigError(f"--lora_target_modules {args.lora_target_modules!r} names no projection of "
                                  f"{config.model_type} (module names such as q_proj, regular expressions over whole "
                                  "paths, or all-linear)")
    if lora.dropout and layout.tp > 1:
        raise TrainingConfigError(f"--lora_dropout {lora.dropout} with --tensor_parallel_degree {layout.tp}: each tp "
                                  "rank would draw its own mask on an input they share (not modelled); use "
                                  "--lora_dropout 0")
    if has_indexers(config):
        absorbed = sorted(path for path in adapted if path.endswith("kv_b_proj"))
        if absorbed or args.indexer_dense_warmup_steps:
            raise TrainingConfigError(
                f"--lora on {config.model_type}: " + (f"{absorbed[0]} is used as a weight by the sparse attention "
                                                      "(not modelled); leave kv_b_proj out of --lora_target_modules"
                                                      if absorbed else "--indexer_dense_warmup_steps trains the "
                                                      "indexers alone; drop one of the two"))


def plan_run(args: PretrainArguments, config, end_of_document: int | None, world_size: int | None = None,
             device: str | None = None) -> RunPlan:
    """The run `args` asks for with the model `config` on `world_size` ranks of `device` (None: as
    launched), its documents ended by `end_of_document` (the tokenizer's end-of-sequence id, or None);
    raises the first refusal (a `UserError`) in the order of the module's docstring."""
    data, optim, model = args.data, args.optim, args.model
    layout = Layout.from_args(args.layout, world_size, device)
    layout.check_sequence_length(data.max_seq_length)
    batches = plan_batches(data, layout)
    warmup = warmup_steps(optim, args.given)
    compute_dtype = precision.compute_dtype(optim.bf16, optim.fp16, optim.amp_master_grad, layout)
    check_dropout(model, config)
    if compute_dtype == "float16" and getattr(config, "num_experts", 0):
        raise TrainingConfigError("--fp16 with a mixture-of-experts model: the aux loss's gradient is injected at "
                                  "each layer without the fp16 loss scale (not implemented); train with --bf16")
    validate_layout(config, layout)
    check_indexer_training(model, config, layout)
    check_lora(args, config, layout)
    check_context_parts(config, layout, data.max_seq_length)
    dense_cost = dense_cost_of(config, layout, batches.micro_batch, batches.accumulate_steps, data.max_seq_length,
                               model.recompute)
    execution, notes = run_execution(model, layout, compute_dtype, config.head_dim, end_of_document, dense_cost)
    execution, tuning_notes = fine_tuning(args, config, execution)
    notes += tuning_notes + core_notes(config, execution)
    schedule = resolve_schedule(layout, batches.accumulate_steps)
    check_schedule_model(schedule, config)
    if schedule:
        notes.append(f"pipeline schedule: {schedule} ({batches.accumulate_steps} micro-batches over {layout.pp} "
                     "stages)")
    return RunPlan(layout, batches, warmup, compute_dtype, data.max_seq_length,
                   replace(execution, accumulate_steps=batches.accumulate_steps), schedule, (*layout.notes, *notes))


def plan_for(config, layout: Layout, *flags: str, end_of_document: int | None = 0) -> RunPlan:
    """`plan_run` for `layout` and the trainer's `flags` (tests and benchmarks: what the trainer would
    decide on such a command line)."""
    return plan_run(parse_args([*layout.flags(), *flags]), config, end_of_document, layout.world_size,
                    layout.device)
