"""Pipeline models built from a family's declaration: `*ForCausalLMPipe` registers the single-card
pieces as fleet `LayerDesc`s under their single-card prefixes, so `state_dict()` speaks single-card
names through PaddleNLP's `PipelinePretrainedModel` prefix mapping.

Only hidden states flow between stages (rotary tables and the causal mask are rebuilt per layer),
and beside them, under per-document attention, each token's position in its document
(`modeling/documents.py`), which every layer reads its mask and rotary from, and with multi-token
prediction the next tokens' embeddings its layers (on the last stage) take (`blocks/prediction.py`).
A tied embedding is two `SharedLayerDesc`s under one key, the embedding on the first stage and the
head on the last, as PaddleNLP ties them: fleet broadcasts the first stage's weight at start and
all-reduces the two gradients after every batch, and both map to the embedding's single-card name.
"""

from __future__ import annotations

from typing import ClassVar

from paddle import nn
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer, SharedLayerDesc
from paddlenlp.transformers.model_utils import PipelinePretrainedModel

from modeling.blocks.embedding import HeadLayer, TiedHeadLayer, embed
from modeling.blocks.parts import Leaf
from modeling.causal_lm import CausalLMPretrainedModel
from modeling.documents import state, unpack
from modeling.execution import Execution
from modeling.lora import LoRA, attach_adapters
from modeling.loss import CausalLMCriterion
from modeling.placement import FIRST, FIRST_AND_LAST, chunk_starts, pipeline_chunks
from paddle_pp.runtime.errors import UserError

DECODER_LAYERS = "DecoderLayer"  # fleet's segment pattern (a regex search): every decoder layer class's name has it


class PipelineSplitError(UserError, ValueError):
    """Decoder layers that cannot be spread over the requested pipeline chunks without loss."""


def check_stage_split(num_layers: int, pp: int, vpp: int, v_shape: bool = False) -> None:
    """Fail unless every pipeline chunk (vpp per stage, or DualPipeV's two) gets a decoder layer,
    and, under the interleaved schedule, an equal number: fleet's interleaved segmentation takes equal
    chunks only. Other uneven splits are spread by `chunk_starts`; no layer is ever dropped (some
    frameworks silently dropped the remainder, Megatron#1304)."""
    chunks = pipeline_chunks(pp, vpp, v_shape)
    if num_layers < chunks:
        per_stage = "DualPipeV's 2" if v_shape else f"--virtual_pp_degree {vpp}"
        raise PipelineSplitError(
            f"num_hidden_layers={num_layers} is fewer than --pipeline_parallel_degree {pp} x {per_stage} = {chunks} "
            f"chunks, and every chunk needs a decoder layer; pick degrees whose product is at most {num_layers}.")
    if vpp > 1 and num_layers % chunks:
        raise PipelineSplitError(
            f"num_hidden_layers={num_layers} does not divide into --pipeline_parallel_degree {pp} x "
            f"--virtual_pp_degree {vpp} = {chunks} equal chunks, which fleet's interleaved schedule needs; pick "
            f"degrees whose product divides {num_layers}, or drop --virtual_pp_degree (uneven stages are built "
            "without it).")


def stage_segments(items: list, num_layers: int, pp: int, vpp: int, v_shape: bool = False) -> str | list[int]:
    """Fleet `seg_method` for the registered `items`: under vpp its equal split by decoder layers;
    otherwise the first item of every chunk (a stage, or one arm of DualPipeV's V), each chunk
    starting at its first decoder layer as `placement.chunk_starts` places them (what every placement
    reads), the embedding in the first chunk and whatever follows the last decoder layer in the last."""
    check_stage_split(num_layers, pp, vpp, v_shape)
    if vpp > 1:
        return f"layer:{DECODER_LAYERS}"
    decoders = [index for index, item in enumerate(items) if DECODER_LAYERS in item.layer_func.__name__]
    chunks = pipeline_chunks(pp, vpp, v_shape)
    return [0] + [decoders[start] for start in chunk_starts(num_layers, chunks)[1:-1]] + [len(items)]


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


class EmbeddingSection(nn.Layer):
    """The first stage's embeddings (token, and learned positions), children under their names."""

    def __init__(self, config, run: Execution, parts: dict[str, Leaf], tokens: str, positions: str | None):
        super().__init__()
        self.config, self.run = config, run
        for name, part in parts.items():
            self.add_sublayer(name, part.build(config, run))
        self.names = (tokens, positions)

    @property
    def embedding_weight(self):
        return getattr(self, self.names[0]).weight

    def forward(self, input_ids):
        tokens, positions = self.names
        per_layer = self.config.per_layer_embeddings()
        return embed(self.config, self.run, getattr(self, tokens), getattr(self, positions) if positions else None,
                     input_ids, {name: getattr(self, name) for name in per_layer.parts()} if per_layer else None)


