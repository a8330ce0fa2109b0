"""Model families in single-card, tensor-parallel and pipeline forms, speaking single-card names.

Every family is built from the shared blocks (`blocks/`): `causal_lm.py` and `pipeline.py` are the
generic single-card/TP model and pipeline model, `family.py` derives a family's classes, TP plan
and checks from one declaration, and `<family>/__init__.py` holds only its config and what
differs (each decoder layer's declaration is read off it: `config.decoder_layer(index)`).
`registry.py` lists the families by model_type. How a run computes a model (parallel degrees,
attention core, recompute, fused kernels) is its `Execution` (`execution.py`), handed to the model's
constructor, never a config field. Models import the runtime's topology and layout only for type
hints; they use its errors, its expert groups (expert parallelism's exchange) and fleet's gradient
hook that the tp sums run in (`tp_gradients`).
"""

from paddle_pp.runtime.startup import lean_paddlenlp

lean_paddlenlp()
