"""Layout validation: every invalid degree combination fails fast, naming the flag and the numbers."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from paddle_pp.runtime.layout import Layout, LayoutError, parse_layout

INVALID = [
    # (flags, world size, device, words the message must contain)
    (["--tensor_parallel_degree", "3"], 4, "cpu", ["--tensor_parallel_degree 3", "does not divide the world size 4"]),
    (["--tensor_parallel_degree", "0"], 4, "cpu", ["--tensor_parallel_degree 0", "positive"]),
    (["--pipeline_parallel_degree", "-2"], 4, "cpu", ["--pipeline_parallel_degree -2", "positive"]),
    (["--sharding_parallel_degree", "0", "--sharding", "stage1"], 4, "cpu", ["--sharding_parallel_degree 0"]),
    (["--virtual_pp_degree", "0"], 4, "cpu", ["--virtual_pp_degree 0", "positive"]),
    (["--sharding_parallel_degree", "2"], 4, "cpu", ["--sharding_parallel_degree 2", "needs --sharding"]),
    (["--sharding", "stage4"], 4, "cpu", ["--sharding 'stage4'", "stage1"]),
    # the pipeline composes only with stage1
    (["--sharding", "stage3", "--sharding_parallel_degree", "2", "--pipeline_parallel_degree", "2"], 4, "cpu",
     ["--sharding stage3 with --pipeline_parallel_degree 2", "stage1"]),
    (["--virtual_pp_degree", "2"], 2, "cpu", ["--virtual_pp_degree 2", "--pipeline_parallel_degree >= 2"]),
    (["--virtual_pp_degree", "2", "--pipeline_parallel_degree", "2"], 2, "gpu", ["pipeline_parallel_degree 2", "pp > 2"]),
    (["--pipeline_parallel_degree", "2", "--sharding_parallel_degree", "2", "--sharding", "stage1",
      "--tensor_parallel_degree", "2"], 12, "cpu", ["= 8 does not divide the world size 12"]),
    # PaddleNLP's llama recipe (tp2, stage2, every other rank sharding) on one process: was a ZeroDivisionError
    (["--tensor_parallel_degree", "2", "--sharding", "stage2", "--sharding_parallel_degree", "-1"], 1, "cpu",
     ["--tensor_parallel_degree 2", "does not divide the world size 1", "--nproc_per_node 2"]),
    (["--sharding", "stage2 offload", "--sharding_parallel_degree", "2"], 2, "cpu",
     ["--sharding 'stage2 offload'", "(offload) are not supported", "--sharding stage2 alone"]),
    # sequence parallelism splits what TP replicates, and does not compose with stage2/3 yet
    (["--sequence_parallel"], 2, "cpu", ["--sequence_parallel needs --tensor_parallel_degree >= 2"]),
    (["--sequence_parallel", "--tensor_parallel_degree", "2", "--sharding", "stage2", "--sharding_parallel_degree",
      "2"], 4, "cpu", ["--sequence_parallel with --sharding stage2", "--sharding stage1"]),
    # experts are split over the data ranks (dp x sharding), never under stage2/3
    (["--expert_parallel_degree", "4"], 2, "cpu", ["--expert_parallel_degree 4 does not divide the data-parallel "
                                                   "ranks 2 (dp 2 x sharding 1"]),
    (["--expert_parallel_degree", "4", "--sharding", "stage1", "--sharding_parallel_degree", "2"], 6, "cpu",
     ["--expert_parallel_degree 4 does not divide the data-parallel ranks 6 (dp 3 x sharding 2"]),
    (["--expert_parallel_degree", "2", "--sharding", "stage2", "--sharding_parallel_degree", "2"], 4, "cpu",
     ["--expert_parallel_degree 2 with --sharding stage2", "use --sharding stage1"]),
    (["--expert_parallel_degree", "0"], 2, "cpu", ["--expert_parallel_degree 0", "positive"]),
]


@pytest.mark.parametrize("flags,world,device,words", INVALID, ids=[" ".join(c[0]) for c in INVALID])
def test_invalid_layout_names_the_flag(flags, world, device, words):
    with pytest.raises(LayoutError) as error:
        parse_layout(flags, world_size=world, device=device)
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize("flags,world", [(["--sharding", "stage2"], 1), (["--sharding", "stage2"], 2),
                                         (["--sharding", "stage3", "--sharding_parallel_degree", "-1",
                                           "--tensor_parallel_degree", "2"], 2)])
def test_stage2_or_3_over_one_sharding_rank_trains_unsharded_and_says_so(flags, world):
    """PaddleNLP's meaning ('sharding_parallel_degree=1 means no sharding'): its documented one-card
    Qwen2.5-0.5B command runs a stage2 recipe on one process."""
    layout = parse_layout(flags, world_size=world, device="cpu")
    assert layout.sharding_stage == "" and layout.group_sharded_level is None and layout.dp == world // layout.tp
    assert "training unsharded" in layout.notes[0] and flags[1] in layout.notes[0]


def test_sequence_parallel_needs_a_sequence_length_divisible_by_tp():
    layout = parse_layout(["--sequence_parallel", "--tensor_parallel_degree", "4"], world_size=4, device="cpu")
    layout.check_sequence_length(128)
    with pytest.raises(LayoutError, match="--max_seq_length 130 is not divisible by --tensor_parallel_degree 4"):
        layout.check_sequence_length(130)
    parse_layout(["--tensor_parallel_degree", "4"], world_size=4, device="cpu").check_sequence_length(130)


def test_invalid_topo_order_rejected_by_dataclass():
    with pytest.raises(LayoutError, match="--hybrid_parallel_topo_order 'mp_first'"):
        Layout(world_size=2, hybrid_parallel_topo_order="mp_first")


@pytest.mark.parametrize(
    "flags,world,expected",
    [
        ([], 8, dict(dp=8, tp=1, pp=1, sharding_degree=1)),
        (["--tensor_parallel_degree", "2", "--pipeline_parallel_degree", "2"], 8, dict(dp=2, tp=2, pp=2)),
        (["--sharding", "stage1", "--sharding_parallel_degree", "-1", "--tensor_parallel_degree", "2"], 8,
         dict(dp=1, sharding_degree=4)),
        (["--sharding", "stage1", "--sharding_parallel_degree", "2"], 8, dict(dp=4, sharding_degree=2)),
        (["--tensor_parallel_degree", "2", "--sequence_parallel"], 4, dict(dp=2, tp=2, sequence_parallel=True)),
        (["--sharding", "stage3", "--sharding_parallel_degree", "-1", "--tensor_parallel_degree", "2"], 8,
         dict(dp=1, sharding_degree=4, group_sharded_level="p_g_os")),
        (["--sharding", "stage2", "--sharding_parallel_degree", "2"], 8, dict(dp=4, group_sharded_level="os_g")),
        (["--tensor_parallel_degree", "2", "--pipeline_parallel_degree", "2", "--sharding", "stage1",
          "--sharding_parallel_degree", "2"], 16, dict(dp=2, data_replicas=4)),
    ],
)
def test_valid_layout_derives_data_parallel(flags, world, expected):
    layout = parse_layout(flags, world_size=world, device="cpu")
    for name, value in expected.items():
        assert getattr(layout, name) == value, name


@pytest.mark.parametrize("dp, sharding, ep, groups, replicas", [
    # ep divides dp: ep dp ranks of one sharding rank; the sharding peers hold the same experts
    (4, 2, 2, [[(0, 0), (1, 0)], [(0, 1), (1, 1)], [(2, 0), (3, 0)], [(2, 1), (3, 1)]],
     [[(0, 0), (0, 1), (2, 0), (2, 1)], [(1, 0), (1, 1), (3, 0), (3, 1)]]),
    # DeepSeek-V3's kind: the group spans the sharding ranks; each expert on one rank
    (2, 2, 4, [[(0, 0), (0, 1), (1, 0), (1, 1)]], [[(0, 0)], [(0, 1)], [(1, 0)], [(1, 1)]]),
    # ZeRO-1 over every data rank, ep inside it: replicas are sharding peers
    (1, 4, 2, [[(0, 0), (0, 1)], [(0, 2), (0, 3)]], [[(0, 0), (0, 2)], [(0, 1), (0, 3)]]),
])
def test_expert_groups_take_consecutive_data_ranks_and_every_expert_once(dp, sharding, ep, groups, replicas):
    """The (dp, sharding) ranks of each expert group (ordered by expert rank) and of each expert
    rank's replicas; each group holds every expert rank once."""
    layout = parse_layout(["--expert_parallel_degree", str(ep), "--sharding", "stage1", "--sharding_parallel_degree",
                           str(sharding)], world_size=dp * sharding, device="cpu")
    assert layout.experts_across_sharding == (dp % ep != 0)
    by_group, by_expert = {}, {}
    for rank in [(d, s) for d in range(dp) for s in range(sharding)]:
        group, expert = layout.expert_position(*rank)
        by_group.setdefault(group, {})[expert] = rank
        by_expert.setdefault(expert, []).append(rank)
    assert [[members[e] for e in range(ep)] for _, members in sorted(by_group.items())] == groups
    assert [ranks for _, ranks in sorted(by_expert.items())] == replicas


