"""Model families in single-card, tensor-parallel and pipeline forms, speaking single-card names."""

from __future__ import annotations

from paddle_pp.topology import Topology


def _family(config):
    """(single-card/TP class, pipeline class, tp_plan module) for a config; imported lazily so that
    importing `modeling` does not build fleet layers."""
    from modeling.gpt.config import GPTConfig
    from modeling.llama.config import LlamaConfig

    if isinstance(config, LlamaConfig):
        from modeling.llama import tp_plan
        from modeling.llama.modeling import LlamaForCausalLM
        from modeling.llama.modeling_pp import LlamaForCausalLMPipe

        return LlamaForCausalLM, LlamaForCausalLMPipe, tp_plan
    if isinstance(config, GPTConfig):
        from modeling.gpt import tp_plan
        from modeling.gpt.modeling import GPTForCausalLM
        from modeling.gpt.modeling_pp import GPTForCausalLMPipe

        return GPTForCausalLM, GPTForCausalLMPipe, tp_plan
    raise TypeError(f"no model family registered for {type(config).__name__}; use a LlamaConfig or GPTConfig")


def config_from_dict(values: dict):
    """A model config from a Hugging Face-style config dict, chosen by its "model_type"."""
    from modeling.gpt.config import GPTConfig
    from modeling.llama.config import LlamaConfig

    classes = {cls.model_type: cls for cls in (LlamaConfig, GPTConfig)}
    values = dict(values)
    model_type = values.pop("model_type", None)
    if model_type not in classes:
        raise ValueError(f"config model_type={model_type!r} is not one of {sorted(classes)}")
    return classes[model_type](**values)


def build_causal_lm(config, topo: Topology):
    """The model form the layout needs: `*ForCausalLMPipe` when pp > 1, else `*ForCausalLM` (TP inside)."""
    single, pipe, _ = _family(config)
    config.tensor_parallel_degree = topo.layout.tp
    config.tensor_parallel_rank = topo.tp_rank
    config.virtual_pp_degree = topo.layout.vpp
    return pipe(config) if topo.layout.pp > 1 else single(config)


def split_axes(config) -> dict:
    """Single-card parameter name -> tensor-parallel split axis (None: replicated)."""
    return _family(config)[2].split_axes(config)


def single_card_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every parameter's single-card shape, from the config alone."""
    return _family(config)[2].single_card_shapes(config)


def tied_groups(config) -> list[list[str]]:
    """Names that denote one tensor, the stored name first (e.g. GPT's head is its word embedding)."""
    return _family(config)[2].tied_groups(config)


def validate_layout(config, layout) -> None:
    """Fail before any process group exists when the config's shapes do not fit together, the model
    does not split over the layout's tp, or its decoder layers over pp x vpp."""
    from modeling.pipeline import stage_segments

    config.validate()
    _family(config)[2].check_tensor_parallel(config, layout.tp)
    if layout.pp > 1:
        stage_segments(config.num_hidden_layers, layout.pp, layout.vpp, "decoder")
