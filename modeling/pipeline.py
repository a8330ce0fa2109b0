"""Pipeline stage boundaries shared by every model family."""

from __future__ import annotations


class PipelineSplitError(ValueError):
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
