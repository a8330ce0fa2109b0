"""Pretraining data: a SentencePiece tokenizer, token ids in a memory-mapped file, a resumable sampler."""
