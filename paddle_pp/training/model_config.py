"""The model a run trains: its config from the shape flags, or from `--model_name_or_path`'s
config.json (shape flags that contradict it are refused, not silently overridden), and the
tokenizer folder that goes with it."""

from __future__ import annotations

from pathlib import Path

from checkpoint.pretrained import PretrainedFolder
from modeling.registry import config_from_dict
from paddle_pp.data.tokenizer import tokenizer_files
from paddle_pp.runtime.errors import UserError
from paddle_pp.training.arguments import DataArguments, ModelArguments


class ModelSourceError(UserError, ValueError):
    """Flags that contradict the model folder they start from."""


# flag -> config.json field, for the flags that shape the network
SHAPE_FLAGS = {"model_type": "model_type", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
               "num_hidden_layers": "num_hidden_layers", "num_attention_heads": "num_attention_heads",
               "num_key_value_heads": "num_key_value_heads"}


def tokenizer_dir(data: DataArguments, pretrained: PretrainedFolder | None, given: frozenset[str]) -> Path:
    """--tokenizer_dir when given; else the model folder's tokenizer when it has one; else the default."""
    if pretrained is not None and "tokenizer_dir" not in given and tokenizer_files(pretrained.folder):
        return pretrained.folder
    return Path(data.tokenizer_dir)


def model_config(args: ModelArguments, max_seq_length: int, tokenizer_vocab: int,
                 pretrained: PretrainedFolder | None = None, given: frozenset[str] = frozenset()):
    """The config to build. From flags, the vocabulary is the tokenizer's; from a folder, everything
    is the folder's, the tokenizer must fit its vocabulary, and the sequence its positions."""
    if pretrained is None:
        values = dict(model_type=args.model_type, vocab_size=tokenizer_vocab, hidden_size=args.hidden_size,
                      intermediate_size=args.intermediate_size, num_hidden_layers=args.num_hidden_layers,
                      num_attention_heads=args.num_attention_heads, max_position_embeddings=max_seq_length,
                      initializer_range=args.initializer_range)
        if args.model_type == "llama":
            values["num_key_value_heads"] = args.num_key_value_heads or args.num_attention_heads
        return config_from_dict(values | {"recompute": args.recompute})
    values = dict(pretrained.config)
    if values["model_type"] == "llama":
        values.setdefault("num_key_value_heads", values["num_attention_heads"])
    for flag, field in SHAPE_FLAGS.items():
        if flag not in given or (field not in values and flag != "model_type"):
            continue
        wanted = getattr(args, flag) or (values["num_attention_heads"] if flag == "num_key_value_heads" else 0)
        if args.continue_training and wanted != values.get(field):
            raise ModelSourceError(
                f"--{flag} {getattr(args, flag)} contradicts {pretrained.folder}/config.json ({field}: "
                f"{values.get(field)!r}); drop the flag (the folder's model is loaded), or pass "
                "--no-continue_training to train its config with other shapes from random weights")
        values[field] = wanted
    if tokenizer_vocab > values["vocab_size"]:
        raise ModelSourceError(
            f"the tokenizer has {tokenizer_vocab} tokens but {pretrained.folder}'s embedding has "
            f"{values['vocab_size']} rows (vocab_size): its ids would index past the embedding; use the model's own tokenizer "
            f"(drop --tokenizer_dir) or one of at most {values['vocab_size']} tokens")
    if max_seq_length > values.get("max_position_embeddings", max_seq_length):
        raise ModelSourceError(
            f"--max_seq_length {max_seq_length} exceeds the model's max_position_embeddings "
            f"{values['max_position_embeddings']} ({pretrained.folder}/config.json); use at most that")
    return config_from_dict(values | {"recompute": args.recompute, "initializer_range": args.initializer_range})
