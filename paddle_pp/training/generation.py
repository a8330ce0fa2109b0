"""Text from a trained model on one process: greedy or top-p sampling, from any folder
`--model_name_or_path` takes (a checkpoint, a weights-only export, a PaddleNLP or transformers
folder), with the tokenizer that folder carries.

There is no key/value cache: each new token runs the whole window again. That is quadratic in the
length, and fine for what this is for (looking at what a model writes after some training); the
training forward is reused unchanged, so what is sampled is exactly what was trained. A model with
recurrent layers (Qwen3.5, Kimi Linear, Nemotron-H, Granite 4.0-H, Falcon-H1) runs each new token
alone instead, those layers carrying their state from token to token (`decoding.carrying`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle

from checkpoint.format import CheckpointError, tokenizer_files
from modeling.registry import config_from_dict, family_of, plan_of
from paddle_pp.data.tokenizer import TextTokenizer, load_text_tokenizer
from paddle_pp.interop.pretrained import load_pretrained, open_pretrained
from paddle_pp.training.decoding import carries_state, carrying


@dataclass
class Generator:
    model: paddle.nn.Layer
    tokenizer: TextTokenizer
    window: int  # the longest context the model's positions cover

    def token_ids(self, prompt_ids: list[int], max_new_tokens: int, top_p: float = 0.0, temperature: float = 1.0,
                  seed: int = 0) -> list[int]:
        """The new ids after `prompt_ids`: greedy when `top_p` is 0, else sampled from the smallest set
        of tokens whose probability reaches `top_p`; stops early at the tokenizer's end-of-text id."""
        rng, ids = np.random.default_rng(seed), list(prompt_ids)
        stateful = carries_state(self.model)
        with paddle.no_grad(), (carrying(self.model, self.window) if stateful else nullcontext()):
            fresh = ids[-self.window:]  # what the next call runs: the window, or (carrying state) what is new
            for _ in range(max_new_tokens):
                logits = self.model(paddle.to_tensor([fresh], dtype="int64"))[0, -1]
                scores = logits.astype("float64").numpy()
                token = int(np.argmax(scores)) if top_p <= 0 else _nucleus(scores, top_p, temperature, rng)
                ids.append(token)
                if token == self.tokenizer.eos_id:
                    break
                fresh = [token] if stateful else ids[-self.window:]
        return ids[len(prompt_ids):]

    def complete(self, prompt: str, max_new_tokens: int, top_p: float = 0.0, temperature: float = 1.0,
                 seed: int = 0) -> str:
        prompt_ids = self.tokenizer.encode_declared(prompt)  # Gemma's <bos> first, as transformers encodes it
        if not prompt_ids:
            raise ValueError("the prompt encodes to no tokens; give some text")
        new_ids = self.token_ids(prompt_ids, max_new_tokens, top_p, temperature, seed)
        # decoded together with the prompt: SentencePiece drops a word's leading space at the start of a text
        prompt, whole = self.tokenizer.decode(prompt_ids), self.tokenizer.decode(prompt_ids + new_ids)
        return whole[len(prompt):] if whole.startswith(prompt) else self.tokenizer.decode(new_ids)


def _nucleus(scores: np.ndarray, top_p: float, temperature: float, rng: np.random.Generator) -> int:
    scaled = scores / max(temperature, 1e-6)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    keep = order[: int(np.searchsorted(cumulative, top_p)) + 1]
    return int(rng.choice(keep, p=probs[keep] / probs[keep].sum()))


def load_generator(folder: Path, tokenizer_dir: Path | None = None, allow_unsafe_pickle: bool = False) -> Generator:
    """The single-card model of `folder` with its weights, and its tokenizer (or `tokenizer_dir`'s)."""
    folder = Path(folder)
    pretrained = open_pretrained(folder, allow_unsafe_pickle=allow_unsafe_pickle)
    if tokenizer_dir is None and not tokenizer_files(folder):
        raise CheckpointError(f"{folder} carries no tokenizer; pass --tokenizer_dir the one the model was trained with")
    config = config_from_dict(pretrained.config)
    model = family_of(config).causal_lm(config)
    load_pretrained(pretrained, model, plan_of(config).axes(), None)
    model.eval()
    return Generator(model, load_text_tokenizer(tokenizer_dir or folder), config.max_position_embeddings)
