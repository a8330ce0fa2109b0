"""Building blocks every family is made of, written once in single-card form: parts that declare
their parameters' placements (`parts.py`), norms, rotary embedding, attention, MLPs, embeddings and
heads. Tensor parallelism enters only through the parts' `build`, which picks fleet's parallel
layers when `config.tensor_parallel_degree > 1`.
"""
