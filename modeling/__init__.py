"""Model families in single-card, tensor-parallel and pipeline forms, speaking single-card names."""

from __future__ import annotations

from paddle_pp.topology import Topology


def build_causal_lm(config, topo: Topology):
    """The model form the layout needs: `*ForCausalLMPipe` when pp > 1, else `*ForCausalLM` (TP inside)."""
    from modeling.llama.config import LlamaConfig

    if not isinstance(config, LlamaConfig):
        raise TypeError(f"no model family registered for {type(config).__name__}")
    config.tensor_parallel_degree = topo.layout.tp
    config.tensor_parallel_rank = topo.tp_rank
    config.virtual_pp_degree = topo.layout.vpp
    if topo.layout.pp > 1:
        from modeling.llama.modeling_pp import LlamaForCausalLMPipe

        return LlamaForCausalLMPipe(config)
    from modeling.llama.modeling import LlamaForCausalLM

    return LlamaForCausalLM(config)


def split_axes(config) -> dict:
    from modeling.llama import tp_plan

    return tp_plan.split_axes(config)
