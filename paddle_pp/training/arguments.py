"""Pretraining arguments: typed groups under PaddleNLP's flag names, a YAML file as defaults, the
command line on top."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from modeling.attention_core import PINNED
from modeling.execution import GRANULARITIES
from modeling.registry import FAMILIES
from paddle_pp.runtime.flags import add_flags, boolean_flags, flag, flags_table, read_flags
from paddle_pp.runtime.layout import LayoutArguments, add_layout_args, launched_rank
from paddle_pp.training.paddleformers_recipes import PADDLEFORMERS, is_paddleformers_recipe
from paddle_pp.training.recipes import PADDLENLP, RecipeError, load_recipe, read_recipe
from paddle_pp.training.schedule import DECAYS


@dataclass
class ModelArguments:
    model_name_or_path: str = flag("", "start from this folder's model: a paddle-pp checkpoint, a PaddleNLP "
                                       "save_pretrained folder or a transformers folder of any family below (its "
                                       "config.json sets the shape flags below; its tokenizer is used unless "
                                       "--tokenizer_dir is given)")
    continue_training: bool = flag(True, "with --model_name_or_path: load its weights (--no-continue_training: its "
                                         "config only, random weights; PaddleNLP's default is the latter)")
    model_type: str = flag("llama", "model family", choices=sorted(FAMILIES))
    hidden_size: int = flag(256, "model width")
    intermediate_size: int = flag(688, "MLP width")
    num_hidden_layers: int = flag(4, "decoder layers")
    num_attention_heads: int = flag(8, "attention heads")
    num_key_value_heads: int = flag(0, "kv heads for GQA (0: as many as attention heads; not GPT)")
    head_dim: int = flag(0, "width of a head (0: hidden_size / num_attention_heads; not GPT)")
    tie_word_embeddings: bool = flag(False, "the head is the token embedding (default: the family's; GPT and "
                                            "Gemma tie, the others do not)")
    allow_unsafe_pickle: bool = flag(False, "with a pdparams --model_name_or_path: read it with paddle.load, which "
                                            "runs any code the file carries (only for a folder you trust; default: "
                                            "data only, see docs/known-problems.md, Security)")
    fresh_prediction_layers: bool = flag(False, "with a --model_name_or_path folder whose config counts multi-token "
                                                "prediction layers it does not hold (transformers saves none): train "
                                                "them from fresh weights (default: without them, as transformers "
                                                "reads the folder)")
    initializer_range: float = flag(0.02, "std of the initial matrices")
    recompute: bool = flag(False, "recompute activations in backward instead of keeping them (what: "
                                  "--recompute_granularity)")
    recompute_granularity: str = flag("full", "with --recompute, what is recomputed: full (each decoder layer), "
                                              "full_attn (its attention block), core_attn (the attention core)",
                                      choices=list(GRANULARITIES))
    recompute_use_reentrant: bool = flag(False, "with --recompute: Paddle's reentrant (PyLayer) recompute instead of "
                                                "the hook-based one; the same numbers")
    pp_recompute_interval: int = flag(1, "decoder layers per recomputed segment (PaddleNLP's pipeline option): "
                                         "each layer is one segment here, so only 1 (or 0, the same) is accepted")
    use_flash_attention: bool = flag(True, "memory-efficient attention: Paddle's flash kernel where it applies (GPU, "
                                           "bf16/fp16, head_dim <= 256 and a multiple of 8), the blockwise core "
                                           "elsewhere (on CPU the dense core under 1024 tokens where it fits, the "
                                           "faster there); --no-use_flash_attention: the dense core (keeps every "
                                           "score)")
    attention_core: str = flag("auto", "pin the attention core on any device: blockwise (keeps O(seq)) or dense "
                                       "(keeps every score); auto: as --use_flash_attention chooses",
                               choices=list(PINNED))
    indexer_loss_coef: float = flag(1.0, "sparse attention (DeepSeek-V3.2, GLM-5): the weight of each layer's "
                                         "indexer KL loss, which trains the indexer alone (0: it does not)")
    indexer_dense_warmup_steps: int = flag(0, "sparse attention: the DeepSeek-V3.2 report's dense warm-up, these "
                                              "first steps attending to every earlier key with every weight but the "
                                              "indexers frozen, the indexers trained towards that attention")
    use_global_causal_attn: bool = flag(True, "one causal stream per packed sample (PaddleNLP's run_pretrain); "
                                              "--no-use_global_causal_attn: each token attends only inside its "
                                              "document (ended by the tokenizer's end-of-sequence token) and "
                                              "positions restart per document (PaddleFormers' pretraining default)")
    reset_position_ids: bool = flag(False, "positions restart after every end-of-sequence token while attention "
                                           "spans the packed sample (Megatron's name; what PaddleFormers trains "
                                           "with use_global_causal_attn: true); implied by "
                                           "--no-use_global_causal_attn")
    lora: bool = flag(False, "train LoRA adapters beside the frozen model's projections (PaddleNLP's name; only the "
                             "adapters are trained and in the optimizer)")
    lora_rank: int = flag(8, "with --lora: the adapters' rank r")
    lora_alpha: float = flag(-1.0, "with --lora: alpha, the update scaled by alpha / r (alpha / sqrt(r) with --rslora); "
                                   "-1: 2 x r, what PaddleFormers trains whatever its recipe says")
    lora_dropout: float = flag(0.0, "with --lora: dropout on each adapter's input")
    lora_target_modules: str = flag("all-linear", "with --lora: the adapted projections, comma-separated: module names "
                                                  "(PEFT's target_modules: q_proj,v_proj), regular expressions over "
                                                  "whole paths (PaddleFormers': .*layers\\.1\\..*q_proj), or "
                                                  "all-linear (every projection but routers and the head)")
    rslora: bool = flag(False, "with --lora: rank-stabilised scale alpha / sqrt(r)")
    lora_plus_scale: float = flag(1.0, "with --lora: LoRA+, B's learning rate this many times A's")
    lora_path: str = flag("", "with --lora: start the adapters from a PEFT (adapter_config.json) or PaddleFormers "
                              "(lora_config.json) adapter folder of this model (its rank, alpha and rsLoRA must be the "
                              "flags')")
    use_fused_rope: bool = flag(False, "Paddle's fused rotary kernel (GPU only; elsewhere the reference op, noted)")
    use_fused_rms_norm: bool = flag(False, "Paddle's fused RMSNorm kernel (GPU only; elsewhere the reference op, "
                                           "noted)")
    hidden_dropout_prob: float = flag(0.0, "GPT's hidden dropout (PaddleNLP's run_pretrain default is 0.1): dropout is "
                                           "not modelled, so a family with dropout refuses any other value than 0")
    attention_probs_dropout_prob: float = flag(0.0, "GPT's attention dropout (PaddleNLP's default 0.1): as "
                                                    "--hidden_dropout_prob")


@dataclass
class DataArguments:
    input_dir: str = flag("", "prepared data (.bin/.idx): a prefix, a folder of prefixes, or a weighted blend "
                              "'w1 prefix1 w2 prefix2 ...'; empty: --corpus, preprocessed on first use")
    split: str = flag("949,50,1", "train/valid/test shares of the documents")
    data_impl: str = flag("mmap", "format of the prepared data (only PaddleNLP's 'mmap')")
    corpus: Path = flag(Path("data/jargon-4.4.7.txt"), "UTF-8 training text (blank lines separate documents), "
                                                     "used when --input_dir is empty")
    tokenizer_dir: Path = flag(Path("data/tokenizer"), "tokenizer folder: tokenizer.model (SentencePiece) or one "
                                                       "PaddleNLP's AutoTokenizer loads")
    data_cache: Path = flag(Path("data/cache"), "folder for index files and the preprocessed --corpus")
    add_bos_token: bool = flag(True, "begin each --corpus document as the tokenizer begins a text (tokenizer_config."
                                     "json's add_bos_token, tokenizer.json's template: Gemma's <bos>, Llama 3's "
                                     "<|begin_of_text|>); false: documents as PaddleNLP's preprocessing makes them")
    train_dataset_path: str = flag("", "fine-tune on chat data: JSON-lines files (comma-separated sources) of OpenAI "
                                       "'messages' (+ 'tools') or ERNIEKit 'src'/'tgt' (+ 'system', 'label') samples, "
                                       "rendered by the model folder's chat template; only assistant turns train")
    train_dataset_prob: str = flag("", "with several --train_dataset_path sources: each one's probability "
                                       "(comma-separated; default: equal)")
    eval_dataset_path: str = flag("", "chat data evaluated every --eval_steps (default: none, and no evaluation)")
    chat_template: str = flag("", "a .jinja chat template in place of the model folder's")
    packing: bool = flag(False, "bin-pack fine-tuning samples into rows of --max_seq_length, attention and positions "
                                "restarting at each sample (default: one sample per row, padded)")
    truncation_strategy: str = flag("delete", "a fine-tuning sample longer than --max_seq_length: dropped, or its "
                                              "first (right) or last (left) tokens kept",
                                    choices=["delete", "right", "left"])
    max_seq_length: int = flag(128, "tokens per training sample")
    per_device_train_batch_size: int = flag(4, "micro-batch size per data replica")
    gradient_accumulation_steps: int = flag(2, "micro-batches per step (the pipeline's accumulate steps)")
    global_batch_size: int = flag(0, "samples per step; 0 derives micro x accumulation x dp x sharding")
    seed: int = flag(42, "seed of weights and data order")


@dataclass
class OptimizerArguments:
    learning_rate: float = flag(3e-3, "peak learning rate")
    min_learning_rate: float = flag(3e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = flag(20, "linear warmup steps")
    warmup_ratio: float = flag(0.0, "warmup as a share of --max_steps, used unless --warmup_steps is given")
    lr_scheduler_type: str = flag("cosine", "decay after warmup", choices=sorted(DECAYS))
    warmup_from_zero: bool = flag(False, "warm up as transformers and PaddleFormers do, peak x step / warmup (0 at "
                                         "the first step), instead of peak x (step + 1) / warmup (PaddleNLP's "
                                         "pretraining, Megatron); PaddleFormers' recipes set it")
    max_steps: int = flag(300, "optimizer steps")
    weight_decay: float = flag(0.1, "AdamW decay, applied to matrices only")
    adam_beta1: float = flag(0.9, "AdamW beta1")
    adam_beta2: float = flag(0.95, "AdamW beta2")
    adam_epsilon: float = flag(1e-8, "AdamW epsilon")
    max_grad_norm: float = flag(1.0, "global-norm clip across all hybrid groups")
    calculate_per_token_loss: bool = flag(False, "the loss per optimizer step: summed token losses over the step's "
                                                 "supervised tokens across micro-batches and data ranks (Megatron's "
                                                 "name; run_finetune.py's default), instead of a mean per micro-batch "
                                                 "(the same when every token counts, as in pretraining)")
    bf16: bool = flag(False, "bfloat16 compute with fp32 master weights (GPU only)")
    fp16: bool = flag(False, "float16 compute with loss scaling and fp32 master weights (GPU only)")
    amp_master_grad: bool = flag(False, "keep fp32 gradients under --bf16/--fp16")
    scale_loss: float = flag(2.0**15, "initial loss scale of --fp16's dynamic loss scaling (halved after each "
                                      "overflowed step, doubled after 1000 clean ones)")
    moe_router_bias_update_rate: float = flag(1e-3, "DeepSeek-V3's aux-loss-free balancing: each step, each MoE "
                                                    "layer's correction bias moves by this x sign(mean load - load) "
                                                    "(routers with a correction bias only; 0 freezes it)")


@dataclass
class OutputArguments:
    output_dir: Path = flag(Path("output"), "metrics.jsonl, loss.svg and checkpoints go here")
    logging_steps: int = flag(1, "write metrics every N steps")
    eval_steps: int = flag(0, "evaluate every N steps (0: only at the end)")
    eval_iters: int = flag(2, "global batches of held-out data per evaluation")
    do_eval: bool = flag(True, "evaluate on the valid split (every --eval_steps and at the end); false: never")
    disable_progress_bar: bool = flag(False, "no progress bar")
    report_to: str = flag("none", "also write the metrics as VisualDL scalars (rank 0)", choices=["none", "visualdl"])
    logging_dir: str = flag("", "VisualDL log folder (empty: output_dir/runs)")
    exit_after_steps: int = flag(0, "stop this run after N steps (saving if --save_steps > 0) while the schedule "
                                    "still spans --max_steps: for job time limits; 0: run to --max_steps")


@dataclass
class CheckpointArguments:
    save_steps: int = flag(0, "save a unified checkpoint every N steps (0: never; the last step is saved when > 0)")
    save_total_limit: int = flag(0, "keep at most N checkpoints, deleting the oldest (0: keep all)")
    resume_from_checkpoint: str = flag("", "a checkpoint folder, or 'latest' for output_dir's newest committed one")
    async_save: bool = flag(False, "write checkpoints in the background while training continues")
    save_to_hf: bool = flag(False, "keep each checkpoint's weights in transformers' names and layout with its "
                                   "config.json (PaddleFormers' name): the folder loads in transformers as it is and "
                                   "still resumes under any layout; costs one more write of the weights per save")
    save_gradients: bool = flag(False, "also write the last step's reduced, unclipped gradients into each checkpoint "
                                       "(tools/check_alignment.py compares them)")
    ignore_load_lr_and_optim: bool = flag(False, "resume weights, step and data position only: fresh optimizer "
                                                 "states and a fresh learning-rate schedule")
    ignore_data_skip: bool = flag(False, "resume without skipping the samples the checkpoint consumed (data from "
                                         "the start)")
    skip_data_intervals: str = flag("", "global batches of these steps are skipped, e.g. '[[100, 120]]' (1-based, "
                                        "inclusive; kept in checkpoints, so later resumes skip them too)")
    replica_check: str = flag("error", "before each save, compare checksums of tensors that must be equal on every "
                                       "replica (TP-replicated, data-parallel, tied): error fails the save, warn "
                                       "writes and warns", choices=["error", "warn"])


GROUPS = {"model": ModelArguments, "data": DataArguments, "optim": OptimizerArguments, "output": OutputArguments,
          "checkpoint": CheckpointArguments}


@dataclass
class PretrainArguments:
    model: ModelArguments
    data: DataArguments
    optim: OptimizerArguments
    output: OutputArguments
    checkpoint: CheckpointArguments
    layout: LayoutArguments
    given: frozenset[str] = frozenset()  # flags set on the command line or in a config file, not defaulted

    def flat(self) -> dict[str, Any]:
        """Every flag by its name (what trainer_state.json records and `check_alignment` replays)."""
        values = {}
        for name in (*GROUPS, "layout"):
            values |= {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(getattr(self, name)).items()}
        return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Pretrain a LLaMA, Mistral, Qwen2, Qwen3, Gemma or GPT model under any data x sharding x "
                    "tensor x pipeline layout.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", type=Path, default=None,
                        help="YAML file of flag: value defaults, a PaddleNLP argument file (.json) or a PaddleFormers "
                             "pretraining recipe (.yaml with stage: PT)")
    parser.add_argument("recipe", type=Path, nargs="?", default=None,
                        help="a PaddleNLP pretraining argument file (.json), as llm/run_pretrain.py takes, or a "
                             "PaddleFormers recipe (.yaml)")
    return add_trainer_flags(parser)


FINETUNE_DEFAULTS = {"calculate_per_token_loss": True}  # run_finetune.py's, under the same flags


def parse_args(argv: Sequence[str] | None = None, defaults: dict[str, Any] | None = None) -> PretrainArguments:
    """Command line over config files over built-in defaults: a YAML file of our flags (--config; an
    unknown key is an error), or a recipe (the first argument, or --config): PaddleNLP's JSON or
    PaddleFormers' YAML (it names a `stage`), its fields translated, named as changing nothing, or
    refused."""
    parser = build_parser()
    parser.set_defaults(**(defaults or {}))
    first, _ = parser.parse_known_args(argv)
    known = {action.dest for action in parser._actions}
    from_file: dict[str, Any] = {}
    recipe_path, recipe_values = first.recipe, None
    if first.config is not None:
        if not first.config.is_file():
            parser.error(f"--config {first.config} does not exist")
        loaded = None if first.config.suffix == ".json" else yaml.safe_load(first.config.read_text()) or {}
        if loaded is None or (isinstance(loaded, dict) and is_paddleformers_recipe(loaded)):  # .json: always a recipe
            if recipe_path is not None:
                parser.error(f"two recipes: {recipe_path} and --config {first.config}; pass one")
            recipe_path, recipe_values = first.config, loaded
        else:
            from_file = loaded
            unknown = sorted(set(from_file) - known)
            if unknown:
                parser.error(f"{first.config}: unknown keys {unknown}")
    if recipe_path is not None:
        if recipe_path.suffix not in (".json", ".yaml", ".yml"):
            parser.error(f"{recipe_path}: a recipe is a PaddleNLP .json argument file or a PaddleFormers .yaml one")
        try:
            recipe_values = load_recipe(recipe_path) if recipe_values is None else recipe_values
            dialect = PADDLEFORMERS if is_paddleformers_recipe(recipe_values) else PADDLENLP
            recipe, notes = read_recipe(recipe_path, known, boolean_flags(parser), recipe_values, dialect)
        except RecipeError as err:
            parser.error(str(err))
        from_file |= recipe
        if launched_rank() == 0:
            for note in notes:
                print(f"{recipe_path.name}: {note}", file=sys.stderr)
    for action in parser._actions:
        if action.choices is not None and action.dest in from_file and from_file[action.dest] not in action.choices:
            parser.error(f"{action.dest}: {from_file[action.dest]!r} is not one of {sorted(action.choices)}")
    parser.set_defaults(**from_file)
    return arguments_of(parser.parse_args(argv), frozenset(from_file) | _given_on_command_line(argv))


def add_trainer_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The trainer's flags, every group (a tool that plans a run takes them as the trainer does)."""
    for name, group in GROUPS.items():
        add_flags(parser, group, name)
    return add_layout_args(parser)


