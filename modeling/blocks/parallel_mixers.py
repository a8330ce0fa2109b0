"""Two token mixers side by side on the same normed input (Falcon-H1: attention and Mamba-2 in every
layer), their outputs summed into one residual branch:

    mamba_out * mamba(h) + attention_out * attention(attention_in * h)

A decoder layer takes the pair as its token mixer (`Decoder.attention`); each mixer keeps its own
names in the layer, tp, SP, cp and recompute as it would alone (each gathers the sequence under SP,
the attention runs its ring under context parallelism, Mamba-2 its state exchange). core_attn
recompute reaches the attention's core; the registry's checks read both (`token_mixers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from modeling.blocks.attention import Attention
from modeling.blocks.decoder import prefixed
from modeling.blocks.mamba2 import Mamba2
from modeling.blocks.parts import Block, Declared, Part
from modeling.execution import Execution


@dataclass(frozen=True)
class ParallelMixers(Declared):
    """`attention` and `mamba` on the same input, under `names` (transformers' `self_attn`, `mamba`),
    with Falcon-H1's multipliers on the attention's input and on both outputs."""

    attention: Attention
    mamba: Mamba2
    attention_in: float = 1.0
    attention_out: float = 1.0
    mamba_out: float = 1.0
    names: tuple[str, str] = ("self_attn", "mamba")
    recurrent: ClassVar[bool] = False  # its attention has a core to recompute; its Mamba-2 keeps only inputs

    @property
    def hidden(self) -> int:
        return self.attention.hidden

    def parts(self) -> dict[str, Part]:
        return dict(zip(self.names, (self.attention, self.mamba)))

    def token_mixers(self) -> tuple[Attention, Mamba2]:
        return self.attention, self.mamba

    def saved_bytes(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> dict[str, int]:
        """Each mixer's, under its name (the multipliers are scale ops: they keep nothing)."""
        attention, mamba = self.names
        return {**prefixed(attention, self.attention.saved_bytes(run, batch, seq_len, dtype_bytes)),
                **prefixed(mamba, self.mamba.saved_bytes(run, batch, seq_len, dtype_bytes))}

    def core(self, run: Execution):
        return self.attention.core(run)

    def core_bytes(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int):
        return self.attention.core_bytes(run, batch, seq_len, dtype_bytes)


class ParallelMixersLayer(Block):
    def forward(self, hidden, positions=None):
        declared = self.declared
        attention, mamba = (getattr(self, name) for name in declared.names)
        into = hidden if declared.attention_in == 1.0 else hidden * declared.attention_in
        return mamba(hidden, positions) * declared.mamba_out + attention(into, positions) * declared.attention_out


ParallelMixers.layer = ParallelMixersLayer