class NormSection(nn.Layer):
    """The last stage's final norm, under its own name."""

    def __init__(self, config, run: Execution, name: str, part: Leaf):
        super().__init__()
        self.add_sublayer(name, part.build(config, run))
        self.name = name

    def forward(self, layer_state):
        """The last decoder layer's output, normed; the document positions and what is carried for
        multi-token prediction go on (its layers and loss read them)."""
        hidden, positions, carried = unpack(layer_state)
        return state(getattr(self, self.name)(hidden), positions, carried)


def _split(path: str) -> tuple[str, str]:
    """(prefix, last name) of a dotted path."""
    prefix, _, name = path.rpartition(".")
    return prefix, name


class CausalLMPipe(PipelinePretrainedModel, PipelineLayer):
    """Every family's `*ForCausalLMPipe`: the skeleton's pieces registered in model order."""

    family: ClassVar  # the `ModelFamily` this class was generated for
    _get_tensor_parallel_mappings = CausalLMPretrainedModel._get_tensor_parallel_mappings
    _init_weights = CausalLMPretrainedModel._init_weights

    def __init__(self, config, run: Execution):
        self.config, self.run = config, run
        self.family.check_tensor_parallel(config, run.tp)
        skeleton, tied = self.family.skeleton, config.tie_word_embeddings
        parts = skeleton.parts(config)
        tied_key = f"{self.family.model_type}_tied_embedding"
        first = {path: part for path, part, place in parts if place in (FIRST, FIRST_AND_LAST)}
        prefix = _split(skeleton.tokens)[0]
        embedding = dict(config=config, run=run, parts={_split(p)[1]: part for p, part in first.items()},
                         tokens=_split(skeleton.tokens)[1],
                         positions=_split(skeleton.positions)[1] if skeleton.positions else None)
        self.add_sequential_layer(
            SharedLayerDesc(tied_key, EmbeddingSection, shared_weight_attr="embedding_weight", **embedding) if tied
            else LayerDesc(EmbeddingSection, **embedding), prefix)
        for i in range(config.num_hidden_layers):
            declared = config.decoder_layer(i)
            self.add_sequential_layer(LayerDesc(declared.layer, config=config, run=run, declared=declared),
                                      f"{skeleton.layers}.{i}")
        norm_prefix, norm_name = _split(skeleton.norm)
        self.add_sequential_layer(LayerDesc(NormSection, config=config, run=run, name=norm_name,
                                            part=config.hidden_norm()), norm_prefix)
        for index, declared in config.prediction_layers():  # after the final norm: on the last stage
            self.add_sequential_layer(LayerDesc(declared.layer, config=config, run=run, declared=declared),
                                      f"{skeleton.layers}.{index}")
        if tied:
            self.add_sequential_layer(SharedLayerDesc(tied_key, TiedHeadLayer, shared_weight_attr="embedding_weight",
                                                      config=config, run=run), skeleton.tokens)
        else:
            head = next(part for path, part, _ in parts if path == skeleton.head)
            self.add_sequential_layer(LayerDesc(HeadLayer, config=config, run=run, hidden_size=head.hidden_size,
                                                vocab_size=head.vocab_size), skeleton.head)
        self._build_stages(CausalLMCriterion(run, config.mtp_loss_weight))
        lora = LoRA.of(config)
        if lora is not None:
            self._set_pipeline_name_mapping()  # the stage's single-card names, before adapters join them
            single_names = dict(self._pp_to_single_mapping)
            attach_adapters(self, lora, run, self.family.tensor_plan(config), single_names.__getitem__)
            self._single_to_pp_mapping = None  # found again with the adapters on first use

    def _build_stages(self, loss_fn: nn.Layer) -> None:
        """Cut the registered layers into this rank's stage(s), initialise them and tie shared weights.

        `PipelinePretrainedModel.__init__` is skipped on purpose (diamond with PipelineLayer): the
        registered layers are handed to `PipelineLayer.__init__` directly."""
        hcg = fleet.get_hybrid_communicate_group()
        pp, vpp = hcg.get_pipe_parallel_world_size(), self.run.vpp
        PipelineLayer.__init__(
            self,
            layers=self.get_sequential_layers(),
            loss_fn=loss_fn,
            topology=hcg.topology(),
            seg_method=stage_segments(self.get_sequential_layers(), self.config.num_hidden_layers, pp, vpp,
                                      self.run.dualpipev),
            num_virtual_pipeline_stages=vpp,
            use_dualpipev=self.run.dualpipev,
        )
        self.apply(self._init_weights)
        tie_shared_weights(self)
        # the chunks of vpp and DualPipeV (fleet's get_model_chunks() leaves DualPipeV's out), or the one stage
        for chunk in getattr(self, "_model_chunks", None) or [self]:
            decoders = [layer for layer in chunk.run_function if hasattr(layer, "ends_stage")]
            if decoders:
                decoders[-1].ends_stage = True
