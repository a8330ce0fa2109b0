"""Real sequence lengths on one CPU process: with the blockwise attention core a tiny LLaMA trains
at 16,384 tokens per sequence, and what a decoder layer keeps for backward grows linearly with the
length (measured at 2k, 4k, 8k and 16k tokens, equal to the planner's model), where the dense core
would keep several GB per layer."""

from __future__ import annotations

import json
import subprocess
import sys

import paddle
import pytest

from modeling.attention_core import CORES
from modeling.blocks.rotary import rotary_tables
from modeling.execution import Execution
from modeling.registry import config_from_dict, family_of
from paddle_pp.planning.memory import Workload, decoder_activation_bytes
from paddle_pp.runtime.layout import Layout
from paddle_pp.training.activations import saved_activation_bytes

from runs import REPO, SCRIPT

LENGTHS = (2048, 4096, 8192, 16384)
# one decoder layer of two heads sharing one kv head (head_dim 32): attention at 16k tokens is 2.7e8
# scores per layer, a few seconds per step on 2 cores
TINY = dict(model_type="llama", vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16384)


def test_blockwise_layer_activations_grow_linearly_and_equal_the_planner():
    """The decoder layer's forward, measured by sublayer (saved-tensor hooks; the rotary tables are
    constants), equals the planner's model at each length; dense would keep over 5 GiB at 16k."""
    config = config_from_dict(dict(TINY))
    run = Execution(attention=CORES["blockwise"])
    layer = family_of(config).causal_lm(config, run).llama.layers[0]
    layer.train()
    kept = []
    for seq in LENGTHS:
        hidden = paddle.randn([1, seq, config.hidden_size])
        hidden.stop_gradient = False
        tables = frozenset(table.data_ptr() for table in rotary_tables(config, seq))
        measured = saved_activation_bytes(layer, lambda: layer(hidden), tables)
        assert measured == family_of(config).layer_saved_bytes(config, run, 1, seq), seq
        kept.append(sum(measured.values()))
        workload = Workload(per_device_train_batch_size=1, max_seq_length=seq, use_flash_attention=True)
        assert decoder_activation_bytes(config, Layout(world_size=1), workload, 0) == kept[-1]
    assert [k / kept[0] for k in kept] == [1, 2, 4, 8], kept  # linear in the length, to the byte
    dense = Workload(per_device_train_batch_size=1, max_seq_length=LENGTHS[-1], use_flash_attention=False)
    dense_bytes = decoder_activation_bytes(config, Layout(world_size=1), dense, 0)
    assert dense_bytes > 2 * 2**30 and dense_bytes > 30 * kept[-1]  # 2.6 GiB at only two heads; 38x


@pytest.mark.multiproc
def test_a_tiny_llama_trains_at_16k_tokens_per_sequence_on_one_process(data_cache, tmp_path):
    flags = [f"--{key}={value}" for key, value in TINY.items() if key not in ("vocab_size", "max_position_embeddings")]
    # the default core on CPU (--use_flash_attention) is the blockwise one
    done = subprocess.run([sys.executable, str(SCRIPT), *flags, "--max_seq_length", "16384",
                           "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1", "--max_steps",
                           "2", "--warmup_steps", "1", "--eval_steps", "0", "--eval_iters", "1", "--disable_progress_bar",
                           "--data_cache", str(data_cache), "--output_dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["loss"] < records[0]["loss"]  # an update at lr 3e-3 lowers the loss on fresh text
