"""The pretraining loop: build the layout, the model, the data and the optimizer, then step.

Everything that can be wrong with the request (flags, degrees, model split, data, tokenizer,
precision on this device) is checked before `init_distributed`, so a bad run fails on every rank
with the same message instead of hanging in a collective.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import paddle

from checkpoint.commit import clear_interrupted_saves, latest_checkpoint, unclaimed_checkpoints
from checkpoint.load import check_compatible, load_checkpoint
from checkpoint.optimizer_state import ensure_states
from checkpoint.save import PendingSave, save_checkpoint
from checkpoint.single_card_state import assign_single_card, init_single_card_weights
from modeling.blocks.indexer import is_indexer_parameter
from modeling.context_parallel import split_sequence
from modeling.lora import is_adapter
from modeling.loss import IGNORE_INDEX
from modeling.registry import build_causal_lm, plan_of
from paddle_pp.data.sampler import SequentialBatches
from paddle_pp.data.sft import SFTRows, build_sft, plan_sft
from paddle_pp.data.source import build_data, dataset_sizes, plan_data
from paddle_pp.data.tokenizer import load_text_tokenizer
from paddle_pp.interop.carried import CARRIED_DIR, carried_in
from paddle_pp.interop.lora_adapters import adapter_arrays, check_adapter_folder
from paddle_pp.interop.pretrained import load_pretrained, open_pretrained
from paddle_pp.interop.transformers_layout import TransformersWeights, checkpoint_config, load_resumed
from paddle_pp.runtime.fleet_wrappers import wrap_for_layout
from paddle_pp.runtime.layout import launched_rank
from paddle_pp.runtime.stage3 import SLICE_PREFIX
from paddle_pp.runtime.topology import Topology, align_ranks, gather_objects, init_distributed, rank0_first
from paddle_pp.training import gradient_path, precision
from paddle_pp.training.arguments import OptimizerArguments, PretrainArguments
from paddle_pp.training.expert_balance import update_correction_biases
from paddle_pp.training.grad_norm import ReportingGlobalNormClip
from paddle_pp.training.indexer_metrics import indexer_metrics
from paddle_pp.training.loss_plot import plot_loss
from paddle_pp.training.model_config import model_config, tokenizer_dir
from paddle_pp.training.output_lock import acquire, release
from paddle_pp.training.prediction_metrics import prediction_metrics
from paddle_pp.training.replicated_sync import needs_replicated_sync, sync_replicated
from paddle_pp.training.report import MetricsLog, VisualDLLog, read_metrics, training_bar
from paddle_pp.training.router_metrics import router_metrics, step_routing
from paddle_pp.training.run_plan import TrainingConfigError, plan_run
from paddle_pp.training.schedule import WarmupCosine
from paddle_pp.training.skips import merge, parse_intervals, skipped
from paddle_pp.training.step import eval_loss, replicas_sum, train_step


def _build_optimizer(model, args: OptimizerArguments, schedule: WarmupCosine, clip: ReportingGlobalNormClip):
    """AdamW over the trained weights (under LoRA the adapters only), decaying matrices only. Stage3
    hands the optimizer each large matrix as a flat slice named "slice@<name>", so the decay rule looks
    through that prefix (matching names as given, as PaddleNLP does, would silently stop decaying every
    sliced matrix)."""
    matrices = {p.name for p in model.parameters() if len(p.shape) >= 2}
    trained = [p for p in model.parameters() if not p.stop_gradient]
    return paddle.optimizer.AdamW(
        learning_rate=schedule, parameters=trained, beta1=args.adam_beta1, beta2=args.adam_beta2,
        epsilon=args.adam_epsilon, weight_decay=args.weight_decay, grad_clip=clip,
        apply_decay_param_fun=lambda name: name.removeprefix(SLICE_PREFIX) in matrices)


def refuse_foreign_checkpoints(output_dir: Path, resume_dir: Path | None) -> None:
    """Before anything is written: a fresh run into an --output_dir holding checkpoint folders another
    trainer wrote (no `latest` marker of ours) would replace one with a save of the same step."""
    unclaimed = unclaimed_checkpoints(output_dir) if resume_dir is None else []
    if unclaimed:
        raise TrainingConfigError(
            f"--output_dir {output_dir} holds {', '.join(unclaimed[:3])}{' ...' if len(unclaimed) > 3 else ''} that "
            "paddle-pp did not write (no 'latest' marker: a PaddleNLP or PaddleFormers run's?); a save of the same "
            "step would replace it. Choose another --output_dir, or resume a unified checkpoint there with "
            "--resume_from_checkpoint <folder>")


class Pretrainer:
    def __init__(self, args: PretrainArguments, after_update: Callable[[Pretrainer], None] | None = None):
        """Construction from the run's plan, in the order a job needs it: the plan (every refusal,
        before any process group), the output folder claimed, then the process groups, the model and
        its weights, the optimizer and the gradient path, a resumed state, and the data.
        `after_update` runs after each optimizer update, before gradients are cleared (the moment a
        rank holds parameters, gradients and optimizer states at once)."""
        self.args = args
        self.after_update = after_update
        self.routing = None  # the step's routing over the job (an MoE model's), read at each update
        self._plan()
        self._claim_output()
        self._build()
        self._load_data()

    def _plan(self) -> None:
        """The resume folder, the pretrained folder, the tokenizer, the model config and the run plan;
        a resumed checkpoint is checked against them. Nothing here needs another rank."""
        args, data = self.args, self.args.data
        # found before the output_dir lock: `latest` only ever moves forward, and a live writer fails the lock
        self.resume_dir = self._resume_folder()
        refuse_foreign_checkpoints(Path(args.output.output_dir), self.resume_dir)
        source = args.model.model_name_or_path
        self.pretrained = open_pretrained(
            Path(source), weights=self.resume_dir is None and args.model.continue_training,
            allow_unsafe_pickle=args.model.allow_unsafe_pickle,
            fresh_prediction_layers=args.model.fresh_prediction_layers) if source else None
        self.tokenizer = load_text_tokenizer(
            tokenizer_dir(data, self.pretrained.folder if self.pretrained else None, args.given))
        self.config = model_config(args.model, data.max_seq_length, self.tokenizer.vocab_size, self.pretrained,
                                   args.given)
        self.run_plan = plan_run(args, self.config, self.tokenizer.eos_id)
        self.layout, self.batches = self.run_plan.layout, self.run_plan.batches
        self.compute_dtype, self.execution = self.run_plan.compute_dtype, self.run_plan.execution
        if launched_rank() == 0:
            for note in (*self.run_plan.notes, *(self.pretrained.notes if self.pretrained else ())):
                print(f"note: {note}", file=sys.stderr)
        if args.model.lora_path:
            check_adapter_folder(Path(args.model.lora_path), self.config)
            if self.resume_dir is not None and launched_rank() == 0:
                print(f"note: --lora_path {args.model.lora_path} is not read: the adapters resume from "
                      f"{self.resume_dir}", file=sys.stderr)
        if self.resume_dir is not None:
            check_compatible(self.resume_dir, self.config, self.layout, checkpoint_config(self.resume_dir))
        # a multimodal folder's parts that do not train, carried into every checkpoint (from the folder, or the resumed one)
        self.carried = carried_in(self.resume_dir) if self.resume_dir is not None else \
            self.pretrained.carried if self.pretrained is not None else None
        self.carried_files: tuple[Path, ...] = ()
        self.weights_rewrite = TransformersWeights(self.config, self.carried) if args.checkpoint.save_to_hf else None
        sizes = dataset_sizes(self.batches.global_batch, args.optim.max_steps, args.output.eval_steps,
                              args.output.eval_iters)
        self.sft_plan = plan_sft(data.train_dataset_path, data.train_dataset_prob, data.eval_dataset_path,
                                 data.chat_template, data.max_seq_length, data.packing, data.truncation_strategy,
                                 data.seed, sizes[:2]) if data.train_dataset_path else None
        self.data_plan = None if self.sft_plan else plan_data(
            data.input_dir, data.corpus, self.tokenizer.folder, data.data_cache, data.split, data.data_impl,
            data.max_seq_length, data.seed, sizes, self.config.vocab_size, data.add_bos_token)
        self.train_samples, self.valid_samples = sizes[:2]
        optim = args.optim
        self.schedule = WarmupCosine(optim.learning_rate, self.run_plan.warmup_steps, optim.max_steps,
                                     optim.min_learning_rate, optim.lr_scheduler_type, optim.warmup_from_zero)
        self.skip_intervals = parse_intervals(args.checkpoint.skip_data_intervals)

    def _claim_output(self) -> None:
        """Rank 0 locks --output_dir (one writer at a time) and clears saves a stopped job left unfinished."""
        output_dir = Path(self.args.output.output_dir)
        self.lock = acquire(output_dir) if launched_rank() == 0 else None
        if self.lock is not None and self.carried is not None:  # written once: every save copies them
            self.carried_files = self.carried.write(output_dir / CARRIED_DIR)
        if self.lock is not None:
            cleared = clear_interrupted_saves(output_dir)
            if cleared:
                print(f"{output_dir}: cleared {len(cleared)} save(s) a stopped job left unfinished: "
                      f"{', '.join(cleared)}", file=sys.stderr)

    def _build(self) -> None:
        """The process groups, the model (its weights initialised, loaded or resumed), the optimizer
        with precision and the gradient path around fleet's wrappers, and a resumed state."""
        args, optim = self.args, self.args.optim
        self.topo: Topology = init_distributed(self.layout, self.batches.micro_batch, self.batches.accumulate_steps)
        paddle.seed(args.data.seed)
        raw = build_causal_lm(self.config, self.topo, self.execution)
        self.plan = plan_of(self.config)
        self.axes = self.plan.tp_axes(self.layout.tp)
        adapters = tuple(name for name in self.plan if is_adapter(name))
        if self.resume_dir is None and self.pretrained is not None and args.model.continue_training:
            # adapters start fresh, unless the folder is a LoRA run's with these settings (`model_config`)
            fresh = (*self.pretrained.fresh, *(() if self.pretrained.config.get("lora") else adapters))
            load_pretrained(replace(self.pretrained, fresh=fresh), raw, self.axes, self.topo)
            if fresh:  # counted by its config, absent from the folder: drawn as a run from flags would
                init_single_card_weights(raw, self.plan, self.topo, args.data.seed, args.model.initializer_range, fresh)
        elif self.resume_dir is None:
            init_single_card_weights(raw, self.plan, self.topo, args.data.seed, args.model.initializer_range)
        else:  # weights before the wrappers take the model (stage3 slices what it finds), states after
            resumed = load_resumed(self.resume_dir, raw, self.axes, self.topo)
        if adapters:
            self._start_adapters(raw)
        self.criterion = getattr(raw, "criterion", None)
        self.clip = ReportingGlobalNormClip(optim.max_grad_norm)
        optimizer = _build_optimizer(raw, optim, self.schedule, self.clip)
        precision.decorate(raw, optimizer, self.compute_dtype)
        if optim.amp_master_grad:
            optimizer = precision.accumulate_in_fp32(raw, optimizer, self.compute_dtype)
        gradient_path.before_wrapping(raw, self.topo)
        self.model, self.optimizer = wrap_for_layout(raw, optimizer, self.topo, args.layout.stage3_segment_size)
        gradient_path.after_wrapping(self.optimizer, raw, self.topo, self.clip, args.checkpoint.save_gradients)
        self.scaler = precision.loss_scaler(self.compute_dtype, self.layout, optim.scale_loss, optim.amp_master_grad)
        self.raw_model = raw
        self.consumed_samples, self.step = 0, 0
        # the optimizer and its wrappers took every weight; the warm-up freezes before states are loaded
        self._indexer_stage(resumed["step"] if self.resume_dir is not None else 0)
        if self.resume_dir is not None:
            if not args.checkpoint.ignore_load_lr_and_optim:
                load_checkpoint(self.resume_dir, raw, self.optimizer, self.topo, self.axes, weights=False)
            self._resume(state=resumed)
        self.pending_save: PendingSave | None = None

    def _start_adapters(self, raw) -> None:
        """LoRA: the adapters from --lora_path on a fresh start (a resume has its checkpoint's), and the model's
        own weights frozen, before the optimizer and the wrappers take the trained ones."""
        if self.args.model.lora_path and self.resume_dir is None:
            assign_single_card(raw, adapter_arrays(Path(self.args.model.lora_path), self.config)[1], self.axes,
                               self.topo)
        for name, param in raw.named_parameters():
            param.stop_gradient = not is_adapter(name)

    def _load_data(self) -> None:
        """The stages that read data build it (rank 0 first: it writes the index files); all align."""
        if self.sft_plan is not None:  # no files written: each reading rank renders the same rows
            self.train_data, self.valid_data = (build_sft(self.sft_plan, self.tokenizer) if self.needs_data
                                                else (None, None))
            if self.train_data is not None and self.topo.global_rank == 0:
                for note in (*self.train_data.notes, *(self.valid_data.notes if self.valid_data else ())):
                    print(f"note: {note}", file=sys.stderr)
        else:
            self.train_data, self.valid_data = (
                rank0_first(self.topo, "data", lambda: build_data(self.data_plan)) if self.needs_data else (None, None))
        align_ranks(self.topo)  # only the stages reading data built it; the others wait in p2p
        self.sampler = SequentialBatches(self.train_samples, self.batches.global_batch)
        self.supervised_tokens = 0  # the labels counted in the last global batch read (`batch_tensors`)

    def _resume_folder(self) -> Path | None:
        """The checkpoint to resume from (checked against the model once its config is known, still
        before any process group exists); None for a fresh start, including 'latest' with nothing saved."""
        wanted = self.args.checkpoint.resume_from_checkpoint
        if not wanted:
            return None
        return latest_checkpoint(Path(self.args.output.output_dir)) if wanted == "latest" else Path(wanted)

    def _resume(self, state: dict) -> None:
        """Step, data position, schedule and skipped intervals from a loaded trainer state, as the
        resume flags allow (PaddleNLP's `ignore_load_lr_and_optim` and `ignore_data_skip`)."""
        ckpt = self.args.checkpoint
        self.step = state["step"]
        self.consumed_samples = 0 if ckpt.ignore_data_skip else state["consumed_samples"]
        if not ckpt.ignore_load_lr_and_optim:
            self.schedule.set_state_dict(state["lr_scheduler"])
            precision.restore_scaler(self.scaler, state.get("loss_scaler", {}))
        self.skip_intervals = merge(self.skip_intervals, state.get("skip_data_intervals", []))
        saved_samples = state.get("train_samples", self.train_samples)
        if saved_samples != self.train_samples and self.topo.global_rank == 0:
            print(f"warning: the training dataset is built for {self.train_samples} samples (--max_steps x "
                  f"global batch) but the checkpoint's run used {saved_samples}; the sample order after this step "
                  "follows the new size (as in PaddleNLP), not the original run's", file=sys.stderr)

    def save(self) -> None:
        """A unified checkpoint of this step; with --async_save the files are written in the background."""
        self.finish_pending_save()
        ckpt = self.args.checkpoint
        trainer_state = {"step": self.step, "consumed_samples": self.consumed_samples, "seed": self.args.data.seed,
                         "lr_scheduler": self.schedule.state_dict(), "max_steps": self.args.optim.max_steps,
                         "global_batch_size": self.batches.global_batch, "args": self.args.flat(),
                         "train_samples": self.train_samples,
                         "skip_data_intervals": [list(pair) for pair in self.skip_intervals],
                         "loss_scaler": precision.scaler_state(self.scaler)}
        self.pending_save = save_checkpoint(
            Path(self.args.output.output_dir), self.step, self.raw_model, self.optimizer, self.topo, self.plan,
            config=self.config, trainer_state=trainer_state,
            extra_files=(*self.tokenizer.files(), *self.carried_files), keep=ckpt.save_total_limit,
            asynchronous=ckpt.async_save, gradients=gradient_path.recorded_gradients(self.optimizer) if ckpt.save_gradients else None,
            replica_check=ckpt.replica_check, rewrite=self.weights_rewrite)
        if not ckpt.async_save:
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
        """Inputs enter at the first stage and labels where the head is: the last stage, or under
        DualPipeV the first (its V turns back); other stages read nothing."""
        return self.topo.is_first_stage or self.topo.pp_rank == self.layout.head_stage

    def batch_tensors(self, dataset, indices):
        """(inputs, labels) of the samples at `indices`: each sample's first and last seq_length ids
        (under context parallelism this rank's chunks of them); packed fine-tuning rows give their
        inputs as (ids, positions inside each sample). Under the loss per optimizer step the step's
        supervised tokens are counted here, before the split."""
        if dataset is None:
            return None, None
        if isinstance(dataset, SFTRows):
            inputs, labels, positions = dataset.batch(indices)
        else:
            rows = np.stack([dataset[int(i)] for i in indices])
            inputs, labels, positions = rows[:, :-1], rows[:, 1:], None
        self.supervised_tokens = int((labels != IGNORE_INDEX).sum())
        if self.topo.ring is not None:
            inputs, labels, positions = (None if x is None else split_sequence(x, self.topo.ring.degree,
                                                                                self.topo.ring.rank)
                                         for x in (inputs, labels, positions))
        inputs = paddle.to_tensor(inputs) if positions is None else (paddle.to_tensor(inputs),
                                                                     paddle.to_tensor(positions))
        return inputs, paddle.to_tensor(labels)

    def skip_one_step(self) -> dict:
        """Advance step, data position and schedule past a skipped step's global batch, unread."""
        record = {"step": self.step + 1, "skipped": True, "consumed_samples": self.consumed_samples}
        self.schedule.step()
        self.step += 1
        self._indexer_stage(self.step)
        self.consumed_samples += self.batches.global_batch
        return record

    def _updated(self) -> None:
        """Right after each optimizer update: the TP replicas' sync under stage2/3, the experts'
        correction biases by the step's loads (DeepSeek-V3's balancing), then the hook."""
        if needs_replicated_sync(self.topo):
            sync_replicated(self.raw_model, self.optimizer, self.axes, self.topo)
        self.routing = step_routing(self.execution.router_stats, self.config, self.topo)
        if self.routing is not None and not self.execution.indexers.dense:  # frozen too in the warm-up
            update_correction_biases(self.raw_model, self.routing.loads, self.args.optim.moe_router_bias_update_rate)
        if self.after_update:
            self.after_update(self)

    def _indexer_stage(self, step: int) -> None:
        """Sparse attention's stage for the steps from `step` on (`--indexer_dense_warmup_steps`): in the
        dense warm-up every weight but the indexers' is frozen (no gradient, so the optimizer leaves it and
        its states alone); leaving it, the optimizer's states of the weights it froze are made, as a
        first update would make them, so a checkpoint of any step holds what the next step needs."""
        warmup = self.args.model.indexer_dense_warmup_steps
        dense = step < warmup
        if not warmup or dense == self.execution.indexers.dense:
            return
        self.execution.indexers.dense = dense
        for name, param in self.raw_model.named_parameters():
            if not is_indexer_parameter(name):
                param.stop_gradient = dense
        if not dense:
            ensure_states(self.optimizer)

    def train_one_step(self) -> dict:
        """One update (and the `after_update` hook right after it, before gradients are cleared)."""
        started = time.perf_counter()
        consumed = self.consumed_samples
        indices = self.sampler.replica_batch(self.consumed_samples, self.topo.data_replica_index,
                                             self.topo.data_replica_count)
        inputs, labels = self.batch_tensors(self.train_data, indices)
        self._weigh_tokens(labels, self.batches.accumulate_steps)
        lr = self.schedule.last_lr  # the rate this update applies (after a resume: the saved one)
        loss = train_step(self.model, self.optimizer, self.criterion, inputs, labels, self.topo,
                          self.batches.accumulate_steps, self.compute_dtype, self.scaler, self._updated)
        self.execution.step_loss.clear()  # evaluation takes each batch's mean
        updated = precision.optimizer_ran(self.scaler)
        if updated:  # as PaddleNLP: an fp16 step skipped for overflow does not advance the schedule
            self.schedule.step()
        self.step += 1
        self._indexer_stage(self.step)
        self.consumed_samples += self.batches.global_batch
        seconds = time.perf_counter() - started
        record = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": self.clip.pop_norm(),
                  "tokens_per_sec": self.batches.global_batch * self.args.data.max_seq_length / seconds,
                  "consumed_samples": consumed, **router_metrics(self.routing, self.config, self.topo, self.raw_model),
                  **prediction_metrics(self.execution.prediction_losses, self.config, self.topo),
                  **indexer_metrics(self.execution.indexers, self.config, self.topo)}
        return record if updated else {**record, "update_skipped": True}

    def _weigh_tokens(self, labels, micro_batches: int) -> None:
        """Under the loss per step, each supervised token's weight in the global batch about to run, on the
        ranks that compute the loss (`micro_batches`: how many losses the schedule divides by)."""
        if self.args.optim.calculate_per_token_loss and labels is not None:
            self.execution.step_loss.set_step(replicas_sum(self.supervised_tokens, self.topo), micro_batches,
                                              self.topo.data_replica_count)

    def evaluate(self) -> float:
        """Mean loss over the first `eval_iters` global batches of the valid split (the same
        samples at every evaluation, so the curve compares like with like); under the loss per step,
        each global batch's loss per supervised token."""
        valid = SequentialBatches(self.valid_samples, self.batches.global_batch)
        losses = []
        for it in range(self.args.output.eval_iters):
            indices = valid.replica_batch(it * self.batches.global_batch, self.topo.data_replica_index,
                                          self.topo.data_replica_count)
            inputs, labels = self.batch_tensors(self.valid_data, indices)
            # the pipeline divides each micro-batch's loss by their count; one card computes its rows at once
            self._weigh_tokens(labels, self.batches.accumulate_steps if self.layout.pp > 1 else 1)
            losses.append(eval_loss(self.model, self.criterion, inputs, labels, self.topo, self.compute_dtype))
            self.execution.step_loss.clear()
        return float(np.mean(losses))

    def train(self) -> list[dict]:
        """Run to `--max_steps`; rank 0 writes metrics.jsonl, shows progress and plots loss.svg."""
        out, max_steps, is_writer = self.args.output, self.args.optim.max_steps, self.topo.global_rank == 0
        save_steps = self.args.checkpoint.save_steps
        output = Path(out.output_dir)
        log = MetricsLog(output / "metrics.jsonl", resume_step=self.step) if is_writer else None
        board = (VisualDLLog(Path(out.logging_dir or output / "runs"))
                 if is_writer and out.report_to == "visualdl" else None)
        if log and (log.torn_lines or log.superseded):
            print(f"metrics.jsonl: dropped {log.torn_lines} torn line(s) and {log.superseded} record(s) of steps "
                  f"after {self.step}, which this run trains again", file=sys.stderr)
        bar = training_bar(max_steps, self.step) if is_writer and not out.disable_progress_bar else None
        started, history = time.perf_counter(), []
        evaluates = out.do_eval and (self.sft_plan is None or bool(self.sft_plan.eval_paths))
        stop = min(max_steps, self.step + out.exit_after_steps) if out.exit_after_steps else max_steps
        while self.step < stop:
            record = self.skip_one_step() if skipped(self.step + 1, self.skip_intervals) else self.train_one_step()
            last = self.step == stop
            if evaluates and ((out.eval_steps and self.step % out.eval_steps == 0) or last):
                record["eval_loss"] = self.evaluate()
            record["elapsed_s"] = time.perf_counter() - started
            history.append(record)
            if log and (self.step % out.logging_steps == 0 or last or "eval_loss" in record):
                log.write(record)
                if board:
                    board.write(record)
            if bar:
                if "loss" in record:
                    extra = {name: f"{record[name]:.4g}" for name in ("mtp_loss", "indexer_loss") if name in record}
                    bar.set_postfix(loss=f"{record['loss']:.4g}", **extra, lr=f"{record['lr']:.3g}",
                                    tok_s=f"{record['tokens_per_sec']:.0f}", refresh=False)
                bar.update(1)
            self.finish_pending_save(only_if_written=True)
            if save_steps and (self.step % save_steps == 0 or last):
                self.save()
        self.finish_pending_save()
        if bar:
            bar.close()
        if board:
            board.close()
        if log:
            log.close()
            plot_loss(read_metrics(output / "metrics.jsonl"), output / "loss.svg")
        if self.lock is not None:
            release(self.lock)
        return history
