"""Quantized released folders read as transformers reads them (one process, fp32). GPT-OSS's MXFP4: the
dequantization equals transformers 4.55's own (`convert_moe_packed_tensors`, transposed as its loader
does) bit for bit, and a folder whose experts are stored as MXFP4 blocks and scales gives every
tensor transformers 5 dequantizes on load exactly and starts at the logits it computes on it with
`Mxfp4Config(dequantize=True)` (1e-5), each expert read from its own bytes. DeepSeek-V3's block-scaled
FP8: every weight as transformers 5 dequantizes it, bit for bit, and the logits of transformers'
model on those weights (1e-5). Another quantization is refused by name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from checkpoint.format import CheckpointError
from checkpoint.piece import Piece
from checkpoint.shards import ShardReader
from paddle_pp.interop.pretrained import open_pretrained
from paddle_pp.interop.quantized import BLOCKS, SCALES, Fp8Reader, Mxfp4Reader, dequantize_mxfp4

import hf_models
from parity import our_logits

QUANTIZED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
IDS = np.random.default_rng(3).integers(0, 4096, size=(2, 16))


def _packed(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Random MXFP4 blocks and scales for a tensor of transformers' shape [E, in, out]: every code,
    scales from 2^-3 to 2^0."""
    experts, width, rows = shape
    blocks = rng.integers(0, 256, size=(experts, rows, width // 32, 16), dtype=np.uint8)
    return blocks, rng.integers(124, 128, size=(experts, rows, width // 32), dtype=np.uint8)


def test_dequantization_equals_transformers_own():
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _packed(np.random.default_rng(0), (3, 96, 40))
    scales[0, 0, 0], scales[1, 2, 1] = 0, 254  # the extreme exponents too
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales), theirs.transpose(1, 2).numpy())  # as 4.55's loader


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    """transformers' GPT-OSS test folder with its experts replaced by MXFP4 blocks and scales, as the
    released folders store them, and its config's quantization_config."""
    root = tmp_path_factory.mktemp("mxfp4")
    source = hf_models.make("gpt_oss", root / "bf16", hf_models.SEEDS["gpt_oss"])
    folder = root / "mxfp4"
    shutil.copytree(source, folder)
    tensors, rng = load_file(str(folder / "model.safetensors")), np.random.default_rng(1)
    for name in [n for n in tensors if n.endswith(QUANTIZED)]:
        tensors[name + BLOCKS], tensors[name + SCALES] = _packed(rng, tensors.pop(name).shape)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_an_mxfp4_folder_starts_at_the_logits_transformers_computes_on_it(mxfp4_folder, tmp_path):
    np.save(tmp_path / "ids.npy", IDS)
    hf_models.transformers5("dequantized", tmp_path / "ids.npy", mxfp4_folder, *QUANTIZED)
    theirs = np.load(f"{mxfp4_folder}.npz")
    shard = ShardReader(mxfp4_folder / "model.safetensors")
    assert len(theirs.files) == 2 * json.loads((mxfp4_folder / "config.json").read_text())["num_hidden_layers"]
    for name in theirs.files:  # what transformers dequantized on load, ours exactly
        np.testing.assert_array_equal(Mxfp4Reader(shard, shard).read(name), theirs[name], err_msg=name)
    assert open_pretrained(mxfp4_folder).config.get("quantization_config") is None, "trained unquantized"
    np.testing.assert_allclose(our_logits(mxfp4_folder, IDS), np.load(f"{mxfp4_folder}.npy"), rtol=1e-5, atol=1e-5)


def test_a_rank_reads_one_experts_bytes(mxfp4_folder):
    """A piece along the experts' axis is dequantized from that expert's blocks and scales alone and
    equals the same expert of the whole tensor."""
    shard = ShardReader(mxfp4_folder / "model.safetensors")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    reader = Mxfp4Reader(shard, shard)
    whole = reader.read(name)
    assert list(whole.shape) == reader.shape(name) == [4, 64, 256]
    for expert in range(4):
        np.testing.assert_array_equal(reader.read(name, Piece(0, 4, expert)), whole[expert:expert + 1])


def test_another_quantization_is_refused_by_name(mxfp4_folder, tmp_path):
    folder = tmp_path / "gptq"
    shutil.copytree(mxfp4_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quantization_config=.*gptq"):
        open_pretrained(folder)


FP8_BLOCK = (16, 24)  # DeepSeek's is 128 x 128: smaller here, so these widths hold several blocks, the last cut short
FP8_MAX = 448.0  # e4m3's largest value


@pytest.fixture(scope="module")
def fp8_folders(tmp_path_factory):
    """transformers' DeepSeek-V3 test folder with every projection stored as the released FP8 folders
    store it (e4m3 codes, a float32 factor per block in `_scale_inv`), and the same folder with those
    weights dequantized by transformers 5's own function (the reference for the logits)."""
    import ml_dtypes
    import torch
    from safetensors.torch import save_file as save_torch

    root = tmp_path_factory.mktemp("fp8")
    source = hf_models.make("deepseek_v3", root / "bf16", hf_models.SEEDS["deepseek_v3"])
    folder = root / "fp8"
    shutil.copytree(source, folder)
    tensors, stored = load_file(str(folder / "model.safetensors")), {}
    for name, weight in tensors.items():
        if not name.endswith("_proj.weight"):
            stored[name] = torch.from_numpy(weight)
            continue
        rows, cols = weight.shape
        grid = [-(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1])]
        padded = np.zeros((grid[0] * FP8_BLOCK[0], grid[1] * FP8_BLOCK[1]), np.float32)
        padded[:rows, :cols] = weight
        blocks = np.abs(padded).reshape(grid[0], FP8_BLOCK[0], grid[1], FP8_BLOCK[1]).max(axis=(1, 3))
        scale_inv = (np.maximum(blocks, 1e-12) / FP8_MAX).astype(np.float32)
        factors = np.repeat(np.repeat(scale_inv, FP8_BLOCK[0], 0)[:rows], FP8_BLOCK[1], 1)[:, :cols]
        codes = (weight / factors).astype(ml_dtypes.float8_e4m3fn)
        stored[name] = torch.from_numpy(codes.view(np.uint8)).view(torch.float8_e4m3fn)
        stored[name + "_scale_inv"] = torch.from_numpy(scale_inv)
    save_torch(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(FP8_BLOCK)}
    (folder / "config.json").write_text(json.dumps(config))
    hf_models.transformers5("fp8_dequantized", folder, *FP8_BLOCK)
    reference = root / "dequantized"
    shutil.copytree(source, reference)
    theirs = dict(np.load(f"{folder}.npz"))
    save_file({name: theirs.get(name, weight) for name, weight in load_file(str(source / "model.safetensors")).items()},
              str(reference / "model.safetensors"), metadata={"format": "pt"})
    return folder, reference, theirs


def test_an_fp8_folder_reads_as_transformers_dequantizes_it_and_starts_at_its_logits(fp8_folders):
    """Every FP8 weight as transformers 5 dequantizes it, bit for bit (blocks cut short at the edges),
    and the logits of transformers' model on those weights (1e-5); trained and saved unquantized."""
    folder, reference, theirs = fp8_folders
    shard = ShardReader(folder / "model.safetensors")
    assert len(theirs) > 10
    for name, expected in theirs.items():
        np.testing.assert_array_equal(Fp8Reader(shard, shard, FP8_BLOCK).read(name), expected, err_msg=name)
    opened = open_pretrained(folder)
    assert opened.config.get("quantization_config") is None and not opened.notes
    np.testing.assert_allclose(our_logits(folder, IDS), hf_models.logits(reference, IDS), rtol=1e-5, atol=1e-5)
