"""Model families in single-card, tensor-parallel and pipeline forms, speaking single-card names.

Every family is built from the shared blocks (`blocks/`): `causal_lm.py` and `pipeline.py` are the
generic single-card/TP model and pipeline model, `family.py` derives a family's classes, TP plan
and checks from one declaration, and `<family>/__init__.py` holds only its config and what
differs (each decoder layer's declaration is read off it: `config.decoder_layer(index)`).
`registry.py` lists the families by model_type. How a run computes a model (parallel degrees,
attention core, recompute, fused kernels) is its `Execution` (`execution.py`), handed to the model's
constructor, never a config field. Models use the runtime's topology and layout as type hints only
(imported under TYPE_CHECKING); from the runtime they import its errors, its expert groups (expert
parallelism's exchange and which experts a rank holds) and, first of all, its start-up
(`runtime/startup.py`: PaddleNLP's base classes imported without PaddleNLP's package inits).
"""

from paddle_pp.runtime.startup import lean_paddlenlp

lean_paddlenlp()
