"""Model folders of other tools in and out: PaddleNLP and transformers folders as starting weights,
transformers exports and imports, Paddle fleet per-rank checkpoints merged into the unified format."""
