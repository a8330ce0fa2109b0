"""Checkpoints whose weights are in transformers' layout (`--save_to_hf`), saved in one process:
the folder is the export of the same model bit for bit (names, transposes, GPT-2's fused q, k, v,
Phi-3's unequal fused projections, one tied embedding) with its checksums; transformers loads it as
it is; it resumes with every weight exact; tools that read our layout refuse it by name; a crash while
rewriting leaves the last checkpoint latest. Under tp x pp, ep and SP, and resumed under another
layout: tests/test_family_training.py and tests/test_moe_starts.py (their launches save this way)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest
from conftest import IDS
from safetensors import safe_open

from checkpoint.commit import latest_checkpoint
from checkpoint.format import TRANSFORMERS_LAYOUT, WEIGHTS_LAYOUT, CheckpointError, weights_layout
from checkpoint.save import save_checkpoint
from checkpoint.unified_io import UnifiedReader
from checkpoint.verify import verify_checkpoint
from modeling.registry import family_of, plan_of
from paddle_pp.interop.pretrained import TRANSFORMERS, open_pretrained
from paddle_pp.interop.transformers import export_hf, export_paddlenlp_fused
from paddle_pp.interop.transformers_layout import TransformersWeights, checkpoint_config, load_resumed
from paddle_pp.runtime.layout import Layout
from paddle_pp.runtime.topology import Topology

import hf_models
from parity import our_logits, our_model
from runs import REPO

SINGLE = Topology(Layout(world_size=1), None, 0, 0, 0, 0, 0)
EXPORT_TOL = 1e-4  # our logits against transformers' on the same weights (as the exports' tests)


def _trained(kind: str, folder: Path):
    """Our model of a transformers `kind` folder after one AdamW step (so it has moments to save)."""
    model = our_model(hf_models.make(kind, folder / "source"))
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
    model(paddle.to_tensor(IDS)).mean().backward()
    optimizer.step()
    return model, optimizer


def _save(model, optimizer, out: Path, step: int, save_to_hf: bool):
    config = model.config
    save_checkpoint(out, step, model, optimizer, SINGLE, plan_of(config), config=config, trainer_state={"step": step},
                    rewrite=TransformersWeights(config) if save_to_hf else None)
    return out / f"checkpoint-{step}"


def _tool(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / script), *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def _stored(folder: Path) -> dict[str, np.ndarray]:
    index = folder / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    tensors = {}
    for fname in sorted(files):
        with safe_open(str(folder / fname), "np") as stored:
            assert stored.metadata() == {"format": "pt"}
            tensors |= {name: stored.get_tensor(name) for name in stored.keys()}
    return tensors


@pytest.mark.parametrize("kind", ["gpt2", "phi3", "qwen2"])
def test_a_checkpoint_saved_to_hf_is_the_export_bit_for_bit_and_loads_in_transformers(kind, tmp_path):
    """GPT-2 (q, k, v fused into c_attn, Conv1D's [in, out], tied), Phi-3 (unequal q, k, v and gate, up
    fused), Qwen2 (tied, biases): the same step saved both ways; the transformers-layout folder holds
    the export's tensors and config.json exactly, passes verification, and transformers 4.x loads it
    with our logits."""
    model, optimizer = _trained(kind, tmp_path)
    ours = _save(model, optimizer, tmp_path / "ours", 1, save_to_hf=False)
    theirs = _save(model, optimizer, tmp_path / "theirs", 1, save_to_hf=True)
    assert weights_layout(theirs) == TRANSFORMERS_LAYOUT and weights_layout(ours) is None
    export = export_hf(ours, tmp_path / "export")
    exported, saved = _stored(export), _stored(theirs)
    assert sorted(saved) == sorted(exported)
    for name, array in exported.items():
        np.testing.assert_array_equal(saved[name], array, err_msg=name)
    assert json.loads((theirs / "config.json").read_text()) == json.loads((export / "config.json").read_text())
    assert verify_checkpoint(theirs) == []
    assert sorted(p.name for p in theirs.glob("optimizer*")) == sorted(p.name for p in ours.glob("optimizer*"))
    np.testing.assert_allclose(hf_models.logits(theirs, IDS), our_logits(ours, IDS), rtol=EXPORT_TOL,
                               atol=EXPORT_TOL)


def test_a_checkpoint_saved_to_hf_resumes_with_every_weight_exact(tmp_path):
    """Read back as a resume reads it (the transformers path, checksums checked): every parameter
    equals the saved model's bit for bit, the trainer state comes along, and the config compares as ours."""
    model, optimizer = _trained("phi3", tmp_path)
    folder = _save(model, optimizer, tmp_path / "out", 1, save_to_hf=True)
    assert open_pretrained(folder).kind == TRANSFORMERS
    assert checkpoint_config(folder) == model.config.to_dict()
    fresh = family_of(model.config).causal_lm(model.config)
    assert load_resumed(folder, fresh, plan_of(model.config).axes(), SINGLE) == {"format_version": 2,
                                                                                "saving_layout": SINGLE.layout.record(),
                                                                                "step": 1}
    restored = fresh.state_dict()
    for name, param in model.state_dict().items():
        np.testing.assert_array_equal(restored[name].numpy(), param.numpy(), err_msg=name)


