"""Model families in single-card, tensor-parallel and pipeline forms, speaking single-card names.

`registry.py` lists the families; each folder holds one (config, model, pipeline model, TP plan,
family entry). Models import the parallel runtime only for type hints.
"""