def arguments_of(namespace: argparse.Namespace, given: frozenset[str]) -> PretrainArguments:
    """The groups of a namespace `add_trainer_flags` parsed; `given`: the flags the user set."""
    return PretrainArguments(**{name: read_flags(group, namespace) for name, group in GROUPS.items()},
                             layout=read_flags(LayoutArguments, namespace), given=given)


def _given_on_command_line(argv: Sequence[str] | None) -> frozenset[str]:
    """The flags the command line sets, whatever their value (a default repeated is still a choice)."""
    quiet = build_parser()
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    return frozenset(vars(quiet.parse_args(argv)))


FLAGS_DOC_HEAD = """# Flags of run_pretrain.py (and of tools/reshard.py plan)

Written by `tools/flags_table.py` from the argument groups (`paddle_pp/training/arguments.py`,
`paddle_pp/runtime/layout.py`); `tests/test_docs.py` fails when this file differs from them. Every flag
overrides a `--config` YAML file or a PaddleNLP / PaddleFormers recipe; a boolean flag takes
`--name`, `--name true|false` or `--no-name`.

"""


def flags_document() -> str:
    """docs/flags.md: every flag of the trainer, by group."""
    return FLAGS_DOC_HEAD + flags_table({**GROUPS, "layout": LayoutArguments})
