"""A LLaMA-like family in one call: PaddleNLP's names under the family's prefix, transformers'
under "model.", the shared decoder layer, and what its transformers config.json may say."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

from modeling.causal_lm import Skeleton
from modeling.config_fields import any_value
from modeling.family import ModelFamily
from modeling.placement import TensorPlan
from modeling.transformers_adapter import Stored, TransformersAdapter

HEAD = "lm_head.weight"


def _stored(prefix: str, name: str, row: TensorPlan) -> Stored:
    """transformers names the body "model." where PaddleNLP names it after the family, and stores
    linear weights [out, in]."""
    return Stored(name if name == HEAD else "model." + name.removeprefix(prefix + "."), transposed=row.linear)


def prediction_copies(prefix: str, config) -> dict[str, str]:
    """DeepSeek-V3's released multi-token prediction layers (and GLM-4.5's) each store a copy of the
    embedding and of the head beside their own tensors; transformers and vLLM read neither."""
    head = f"{prefix}.embed_tokens.weight" if config.tie_word_embeddings else HEAD
    copies = {}
    for layer in range(config.num_hidden_layers, config.num_hidden_layers + config.mtp_depth):
        copies |= {f"model.layers.{layer}.embed_tokens.weight": f"{prefix}.embed_tokens.weight",
                   f"model.layers.{layer}.shared_head.head.weight": head}
    return copies


def decoder_family(config_class: type, architecture: str, prefix: str, paddlenlp: bool,
                   accepted: dict[str, Callable[[Any, dict], bool]] | None = None,
                   paddlenlp_fused: tuple[str, ...] = (), renamed: dict[str, str] | None = None,
                   aliases: dict[str, str] | None = None, fuse: Callable[[Stored, Any], Stored] | None = None,
                   fixed: dict[str, Any] | None = None, layers_past_last: str | None = None,
                   prediction_layers: bool = False, recut: tuple[tuple[str, ...], ...] = (),
                   unread: tuple[str, ...] = ()) -> ModelFamily:
    """`config_class`'s family of decoder layers (as its config declares them), named `architecture`
    in both transformers and PaddleNLP (whose model of it fuses the projections `paddlenlp_fused` names
    on request); `renamed` and `aliases` are its transformers config fields spelled otherwise than ours,
    `fuse` where its transformers folders fuse our tensors, `fixed` fields only one value of which is
    modelled (besides a zero `attention_dropout`), `layers_past_last` what its released folders store
    as decoder layers past the config's last (left unread when the config does not count them),
    `prediction_layers` whether its folders' multi-token prediction layers store DeepSeek-V3's copies,
    `recut` the groups of stored tensors some of its folders cut elsewhere (`interop.recut`), `unread`
    the name prefixes of tensors its folders carry that the model does not use (left unread, noted)."""
    skeleton = Skeleton(tokens=f"{prefix}.embed_tokens", layers=f"{prefix}.layers", norm=f"{prefix}.norm")
    adapter = TransformersAdapter(
        model_type=config_class.model_type, architecture=architecture, locate=partial(_stored, prefix),
        renamed=renamed or {}, aliases=aliases or {}, fixed={"attention_dropout": 0.0, **(fixed or {})},
        accepted={"pretraining_tp": any_value, **(accepted or {})}, buffers=("rotary_emb.inv_freq",), fuse=fuse,
        recut=recut, unread=unread, layers_past_last=layers_past_last,
        copies=partial(prediction_copies, prefix) if prediction_layers else None)
    return ModelFamily(config_class, architecture, skeleton, adapter, paddlenlp, frozenset(paddlenlp_fused))
