"""The model a run trains: its config from the shape flags, or from `--model_name_or_path`'s
config.json (shape flags that contradict it are refused, not silently overridden), and the
tokenizer folder that goes with it."""

from __future__ import annotations

from pathlib import Path

from modeling.config import ModelConfigError
from modeling.lora import LoRA
from modeling.registry import config_from_dict, family
from modeling.transformers_adapter import model_fields
from paddle_pp.data.tokenizer import load_text_tokenizer, tokenizer_files
from paddle_pp.interop.pretrained import PretrainedFolder
from paddle_pp.runtime.errors import UserError
from paddle_pp.training.arguments import DataArguments, ModelArguments, PretrainArguments


class ModelSourceError(UserError, ValueError):
    """Flags that contradict the model folder they start from."""


# flag -> config.json field, for the flags that shape the network (a family takes those its config has)
SHAPE_FLAGS = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
               "num_hidden_layers": "num_hidden_layers", "num_attention_heads": "num_attention_heads",
               "num_key_value_heads": "num_key_value_heads", "head_dim": "head_dim",
               "tie_word_embeddings": "tie_word_embeddings"}


def _flag_value(args: ModelArguments, flag: str, hidden_size: int, heads: int):
    """A shape flag's value for a model of `hidden_size` and `heads` (0 means derived: as many kv
    heads as heads, head_dim hidden_size / heads)."""
    value = getattr(args, flag)
    if not value and flag in ("num_key_value_heads", "head_dim"):
        return heads if flag == "num_key_value_heads" else hidden_size // heads
    return value


def tokenizer_dir(data: DataArguments, model_folder: Path | None, given: frozenset[str]) -> Path:
    """--tokenizer_dir when given; else the model folder's tokenizer when it has one; else the default."""
    if model_folder is not None and "tokenizer_dir" not in given and tokenizer_files(model_folder):
        return model_folder
    return Path(data.tokenizer_dir)


def end_of_document(args: PretrainArguments, model_folder: Path | None) -> int | None:
    """The token that ends documents, from the tokenizer a run of `args` would read (the model
    folder's, or --tokenizer_dir), read only when the flags ask for documents (a plan's input)."""
    if args.model.use_global_causal_attn and not args.model.reset_position_ids:
        return None
    return load_text_tokenizer(tokenizer_dir(args.data, model_folder, args.given)).eos_id


def model_config(args: ModelArguments, max_seq_length: int, tokenizer_vocab: int,
                 pretrained: PretrainedFolder | None = None, given: frozenset[str] = frozenset()):
    """The config to build. From flags, the vocabulary is the tokenizer's; from a folder, everything
    is the folder's, the tokenizer must fit its vocabulary, and the sequence its positions."""
    if args.fresh_prediction_layers and (pretrained is None or not pretrained.fresh):
        raise ModelSourceError(
            f"--fresh_prediction_layers: {pretrained.folder if pretrained else 'a run without --model_name_or_path'} "
            "has no multi-token prediction layers to start fresh (its config counts none, or the folder holds them); "
            "drop the flag")
    if pretrained is None:
        fields = model_fields(family(args.model_type).config_class)
        values = dict(model_type=args.model_type, vocab_size=tokenizer_vocab, max_position_embeddings=max_seq_length,
                      initializer_range=args.initializer_range)
        values |= {field: _flag_value(args, flag, args.hidden_size, args.num_attention_heads)
                   for flag, field in SHAPE_FLAGS.items()
                   if field in fields and (flag != "tie_word_embeddings" or flag in given)}
        return _checked(config_from_dict(values | adapters_of(args)), max_seq_length)
    values = dict(pretrained.config)
    if values.get("lora") and values["lora"] != adapters_of(args).get("lora"):
        raise ModelSourceError(f"{pretrained.folder} holds LoRA adapters {values['lora']} (config.json's lora) and the "
                               f"flags ask for {adapters_of(args).get('lora')}: start from it with --lora and its "
                               "settings (its adapters are read), or merge them into the weights first "
                               "(tools/lora.py merge)")
    if "model_type" in given and family(args.model_type).model_type != values["model_type"]:
        raise ModelSourceError(f"--model_type {args.model_type} contradicts {pretrained.folder}/config.json "
                               f"(model_type {values['model_type']!r}); drop the flag")
    fields = model_fields(family(values["model_type"]).config_class)
    for flag, field in SHAPE_FLAGS.items():
        if flag not in given or field not in fields:
            continue
        current_config = config_from_dict(values)
        wanted = _flag_value(args, flag, current_config.hidden_size, current_config.num_attention_heads)
        current = getattr(current_config, field)
        if args.continue_training and wanted != current:
            raise ModelSourceError(
                f"--{flag} {getattr(args, flag)} contradicts {pretrained.folder}/config.json ({field}: "
                f"{current!r}); drop the flag (the folder's model is loaded), or pass "
                "--no-continue_training to train its config with other shapes from random weights")
        values[field] = wanted
    if tokenizer_vocab > values["vocab_size"]:
        raise ModelSourceError(
            f"the tokenizer has {tokenizer_vocab} tokens but {pretrained.folder}'s embedding has "
            f"{values['vocab_size']} rows (vocab_size): its ids would index past the embedding; use the model's own tokenizer "
            f"(drop --tokenizer_dir) or one of at most {values['vocab_size']} tokens")
    return _checked(config_from_dict(values | {"initializer_range": args.initializer_range} | adapters_of(args)),
                    max_seq_length, pretrained.folder)


def adapters_of(args: ModelArguments) -> dict:
    """The config field of the LoRA the flags ask for, as config.json keeps it ({}: no --lora)."""
    if not args.lora:
        return {}
    if args.lora_rank < 1 or not 0.0 <= args.lora_dropout < 1.0 or args.lora_plus_scale <= 0:
        raise ModelSourceError(f"--lora_rank {args.lora_rank}, --lora_dropout {args.lora_dropout}, --lora_plus_scale "
                               f"{args.lora_plus_scale}: the rank is at least 1, dropout in [0, 1), the ratio positive")
    targets = tuple(t.strip() for t in args.lora_target_modules.split(",") if t.strip())
    alpha = 2.0 * args.lora_rank if args.lora_alpha == -1.0 else args.lora_alpha
    return {"lora": LoRA(args.lora_rank, alpha, targets, args.lora_dropout, args.rslora, args.lora_plus_scale).to_dict()}


def check_dropout(args: ModelArguments, config) -> None:
    """Dropout is not modelled: a family whose PaddleNLP model has it (GPT) trains only at 0, which
    PaddleNLP's run_pretrain.py does not give it unless asked (its default is 0.1); families without
    dropout ignore the fields, as PaddleNLP does."""
    asked = {name: getattr(args, name) for name in ("hidden_dropout_prob", "attention_probs_dropout_prob")
             if getattr(args, name)}
    if asked and config.has_dropout:
        raise ModelSourceError(
            f"{', '.join(f'{k}={v}' for k, v in asked.items())}: dropout is not modelled by paddle-pp (a recipe that "
            "does not set these gets PaddleNLP's 0.1); set --hidden_dropout_prob 0 --attention_probs_dropout_prob 0 "
            "(in a recipe: both fields 0)")


def _checked(config, max_seq_length: int, folder: Path | None = None):
    """`config` once it is whole and trains on `max_seq_length` tokens as its family computes them."""
    try:
        config.validate()
        config.check_sequence_length(max_seq_length)
    except ModelConfigError as err:
        raise ModelSourceError(f"{err}{f' ({folder}/config.json)' if folder else ''}") from err
    return config
