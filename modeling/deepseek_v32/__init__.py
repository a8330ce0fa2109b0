"""DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`): DeepSeek-V3's layers (latent attention
on interleaved rotary pairs, the V3 router, shared experts; dense or with experts as `mlp_layer_types`
says, `first_k_dense_replace` dense first by default) with DeepSeek Sparse Attention in every layer: a
lightning indexer of `index_n_heads` heads of `index_head_dim` picks each query's `index_topk` keys
(`blocks/indexer.py`), which its latent attention alone attends to (`blocks/latent_attention.py`).
DeepSeek-V3.2's indexer rotates by halves, GLM-5's by interleaved pairs (transformers' and the
released code's). GLM-5.2's layers that reuse the selection of the last layer before them that runs
its indexer (`indexer_types` "shared") have no indexer: the selection travels to them beside the hidden
states, across pipeline stages too (`blocks/carried.py`).
"""

from __future__ import annotations

from dataclasses import replace

from modeling.blocks.carried import CarryingDecoder
from modeling.blocks.decoder import Decoder
from modeling.blocks.indexer import Indexer
from modeling.blocks.latent_attention import LatentAttention
from modeling.config import ModelConfigError, check_layer_kinds
from modeling.decoder_family import decoder_family
from modeling.deepseek import DENSE, SPARSE, V3_FOLDERS, DeepseekV3Config, MlpLayerTypes

INDEXED, FULL, SHARED = "indexed_attention", "full", "shared"  # layer_types, indexer_types
SELECTION = "selection"  # what travels to the shared layers (`latent_attention.handed_on`)


class DeepseekV32Config(MlpLayerTypes, DeepseekV3Config):
    model_type = "deepseek_v32"
    indexer_interleaved = False
    defaults: dict = {}

    def __init__(self, index_topk: int = 2048, index_head_dim: int = 128, index_n_heads: int = 64,
                 mlp_layer_types: list[str] | None = None, layer_types: list[str] | None = None,
                 indexer_types: list[str] | None = None, **kwargs):
        values = {**self.defaults, **kwargs}
        self.index_topk, self.index_head_dim, self.index_n_heads = index_topk, index_head_dim, index_n_heads
        layers = values.get("num_hidden_layers", 61)
        dense = min(values.pop("first_k_dense_replace", 3), layers)
        self.mlp_layer_types = list(mlp_layer_types or [DENSE] * dense + [SPARSE] * (layers - dense))
        self.layer_types = list(layer_types or [INDEXED] * layers)
        self.indexer_types = list(indexer_types or [FULL] * layers)
        values.pop("rope_interleave", None)  # transformers has none for these: the latent rotary is interleaved
        super().__init__(first_k_dense_replace=0, rope_interleave=True, **values)

    def shares(self, index: int) -> bool:
        """Whether layer `index` reuses an earlier layer's selection (prediction layers, past the last: no)."""
        return index < self.num_hidden_layers and self.indexer_types[index] == SHARED

    def attention(self, index: int) -> LatentAttention:
        latent = super().attention(index)
        if self.shares(index):
            return replace(latent, reused_topk=self.index_topk)
        rotary = replace(latent.rotary, interleaved=self.indexer_interleaved)
        return replace(latent, indexer=Indexer(self.hidden_size, self.q_lora_rank, self.index_n_heads,
                                               self.index_head_dim, self.index_topk, rotary),
                       hands_on_selection=self.shares(index + 1))

    def decoder_layer(self, index: int) -> Decoder:
        """Where layers share selections, each carries them (`CarryingDecoder`) from the layer that
        selects to the last shared layer after it."""
        layer = super().decoder_layer(index)
        if SHARED not in self.indexer_types or index >= self.num_hidden_layers:
            return layer
        carried = tuple((SELECTION,) if self.shares(at) else () for at in (index, index + 1))
        return CarryingDecoder(layer.index, layer.attention, layer.feed_forward, layer.norm,
                               feed_forward_name=layer.feed_forward_name, norms=layer.norms, carried_in=carried[0],
                               carried_out=carried[1], mixer_takes=carried[0],
                               mixer_gives=carried[1] if not self.shares(index) else ())

    def validate(self) -> None:
        self.check_mlp_layer_types()
        check_layer_kinds("layer_types", self.layer_types, (INDEXED,), self.num_hidden_layers)
        check_layer_kinds("indexer_types", self.indexer_types, (FULL, SHARED), self.num_hidden_layers)
        if self.indexer_types and self.indexer_types[0] == SHARED:
            raise ModelConfigError("indexer_types starts with 'shared': a shared layer reuses the selection of a layer "
                                   "before it that runs its indexer ('full'), and the first has none")
        super().validate()
        if not self.q_lora_rank:
            raise ModelConfigError("q_lora_rank is null: the sparse-attention indexer reads the query latent, which "
                                   "only a q_lora_rank gives")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ModelConfigError(f"index_head_dim={self.index_head_dim} is narrower than its rotary "
                                   f"qk_rope_head_dim={self.qk_rope_head_dim}")


