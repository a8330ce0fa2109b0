"""Building blocks every family is made of, written once in single-card form: parts that declare
their parameters' placements (`parts.py`), norms, rotary embedding, attention, MLPs, embeddings and
heads. How a run computes them (tensor and sequence parallelism, the attention core, recompute,
fused kernels) enters only through the run's `Execution` (`modeling/execution.py`), which every
block and part's `build` receives: with tp > 1 the parts are fleet's parallel layers.
"""