def test_hybrid_configs_follow_topo_order():
    layout = parse_layout(["--hybrid_parallel_topo_order", "sharding_first", "--sharding", "stage1",
                           "--sharding_parallel_degree", "2"], world_size=4, device="cpu")
    configs = layout.hybrid_configs()
    assert configs["order"] == ["dp", "sharding", "pp", "sep", "mp"]
    assert (configs["dp_degree"], configs["sharding_degree"], configs["mp_degree"], configs["pp_degree"]) == (2, 2, 1, 1)


def test_launched_invalid_layout_fails_fast_on_every_rank(tmp_path):
    """A real 2-rank launch with tp3 exits non-zero before any collective, with the message, in under 10 s."""
    from paddle_pp.runtime.launch import LaunchError, launch


    start = time.monotonic()
    with pytest.raises(LaunchError) as error:
        launch(Path(__file__).parent / "workers" / "tiny_pipe_worker.py", 2, ["--tensor_parallel_degree", "3"], work_dir=tmp_path, timeout=60)
    elapsed = time.monotonic() - start
    assert "--tensor_parallel_degree 3" in str(error.value)
    assert elapsed < 10, f"invalid layout took {elapsed:.1f}s to fail"


def test_init_rejects_world_size_mismatch():
    """A layout validated for 4 ranks must not reach fleet.init in a 1-process job."""
    code = (
        "from paddle_pp.runtime.layout import Layout; from paddle_pp.runtime.topology import init_distributed\n"
        "init_distributed(Layout(world_size=4, tensor_parallel_degree=2))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "validated for 4 processes but this job has 1" in proc.stderr


def test_gpu_tensor_parallel_strategy_syncs_replicated_parameters_and_cpu_does_not():
    """On GPU, fleet broadcasts TP-replicated parameters and gradients from TP rank 0 every step,
    RMSNorm weights included (its default name list misses them); CPU runs are deterministic."""
    from paddle_pp.runtime.topology import build_strategy

    gpu = build_strategy(Layout(world_size=2, tensor_parallel_degree=2, device="gpu"))
    assert gpu.hybrid_configs["mp_configs"].sync_param and gpu.hybrid_configs["mp_configs"].sync_grad
    assert any(pattern in "llama_rms_norm_0.w_0" for pattern in gpu.sync_param_name)
    cpu = build_strategy(Layout(world_size=2, tensor_parallel_degree=2, device="cpu"))
    assert not cpu.hybrid_configs["mp_configs"].sync_grad
