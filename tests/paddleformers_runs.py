"""PaddleFormers 1.2 itself, run by the tests in a subprocess with `.venv/paddleformers` (README setup)
first on PYTHONPATH: its own LLaMA trained by its own Trainer on our trainer's samples, its checkpoints
in both of its formats, its states at each save, its losses, its logits of a folder.

Three things differ from a GPU run of PaddleFormers, each an environment matter on CPU, none touching
what is computed: HF `datasets` is kept from importing (this folder pins numpy 2 for transformers 5.3,
the venv's pyarrow is built for numpy 1; PaddleFormers' Trainer imports datasets only to recognise its
datasets); `paddle.device.synchronize`, which PaddleFormers calls between micro-batches and which raises
on a CPU device, does nothing; fleet is initialised with every degree 1 before a resume (PaddleFormers
initialises it only for world size > 1, and its flex resume asks fleet for its groups).

Commands: `train ROOT ROWS STEPS SAVE_STEPS FORMAT HYPER` (a seeded model saved to ROOT/start, trained
on ROWS, checkpoints every SAVE_STEPS in FORMAT, `losses.json` and `state-<step>.npz` after each save),
`resume ROOT CHECKPOINT ROWS STEPS HYPER` (ROOT/start's model resumed from the flex CHECKPOINT into
ROOT/resumed_run, `resumed.json`),
`logits FOLDER IDS OUT`, `lora START OUT IDS HYPER` (its LoRA on START's model, saved to OUT with its logits)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

FOLDER = Path(__file__).resolve().parents[1] / ".venv" / "paddleformers"
# The model: the test trainer's shape (tests/runs.py MODEL), untied as ours, RMSNorm without its fused kernel
# (no CPU kernel: a kernel choice, not a different computation).
CONFIG = {"vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": False, "fuse_rms_norm": False}


def run(*args, timeout: float = 600) -> None:
    """Run this file with PaddleFormers 1.2 importable (see the module doc)."""
    if not (FOLDER / "paddleformers").is_dir():
        raise FileNotFoundError(f"PaddleFormers 1.2 is not installed in {FOLDER}: run the README's setup command")
    env = {**os.environ, "PYTHONPATH": str(FOLDER)}
    done = subprocess.run([sys.executable, __file__, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"PaddleFormers failed on {args}:\n{done.stderr[-4000:]}")


def _environment():
    sys.modules["datasets"] = None
    import paddle

    paddle.device.synchronize = lambda *args, **kwargs: None
    return paddle


def _samples(rows: np.ndarray):
    import paddle

    class Samples(paddle.io.Dataset):
        """Our trainer's samples in its order: tokens in, the next tokens as labels."""

        def __len__(self):
            return len(rows)

        def __getitem__(self, index):
            return {"input_ids": rows[index, :-1], "labels": rows[index, 1:]}

    return Samples()


def _trainer(model, output: Path, rows: np.ndarray, steps: int, save_steps: int, format: str, hyper: dict,
             callbacks=()):
    from paddleformers.trainer import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(output), device="cpu", max_steps=steps, logging_steps=1,
                             save_steps=save_steps, dataloader_shuffle=False, amp_master_grad=False,
                             save_checkpoint_format=format, load_checkpoint_format=format, disable_tqdm=True,
                             report_to=[], **hyper)
    return Trainer(model=model, args=args, train_dataset=_samples(rows), callbacks=list(callbacks))


