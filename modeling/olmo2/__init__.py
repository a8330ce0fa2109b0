"""OLMo-2: no norm before the attention or the MLP; their outputs are normalised instead
(`post_attention_layernorm`, `post_feedforward_layernorm`), and RMSNorms run over the whole q and k
projections (OLMoE's: under tp each rank keeps its heads' block of the weight and the mean square is
summed over tp, `blocks.norms.SplitRMSNorm`)."""

from __future__ import annotations

from modeling.blocks.decoder import POST_NORMS
from modeling.config import DecoderConfig
from modeling.decoder_family import decoder_family


class Olmo2Config(DecoderConfig):
    model_type = "olmo2"
    qk_norm = "projection"
    norms = POST_NORMS

    def __init__(self, vocab_size: int = 50304, max_position_embeddings: int = 2048, rms_norm_eps: float = 1e-5,
                 attention_bias: bool = False, pad_token_id: int | None = 1, bos_token_id: int | None = None,
                 eos_token_id: int | None = 50279, **kwargs):
        self.attention_bias = attention_bias
        super().__init__(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                         rms_norm_eps=rms_norm_eps, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, **kwargs)


OLMO2 = decoder_family(Olmo2Config, "Olmo2ForCausalLM", "olmo2", paddlenlp=False)
Olmo2ForCausalLM, Olmo2ForCausalLMPipe = OLMO2.causal_lm, OLMO2.pipe