def test_a_checkpoint_saved_to_hf_is_refused_where_our_layout_is_read_and_checked_on_resume(tmp_path):
    """Readers of our layout refuse it by name (the tools too, without a traceback), the verify tool
    passes it, and a corrupted file fails verification and the resume."""
    model, optimizer = _trained("qwen2", tmp_path)
    folder = _save(model, optimizer, tmp_path / "out", 1, save_to_hf=True)
    for read in (lambda: UnifiedReader(folder, "model"), lambda: export_hf(folder, tmp_path / "export"),
                 lambda: export_paddlenlp_fused(folder, tmp_path / "fused", frozenset({"fuse_attention_qkv"}))):
        with pytest.raises(CheckpointError, match="saved with --save_to_hf.*tools/convert_hf.py import"):
            read()
    split = _tool("reshard.py", "split", folder, tmp_path / "split", "--tensor_parallel_degree", "2")
    assert split.returncode == 1 and "saved with --save_to_hf" in split.stderr and "Traceback" not in split.stderr
    verified = _tool("verify_checkpoint.py", folder)
    assert verified.returncode == 0 and verified.stdout.strip().endswith(": OK"), verified.stdout + verified.stderr
    shard = max(folder.glob("model-*.safetensors"), key=lambda path: path.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    shard.write_bytes(bytes(data))
    assert any(shard.name in problem for problem in verify_checkpoint(folder))
    fresh = family_of(model.config).causal_lm(model.config)
    with pytest.raises(CheckpointError, match=f"{shard.name} fails its crc32 checksum"):
        load_resumed(folder, fresh, plan_of(model.config).axes(), SINGLE)


def test_a_crash_while_rewriting_the_weights_leaves_the_last_checkpoint_latest(tmp_path, monkeypatch):
    model, optimizer = _trained("qwen2", tmp_path)
    first = _save(model, optimizer, tmp_path / "out", 1, save_to_hf=True)

    def crash(self, staged, share, shares):
        raise OSError("disk full")

    monkeypatch.setattr(TransformersWeights, "write_share", crash)
    with pytest.raises(OSError, match="disk full"):  # the failing rank's own error; the others name its rank
        _save(model, optimizer, tmp_path / "out", 2, save_to_hf=True)
    assert latest_checkpoint(tmp_path / "out") == first and not (tmp_path / "out" / "checkpoint-2").exists()
    assert verify_checkpoint(first) == []
    assert json.loads((first / "model.safetensors.index.json").read_text())["metadata"][WEIGHTS_LAYOUT] == \
        TRANSFORMERS_LAYOUT


def test_shares_of_the_rewrite_cover_every_stored_tensor_once_balanced_by_bytes():
    from modeling.registry import config_from_dict

    config = config_from_dict({"model_type": "llama", "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2})
    rewrite = TransformersWeights(config)
    sizes = {name: int(np.prod(rewrite.stored.shape(name))) * 4 for name in rewrite.stored.groups}
    for count in (1, 3, 8):
        shares = rewrite.shares(count)
        assert sorted(name for share in shares for name in share) == sorted(sizes)
        loads = [sum(sizes[name] for name in share) for share in shares]
        assert max(loads) - min(loads) <= max(sizes.values())  # greedy largest-first's bound