# transformers 5's GlmMoeDsaConfig defaults (GLM-5's shape) where DeepSeek-V3.2's differ
GLM5_DEFAULTS = dict(vocab_size=154880, hidden_size=6144, intermediate_size=12288, num_hidden_layers=78,
                     num_attention_heads=64, q_lora_rank=2048, v_head_dim=256, qk_nope_head_dim=192, n_group=1,
                     topk_group=1, max_position_embeddings=202752, rms_norm_eps=1e-5)


class GlmMoeDsaConfig(DeepseekV32Config):
    model_type = "glm_moe_dsa"
    indexer_interleaved = True
    defaults = GLM5_DEFAULTS

    def __init__(self, index_n_heads: int = 32, indexer_types: list[str] | None = None,
                 index_topk_pattern: str | list | None = None, index_topk_freq: int = 1,
                 index_skip_topk_offset: int = 2, **kwargs):
        """`indexer_types` as transformers 5 derives it when a config has none: from the pattern ("F" full,
        "S" shared), else every `index_topk_freq`-th layer from `index_skip_topk_offset - 1` full."""
        self.index_topk_pattern, self.index_topk_freq = index_topk_pattern, index_topk_freq
        self.index_skip_topk_offset = index_skip_topk_offset
        if indexer_types is None and index_topk_pattern is not None:
            indexer_types = [{"F": FULL, "S": SHARED}.get(c, c) for c in index_topk_pattern]
        elif indexer_types is None:
            layers, freq = kwargs.get("num_hidden_layers", GLM5_DEFAULTS["num_hidden_layers"]), max(index_topk_freq, 1)
            indexer_types = [FULL if max(i - index_skip_topk_offset + 1, 0) % freq == 0 else SHARED
                             for i in range(layers)]
        super().__init__(index_n_heads=index_n_heads, indexer_types=indexer_types, **kwargs)


FOLDERS = {**V3_FOLDERS, "accepted": {**V3_FOLDERS["accepted"], "mlp_bias": lambda value, _values: not value}}
DEEPSEEK_V32 = decoder_family(DeepseekV32Config, "DeepseekV32ForCausalLM", "deepseek_v32", paddlenlp=False, **FOLDERS)
GLM_MOE_DSA = decoder_family(GlmMoeDsaConfig, "GlmMoeDsaForCausalLM", "glm_moe_dsa", paddlenlp=False, **FOLDERS)
DeepseekV32ForCausalLM, DeepseekV32ForCausalLMPipe = DEEPSEEK_V32.causal_lm, DEEPSEEK_V32.pipe
GlmMoeDsaForCausalLM, GlmMoeDsaForCausalLMPipe = GLM_MOE_DSA.causal_lm, GLM_MOE_DSA.pipe