def _losses_and_states(root: Path):
    """A callback recording each logged loss and, at each save, the model's weights and the optimizer's
    states by the model's own names (`<name>/<state>`, the accumulator's suffix `_0` dropped)."""
    from paddleformers.trainer import TrainerCallback

    class Record(TrainerCallback):
        losses: dict[int, float] = {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses[state.global_step] = logs["loss"]

        def on_save(self, args, state, control, model=None, optimizer=None, **kwargs):
            arrays = {name: value.numpy() for name, value in model.state_dict().items()}
            by_parameter = {parameter.name: name for name, parameter in model.named_parameters()}
            for key, value in optimizer.state_dict().items():
                if not hasattr(value, "numpy"):
                    continue
                parameter = next(name for name in by_parameter if key.startswith(name + "_"))
                state_name = key[len(parameter) + 1:].removesuffix("_0")
                arrays[f"{by_parameter[parameter]}/{state_name}"] = value.numpy()
            np.savez(root / f"state-{state.global_step}.npz", **arrays)

    return Record()


def train(root: Path, rows: np.ndarray, steps: int, save_steps: int, format: str, hyper: dict) -> None:
    paddle = _environment()
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    if (root / "start").is_dir():
        model = LlamaForCausalLM.from_pretrained(str(root / "start"))
    else:
        paddle.seed(hyper.get("seed", 42))
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        model.save_pretrained(str(root / "start"))
    record = _losses_and_states(root)
    _trainer(model, root / "run", rows, steps, save_steps, format, hyper, [record]).train()
    (root / "losses.json").write_text(json.dumps(record.losses))


def resume(root: Path, checkpoint: Path, rows: np.ndarray, steps: int, hyper: dict) -> None:
    _environment()
    from paddle.distributed import fleet
    from paddleformers.transformers import LlamaForCausalLM

    fleet.init(is_collective=True)
    model = LlamaForCausalLM.from_pretrained(str(root / "start"))
    record = _losses_and_states(root)
    _trainer(model, root / "resumed_run", rows, steps, steps, "flex_checkpoint", hyper, [record]).train(
        resume_from_checkpoint=str(checkpoint))
    (root / "resumed.json").write_text(json.dumps(record.losses))


def logits(folder: Path, ids: np.ndarray) -> np.ndarray:
    paddle = _environment()
    from paddleformers.transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    config.fuse_rms_norm = False  # its fused RMSNorm has no CPU kernel
    model = AutoModelForCausalLM.from_pretrained(str(folder), config=config)
    model.eval()
    with paddle.no_grad():
        return model(paddle.to_tensor(ids), return_dict=True).logits.numpy()


def lora(start: Path, out: Path, ids: np.ndarray, hyper: dict) -> None:
    """PaddleFormers' LoRA (its LoRAModel, `hyper`: its LoRAConfig fields) on the model saved in `start`, its B
    drawn from N(0, 0.02) (it starts at zero), saved as PaddleFormers saves adapters into `out`, its logits on `ids`
    in `out/logits.npy`."""
    paddle = _environment()
    from paddleformers.peft import LoRAConfig, LoRAModel
    from paddleformers.transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(start))
    config.fuse_rms_norm = False
    model = LoRAModel(AutoModelForCausalLM.from_pretrained(str(start), config=config), LoRAConfig(**hyper))
    paddle.seed(7)
    for name, param in model.named_parameters():
        if name.endswith("lora_B"):
            param.set_value(paddle.normal(0.0, 0.02, param.shape))
    model.save_pretrained(str(out))
    model.eval()
    with paddle.no_grad():
        np.save(out / "logits.npy", model(paddle.to_tensor(ids), return_dict=True).logits.numpy())


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "train":
        root, rows, steps, save_steps, format, hyper = rest
        train(Path(root), np.load(rows), int(steps), int(save_steps), format, json.loads(hyper))
    elif command == "resume":
        root, checkpoint, rows, steps, hyper = rest
        resume(Path(root), Path(checkpoint), np.load(rows), int(steps), json.loads(hyper))
    elif command == "logits":
        folder, ids, out = rest
        np.save(out, logits(Path(folder), np.load(ids)))
    elif command == "lora":
        start, out, ids, hyper = rest
        lora(Path(start), Path(out), np.load(ids), json.loads(hyper))
    else:
        raise SystemExit(f"unknown command {command}")
