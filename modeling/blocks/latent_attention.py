"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight) as a layer's attention part.

q is projected through a low-rank latent (`q_a_proj`, its RMSNorm `q_a_layernorm`, `q_b_proj`; or
one `q_proj` when `q_lora_rank` is null, V2-Lite), k and v through another (`kv_a_proj_with_mqa`,
whose last `rope_dim` outputs are one rotary key shared by every head, `kv_a_layernorm`,
`kv_b_proj`); each head's q and k are its `nope_dim` channels then its `rope_dim` rotary channels
(transformers' order, `concat(nope, rope)`), v has its own `v_dim`, and the softmax scale is
qk_head_dim^-1/2 times yarn's mscale^2 (the layer's `CoreSpec`). Rotary runs on the rope slice only,
on interleaved pairs (transformers' `rope_interleave`, V2's complex rotation).

Under tensor parallelism the heads split (`q_b_proj`/`q_proj` and `kv_b_proj` by columns, `o_proj` by
rows) and the latent projections and their norms stay whole on every tp rank. Without sequence
parallelism the column linears all-reduce their input's gradient, so the latents' and their weights'
gradients are complete on every rank; the shared rotary key bypasses `kv_b_proj` and each rank uses
it for its own heads only, so it passes an identity whose backward sums its gradient over tp (the
gradient Megatron, PaddleFleet and another framework each once left unsummed). Under sequence
parallelism the block's input is gathered once and every gradient into the latents is a rank's own
heads' part: the whole-on-every-rank weights (projections and norms) are marked as the norms under
SP are and summed over tp at the update, and the rotary key needs no sum (its part flows back with
the others, the gather's backward summing the input gradient).

Under context parallelism the ring carries each head's expanded k (192 wide) and v (128), not the
latent (576 per token for all heads): the expanded tensors are what every core and the ring already
compute on, and carrying the latent would rerun `kv_b_proj` on every block of every ring step,
forward and backward, for each of the cp - 1 steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import paddle
from paddle.distributed import collective

from modeling.attention_core import AttentionCore, Heads
from modeling.attention_core.spec import PLAIN, CoreSpec
from modeling.blocks.attention import QueryTemperature
from modeling.blocks.norms import rms_norm_saved_bytes
from modeling.blocks.parts import Block, ColumnLinear, Declared, Norm, Part, RowLinear, WholeLinear
from modeling.blocks.rotary import Rotary
from modeling.execution import Execution
from modeling.sequence_parallel import gather_tokens


@dataclass(frozen=True)
class LatentAttention(Declared):
    recurrent: ClassVar[bool] = False  # a token mixer with an attention core (see blocks/gated_delta.py)
    hidden: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    eps: float
    bias: bool = False  # transformers' attention_bias: on q_a_proj, kv_a_proj_with_mqa and o_proj
    spec: CoreSpec = PLAIN
    rotary: Rotary | None = None
    temperature: QueryTemperature | None = None  # Mistral 4's query scales by position (llama_4_scaling_beta)
    output = "o_proj"
    sinks = False

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    def parts(self) -> dict[str, Part]:
        if self.q_lora_rank:
            query: dict[str, Part] = {"q_a_proj": WholeLinear(self.hidden, self.q_lora_rank, self.bias),
                                      "q_a_layernorm": Norm(self.q_lora_rank, self.eps),
                                      "q_b_proj": ColumnLinear(self.q_lora_rank, self.heads * self.qk_dim)}
        else:
            query = {"q_proj": ColumnLinear(self.hidden, self.heads * self.qk_dim)}
        return {**query,
                "kv_a_proj_with_mqa": WholeLinear(self.hidden, self.kv_lora_rank + self.rope_dim, self.bias),
                "kv_a_layernorm": Norm(self.kv_lora_rank, self.eps),
                "kv_b_proj": ColumnLinear(self.kv_lora_rank, self.heads * (self.nope_dim + self.v_dim)),
                self.output: RowLinear(self.heads * self.v_dim, self.hidden, self.bias)}

    def own_tp_units(self) -> dict[str, int]:
        return {"num_attention_heads": self.heads}

    def local_heads(self, run: Execution) -> Heads:
        return Heads(self.heads // run.tp, self.heads // run.tp, self.qk_dim, self.v_dim)

    def core(self, run: Execution) -> AttentionCore:
        return run.attention.serving(self.spec, False, self.local_heads(run))

    def core_bytes(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> tuple[int, int, int]:
        heads = self.local_heads(run)
        kept = self.core(run).saved_bytes(batch, seq_len, heads, dtype_bytes, run.sequence_first,
                                          run.spec_for(self.spec))
        return kept, heads.qkv_bytes(batch * seq_len, dtype_bytes), heads.output_bytes(batch * seq_len, dtype_bytes)

    def saved_bytes(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> dict[str, int]:
        """What one call keeps for backward (the planner's model, equal to the measurement in fp32): the
        input (shared by the down projections, kept by the first), each latent's norm and its normed
        output, the core's own and the output projection's input unless the core keeps it, the
        rotary tables as `Rotary.kept_bytes` says; the splits, concatenations and the shared key's
        broadcast to every head keep nothing."""
        tokens = batch * seq_len
        kept, _, output = self.core_bytes(run, batch, seq_len, dtype_bytes)
        first = "q_a_proj" if self.q_lora_rank else "q_proj"
        rotary = self.rotary.kept_bytes(batch, seq_len, dtype_bytes, run.documents is not None) if self.rotary else 0
        scaled = tokens * self.local_heads(run).heads * self.qk_dim * dtype_bytes if self.temperature else 0
        saved = {first: tokens * self.hidden * dtype_bytes, "": kept + rotary + scaled,
                 "kv_a_layernorm": rms_norm_saved_bytes(tokens, self.kv_lora_rank, dtype_bytes, False),
                 "kv_b_proj": tokens * self.kv_lora_rank * dtype_bytes,
                 self.output: 0 if self.core(run).keeps_output(run.sequence_first) else output}
        if self.q_lora_rank:
            saved |= {"q_a_layernorm": rms_norm_saved_bytes(tokens, self.q_lora_rank, dtype_bytes, False),
                      "q_b_proj": tokens * self.q_lora_rank * dtype_bytes}
        return saved


class LatentSelfAttention(Block):
    def __init__(self, config, run: Execution, declared: LatentAttention):
        super().__init__(config, run, declared)
        self.heads = declared.local_heads(run)
        self.attend = declared.core(run)
        # the shared rotary key's gradient, each tp rank's own heads' part, summed over tp (without SP)
        self.sums_rotary_key = run.tp > 1 and not run.sequence_first

    def forward(self, hidden, positions=None):
        """`positions`: each token's position in its document under per-document attention, else None."""
        declared, run, heads = self.declared, self.run, self.heads.heads
        hidden = gather_tokens(hidden, run)
        seq_first = run.sequence_first
        lead = hidden.shape[:2]
        query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))) if declared.q_lora_rank else self.q_proj(hidden)
        q_nope, q_rot = paddle.split(query.reshape(lead + [heads, declared.qk_dim]),
                                     [declared.nope_dim, declared.rope_dim], axis=-1)
        latent, k_rot = paddle.split(self.kv_a_proj_with_mqa(hidden), [declared.kv_lora_rank, declared.rope_dim],
                                     axis=-1)
        k_rot = k_rot.reshape(lead + [1, declared.rope_dim])
        if self.sums_rotary_key:
            k_rot = collective._c_identity(k_rot, group=run.tp_group)
        if declared.rotary is not None:
            q_rot, k_rot = declared.rotary.rotate(q_rot, k_rot, seq_first, run.kernels.fused_rope, run.cp, positions)
        keys = self.kv_b_proj(self.kv_a_layernorm(latent)).reshape(lead + [heads, declared.nope_dim + declared.v_dim])
        k_nope, v = paddle.split(keys, [declared.nope_dim, declared.v_dim], axis=-1)
        q = paddle.concat([q_nope, q_rot], axis=-1)
        if declared.temperature is not None:
            q = declared.temperature.apply(q, run, positions)
        k = paddle.concat([k_nope, k_rot.expand(lead + [heads, declared.rope_dim])], axis=-1)
        spec, documents = run.spec_for(declared.spec), run.documents_at(positions)
        out = run.recompute("core_attn", lambda *qkv: self.attend(*qkv, seq_first, spec, None, documents), q, k, v,
                            training=self.training)
        return self.o_proj(out)


LatentAttention.layer = LatentSelfAttention
