"""Real sequence lengths on one CPU process: with the blockwise attention core what a decoder layer
keeps for backward grows linearly with the length (measured at 2k, 4k, 8k and 16k tokens, equal to
the planner's model), where the dense core would keep several GB per layer. The run that trains at
these lengths is tests/test_context_parallel.py's: 32,768 tokens per sequence under cp2, each rank's
blockwise kernel on 16,384 of them (it replaced a one-process 16k run)."""

from __future__ import annotations

import paddle

from modeling.attention_core import CORES
from modeling.execution import Execution
from modeling.registry import config_from_dict, family_of
from paddle_pp.planning.memory import decoder_activation_bytes
from paddle_pp.runtime.layout import Layout
from paddle_pp.training.activations import rotary_constants, saved_activation_bytes
from paddle_pp.training.run_plan import plan_for

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
        measured = saved_activation_bytes(layer, lambda: layer(hidden), rotary_constants(layer, seq))
        assert measured == family_of(config).layer_saved_bytes(config, run, 1, seq), seq
        kept.append(sum(measured.values()))
        workload = plan_for(config, Layout(world_size=1), "--per_device_train_batch_size", "1", "--max_seq_length",
                            str(seq)).workload()
        assert decoder_activation_bytes(config, Layout(world_size=1), workload, 0) == kept[-1]
    assert [k / kept[0] for k in kept] == [1, 2, 4, 8], kept  # linear in the length, to the byte
    dense = plan_for(config, Layout(world_size=1), "--per_device_train_batch_size", "1", "--max_seq_length",
                     str(LENGTHS[-1]), "--no-use_flash_attention").workload()
    dense_bytes = decoder_activation_bytes(config, Layout(world_size=1), dense, 0)
    assert dense_bytes > 2 * 2**30 and dense_bytes > 30 * kept[-1]  # 2.6 GiB at only two heads; 38x
