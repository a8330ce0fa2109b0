"""The pretraining loop: build the layout, the model, the data and the optimizer, then step.

Everything that can be wrong with the request (flags, degrees, model split, data, tokenizer,
precision on this device) is checked before `init_distributed`, so a bad run fails on every rank
with the same message instead of hanging in a collective.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle

from modeling import build_causal_lm, config_from_dict, split_axes, validate_layout
from modeling.state import init_single_card_weights
from checkpoint.commit import latest_checkpoint
from checkpoint.format import CheckpointError
from checkpoint.load import check_compatible, load_checkpoint
from checkpoint.optimizer_state import record_gradients, recorded_gradients
from checkpoint.save import PendingSave, save_checkpoint
from modeling.base import ModelConfigError
from modeling.pipeline import PipelineSplitError
from modeling.tp_utils import TPPlanError
from paddle_pp import precision
from paddle_pp.precision import PrecisionError
from paddle_pp.data.sampler import GlobalBatchSampler
from paddle_pp.data.tokenizer import TokenizerError, load_tokenizer
from paddle_pp.data.tokens import DataError, PackedTokens, ensure_tokens
from paddle_pp.grad_norm import ReportingGlobalNormClip, observe_hybrid_norm
from paddle_pp.layout import Layout, LayoutError
from paddle_pp.parallelize import wrap_model, wrap_optimizer
from paddle_pp.report import MetricsLog, ProgressBar, plot_loss
from paddle_pp.schedule import ScheduleError, WarmupCosine
from paddle_pp.step import eval_loss, train_step
from paddle_pp.topology import Topology, align_ranks, gather_objects, init_distributed


class TrainingConfigError(ValueError):
    """A pretraining request that cannot run as given."""


USER_ERRORS = (TrainingConfigError, LayoutError, PrecisionError, TokenizerError, DataError, TPPlanError,
               PipelineSplitError, ScheduleError, ModelConfigError, CheckpointError)


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int
    accumulate_steps: int
    global_batch: int


def plan_batches(args: argparse.Namespace, layout: Layout) -> BatchPlan:
    micro, replicas = args.per_device_train_batch_size, layout.data_replicas
    if args.global_batch_size == 0:
        return BatchPlan(micro, args.gradient_accumulation_steps, micro * args.gradient_accumulation_steps * replicas)
    if args.global_batch_size % (micro * replicas):
        raise TrainingConfigError(
            f"--global_batch_size {args.global_batch_size} is not divisible by --per_device_train_batch_size "
            f"{micro} x data replicas {replicas} (dp {layout.dp} x sharding {layout.sharding_degree}); "
            f"use a multiple of {micro * replicas}")
    return BatchPlan(micro, args.global_batch_size // (micro * replicas), args.global_batch_size)


def model_config(args: argparse.Namespace, vocab_size: int):
    values = dict(model_type=args.model_type, vocab_size=vocab_size, hidden_size=args.hidden_size,
                  intermediate_size=args.intermediate_size, num_hidden_layers=args.num_hidden_layers,
                  num_attention_heads=args.num_attention_heads, max_position_embeddings=args.max_seq_length,
                  initializer_range=args.initializer_range, recompute=args.recompute)
    if args.model_type == "llama":
        values["num_key_value_heads"] = args.num_key_value_heads or args.num_attention_heads
    return config_from_dict(values)


def _build_optimizer(model, args, schedule: WarmupCosine, clip: ReportingGlobalNormClip):
    matrices = {p.name for p in model.parameters() if len(p.shape) >= 2}
    return paddle.optimizer.AdamW(
        learning_rate=schedule, parameters=model.parameters(), beta1=args.adam_beta1, beta2=args.adam_beta2,
        epsilon=args.adam_epsilon, weight_decay=args.weight_decay, grad_clip=clip,
        apply_decay_param_fun=lambda name: name in matrices)


class Pretrainer:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.layout = Layout.from_args(args)
        self.batches = plan_batches(args, self.layout)
        self.compute_dtype = precision.compute_dtype(args.bf16, args.fp16, args.amp_master_grad, self.layout.device)
        self.vocab_size = load_tokenizer(args.tokenizer_dir).vocab_size()
        self.config = model_config(args, self.vocab_size)
        validate_layout(self.config, self.layout)
        if not Path(args.corpus).is_file():
            raise TrainingConfigError(f"--corpus {args.corpus} does not exist")
        self.schedule = WarmupCosine(args.learning_rate, args.warmup_steps, args.max_steps, args.min_learning_rate)
        if self.layout.vpp > 1 and self.batches.accumulate_steps < self.layout.pp:
            raise TrainingConfigError(
                f"--virtual_pp_degree needs at least --pipeline_parallel_degree {self.layout.pp} micro-batches per "
                f"step; got {self.batches.accumulate_steps} (raise --gradient_accumulation_steps)")
        self.resume_dir = self._resume_dir()

        self.topo: Topology = init_distributed(self.layout, self.batches.micro_batch, self.batches.accumulate_steps)
        paddle.seed(args.seed)
        raw = build_causal_lm(self.config, self.topo)
        if self.resume_dir is None:
            init_single_card_weights(raw, split_axes(self.config), self.topo, args.seed, args.initializer_range)
        self.criterion = getattr(raw, "criterion", None)
        self.clip = ReportingGlobalNormClip(args.max_grad_norm)
        optimizer = _build_optimizer(raw, args, self.schedule, self.clip)
        raw, optimizer = precision.decorate(raw, optimizer, self.compute_dtype, args.amp_master_grad)
        self.model, self.optimizer = wrap_model(raw, self.topo), wrap_optimizer(optimizer)
        observe_hybrid_norm(self.optimizer, self.clip)
        if args.save_gradients:
            record_gradients(self.optimizer)
        self.scaler = precision.loss_scaler(self.compute_dtype)
        self.raw_model, self.axes = raw, split_axes(self.config)
        self.consumed_samples, self.step = 0, 0
        if self.resume_dir is not None:
            state = load_checkpoint(self.resume_dir, raw, self.optimizer, self.topo, self.axes)
            self.step, self.consumed_samples = state["step"], state["consumed_samples"]
            self.schedule.set_state_dict(state["lr_scheduler"])
        self.pending_save: PendingSave | None = None
        self.data = self._build_data()
        align_ranks(self.topo)  # only first and last stages built data; the others wait in p2p
        self.sampler = GlobalBatchSampler(self.data.num_train if self.data else 1, self.batches.global_batch, args.seed)

    def _resume_dir(self) -> Path | None:
        """The checkpoint to resume from, checked against this model before any process group exists."""
        wanted = self.args.resume_from_checkpoint
        if not wanted:
            return None
        folder = latest_checkpoint(Path(self.args.output_dir)) if wanted == "latest" else Path(wanted)
        if folder is None:
            return None  # 'latest' with nothing saved yet: a fresh start
        check_compatible(folder, self.config, self.layout)
        return folder

    def save(self) -> None:
        """A unified checkpoint of this step; with --async_save the files are written in the background."""
        self.finish_pending_save()
        trainer_state = {"step": self.step, "consumed_samples": self.consumed_samples, "seed": self.args.seed,
                         "lr_scheduler": self.schedule.state_dict(), "max_steps": self.args.max_steps,
                         "global_batch_size": self.batches.global_batch,
                         "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.args).items()}}
        self.pending_save = save_checkpoint(
            Path(self.args.output_dir), self.step, self.raw_model, self.optimizer, self.topo, self.axes,
            config=self.config, trainer_state=trainer_state, tokenizer_dir=self.args.tokenizer_dir,
            keep=self.args.save_total_limit, asynchronous=self.args.async_save,
            gradients=recorded_gradients(self.optimizer) if self.args.save_gradients else None)
        if not self.args.async_save:
            self.pending_save = None

    def finish_pending_save(self, only_if_written: bool = False) -> None:
        """Commit an asynchronous save; with `only_if_written`, only once every rank's files are down."""
        if self.pending_save is None:
            return
        if only_if_written and not all(gather_objects(self.pending_save.files_written(), None, self.topo.layout.world_size)):
            return
        self.pending_save.finish()
        self.pending_save = None

    @property
    def needs_data(self) -> bool:
        """Inputs enter at the first stage and labels at the last; middle stages read nothing."""
        return self.topo.is_first_stage or self.topo.is_last_stage

    def _build_data(self) -> PackedTokens | None:
        if not self.needs_data:
            return None
        ensure_tokens(self.args.corpus, self.args.tokenizer_dir, self.args.data_cache)
        return PackedTokens(Path(self.args.data_cache), self.args.max_seq_length, self.args.eval_samples)

    def _tensors(self, indices, split: str):
        if self.data is None:
            return None, None
        inputs, labels = self.data.batch(indices, split)
        return paddle.to_tensor(inputs), paddle.to_tensor(labels)

    def train_one_step(self) -> dict:
        started = time.perf_counter()
        indices = self.sampler.replica_batch(self.consumed_samples, self.topo.data_replica_index,
                                             self.topo.data_replica_count)
        inputs, labels = self._tensors(indices, "train")
        lr = self.schedule.last_lr  # the rate this update applies (after a resume: the saved one)
        loss = train_step(self.model, self.optimizer, self.criterion, inputs, labels, self.topo,
                          self.batches.accumulate_steps, self.compute_dtype, self.scaler)
        self.schedule.step()
        self.step += 1
        self.consumed_samples += self.batches.global_batch
        seconds = time.perf_counter() - started
        return {"step": self.step, "loss": loss, "lr": lr, "grad_norm": self.clip.pop_norm(),
                "tokens_per_sec": self.batches.global_batch * self.args.max_seq_length / seconds}

    def evaluate(self) -> float:
        """Mean loss over `eval_iters` global batches of the held-out samples."""
        losses = []
        local = self.batches.global_batch // self.topo.data_replica_count
        for it in range(self.args.eval_iters):
            start = it * self.batches.global_batch + self.topo.data_replica_index * local
            indices = [(start + j) % self.args.eval_samples for j in range(local)]
            losses.append(eval_loss(self.model, self.criterion, *self._tensors(indices, "eval"), self.topo))
        return float(np.mean(losses))

    def train(self) -> list[dict]:
        """Run to `--max_steps`; rank 0 writes metrics.jsonl, shows progress and plots loss.png."""
        args, is_writer = self.args, self.topo.global_rank == 0
        output = Path(args.output_dir)
        log = MetricsLog(output / "metrics.jsonl", resume=self.step > 0) if is_writer else None
        bar = ProgressBar(args.max_steps, first_step=self.step) if is_writer and not args.disable_progress_bar else None
        started, history = time.perf_counter(), []
        stop = min(args.max_steps, self.step + args.exit_after_steps) if args.exit_after_steps else args.max_steps
        while self.step < stop:
            record = self.train_one_step()
            last = self.step == stop
            if (args.eval_steps and self.step % args.eval_steps == 0) or last:
                record["eval_loss"] = self.evaluate()
            record["elapsed_s"] = time.perf_counter() - started
            history.append(record)
            if log and (self.step % args.logging_steps == 0 or last or "eval_loss" in record):
                log.write(record)
            if bar:
                bar.update(self.step, {"loss": record["loss"], "lr": record["lr"], "tok/s": record["tokens_per_sec"]})
            self.finish_pending_save(only_if_written=True)
            if args.save_steps and (self.step % args.save_steps == 0 or last):
                self.save()
        self.finish_pending_save()
        if bar:
            bar.close()
        if log:
            log.close()
            plot_loss(output / "metrics.jsonl", output / "loss.png")
        return history
