"""Pipeline construction shared by every model family: stage boundaries, fleet set-up, tied weights."""

from __future__ import annotations

from paddle import nn
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_parallel import PipelineLayer

from paddle_pp.runtime.errors import UserError


class PipelineSplitError(UserError, ValueError):
    """Decoder layers that cannot be spread over the requested pipeline chunks without loss."""


def stage_segments(num_layers: int, pp: int, vpp: int, layer_class: str) -> str:
    """Fleet `seg_method` placing an equal number of decoder layers in every (virtual) stage.

    Uneven splits are refused rather than approximated: some frameworks silently dropped the
    remainder (Megatron#1304); here every layer is kept or the run does not start.
    """
    chunks = pp * vpp
    if num_layers % chunks:
        raise PipelineSplitError(
            f"num_hidden_layers={num_layers} does not divide into --pipeline_parallel_degree {pp} x "
            f"--virtual_pp_degree {vpp} = {chunks} equal chunks; pick degrees whose product divides "
            f"{num_layers}."
        )
    return f"layer:{layer_class}"


def tie_shared_weights(pipe) -> None:
    """Make the copies of every `SharedLayerDesc` weight one weight again after local initialisation.

    Two upstream gaps are closed here. Re-initialising weights after `PipelineLayer.__init__` leaves
    the copies different, so the first stage's copy is broadcast again. And fleet means to count a
    shared weight's gradient once in global-norm clipping (`is_firstly_shared`), but it compares
    parameter names with attribute names, so every copy counts and the norm is inflated
    (Paddle#78680); the copies beyond the first stage are marked here instead.
    """
    pipe._synchronize_shared_weights()
    for comm in pipe.shared_comm.values():
        if pipe.global_rank == min(comm["ranks"]):
            continue
        for attr in comm["weight_attr"]:
            getattr(comm["layer"], attr).is_firstly_shared = False


def bind_tensor_parallel(config) -> None:
    """Record this rank's tp degree and rank on the config before any stage layer is built."""
    hcg = fleet.get_hybrid_communicate_group()
    config.tensor_parallel_degree = hcg.get_model_parallel_world_size()
    config.tensor_parallel_rank = hcg.get_model_parallel_rank()


def build_stages(pipe, config, loss_fn: nn.Layer, decoder_class: str) -> None:
    """Cut the registered layers into this rank's stage(s), initialise them and tie shared weights.

    `PipelinePretrainedModel.__init__` is skipped on purpose (diamond with PipelineLayer): the
    family's `__init__` sets `pipe.config` and registers layers before calling this."""
    hcg = fleet.get_hybrid_communicate_group()
    pp, vpp = hcg.get_pipe_parallel_world_size(), config.virtual_pp_degree
    PipelineLayer.__init__(
        pipe,
        layers=pipe.get_sequential_layers(),
        loss_fn=loss_fn,
        topology=hcg.topology(),
        seg_method=stage_segments(config.num_hidden_layers, pp, vpp, decoder_class),
        num_virtual_pipeline_stages=vpp,
    )
    pipe.apply(pipe._init_weights)
    tie_shared_weights(pipe)
