"""Mixed precision (issue 29), as far as CPU can prove it: Paddle 3.3.1 has no bf16/fp16 compute
kernels on CPU and its autocast and loss scaler switch themselves off there, so what runs here is
the bookkeeping, with Paddle's own objects: parameters cast by `amp_initialize`, fp32 master
weights and Adam's states as Paddle files them, the checkpoint's save and load of them under real
layouts, the autocast lists the tracer would apply, and the strategy and wrapper choices made for
a GPU layout. What only a GPU can show is `bench/gpu_check.py`'s.

The chain of saves: a single-card fp32 run's checkpoint -> bf16 under tp2 -> bf16 under tp2 x
stage2 (with a replicated-copy drift undone by the trainer's sync) -> bf16 under stage3 -> fp32
under pp2. Each link resumes the previous save and saves at once; every tensor is compared bit
for bit."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import paddle
import pytest

from checkpoint.format import GRADIENTS, MODEL, OPTIMIZER, STATE_SEPARATOR
from checkpoint.optimizer_state import MASTER_WEIGHT, ensure_states, states_by_parameter
from checkpoint.unified_io import UnifiedReader
from paddle_pp.interop.fleet import _state_key
from paddle_pp.runtime.layout import Layout
from paddle_pp.runtime.topology import Topology, build_strategy
from paddle_pp.training import precision
from paddle_pp.training.step import eval_loss

from runs import FINAL_STEP, MICRO1, MODEL as MODEL_FLAGS, REPO, SINGLE, TP2

ADAM_STATES = ("moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc")
STAGE3 = ("--sharding_parallel_degree", "2", "--sharding", "stage3", "--stage3_segment_size", "1024")
STAGE2_TP2 = (*TP2, "--sharding_parallel_degree", "2", "--sharding", "stage2")


def _bf16(array: np.ndarray) -> np.ndarray:
    return array.astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.fixture(scope="module")
def chain(pretrain_run, run_workers_module, data_cache, tmp_path_factory):
    """{link name: its checkpoint folder}, each link resuming the one before it."""
    _, single_out = pretrain_run(SINGLE)
    folders = {"fp32": single_out / f"checkpoint-{FINAL_STEP}"}
    base = tmp_path_factory.mktemp("mixed_precision")
    links = [("bf16_tp2", "bf16", "keep", 2, (*TP2, "--save_gradients")), ("bf16_stage2_tp2", "bf16", "perturb", 4, STAGE2_TP2),
             ("bf16_stage3", "bf16", "keep", 2, STAGE3), ("fp32_pp2", "fp32", "keep", 2,
                                                          ("--pipeline_parallel_degree", "2"))]
    previous = folders["fp32"]
    for name, mode, perturb, nproc, layout in links:
        run_workers_module("mixed_precision_worker.py", nproc, [
            mode, perturb, *MODEL_FLAGS, *layout, "--data_cache", data_cache, "--resume_from_checkpoint", previous,
            "--output_dir", base / name], timeout=300, tag=name)
        previous = folders[name] = base / name / f"checkpoint-{FINAL_STEP}"
    return folders


def _readers(folder: Path) -> tuple[UnifiedReader, UnifiedReader]:
    return UnifiedReader(folder, MODEL), UnifiedReader(folder, OPTIMIZER)


def _state(name: str, state: str) -> str:
    return f"{name}{STATE_SEPARATOR}{state}"


@pytest.mark.multiproc
def test_fp32_checkpoint_resumes_in_bf16_with_its_weights_as_masters_and_every_adam_state(chain):
    """The bf16 run's masters are the fp32 weights themselves (not the bf16-rounded parameters
    they would be made from), its weights file holds those rounded parameters, and every moment
    and beta power survives a save: before the fix Adam's states, filed under the masters' names,
    were dropped from the file."""
    fp32_weights, fp32_states = _readers(chain["fp32"])
    bf16_weights, bf16_states = _readers(chain["bf16_tp2"])
    for name in fp32_weights.tensors:
        weight = fp32_weights.read(name)
        assert np.array_equal(bf16_states.read(_state(name, MASTER_WEIGHT)), weight), name
        assert np.array_equal(bf16_weights.read(name), _bf16(weight)), name
        for state in ADAM_STATES:
            assert np.array_equal(bf16_states.read(_state(name, state)), fp32_states.read(_state(name, state))), \
                (name, state)
    assert len(bf16_states.tensors) == len(fp32_weights.tensors) * (len(ADAM_STATES) + 1)


@pytest.mark.multiproc
def test_bf16_gradients_are_saved_widened_to_fp32(chain):
    """`--save_gradients` under bf16 x tp2: the recorder holds bf16 tensors (here copies of the bf16
    parameters, see the worker), saved as fp32 equal to the weights file; before the fix their
    uint16 bits were refused."""
    weights, gradients = UnifiedReader(chain["bf16_tp2"], MODEL), UnifiedReader(chain["bf16_tp2"], GRADIENTS)
    assert {key.split(STATE_SEPARATOR)[0] for key in gradients.tensors} == set(weights.tensors)
    for key in gradients.tensors:
        assert gradients.read(key).dtype == np.float32
        assert np.array_equal(gradients.read(key), weights.read(key.split(STATE_SEPARATOR)[0])), key


@pytest.mark.multiproc
@pytest.mark.parametrize("link", ["bf16_stage2_tp2", "bf16_stage3"])
def test_bf16_checkpoint_resumes_in_bf16_under_another_layout_bit_for_bit(chain, link):
    """tp2 -> tp2 x stage2 (whose masters stage2's optimizer makes itself, under the parameter's
    name) -> stage3 (masters of flat slices, filed under the unsliced name). In the stage2 link tp
    rank 1 first drifts every replicated tensor by +1 and the trainer's sync must undo it, else
    the save's replica check fails or the file differs."""
    before = dict(zip((MODEL, OPTIMIZER), _readers(chain["bf16_tp2"])))
    after = dict(zip((MODEL, OPTIMIZER), _readers(chain[link])))
    for kind, reader in before.items():
        assert after[kind].tensors.keys() == reader.tensors.keys(), kind
        for name in reader.tensors:
            assert np.array_equal(after[kind].read(name), reader.read(name)), (link, name)


@pytest.mark.multiproc
def test_bf16_checkpoint_resumes_in_fp32_from_the_masters(chain):
    """Under fp32 (and pp2) the weights are the bf16 run's masters, not its rounded weights, and
    the fp32 run keeps no masters of its own."""
    _, bf16_states = _readers(chain["bf16_stage3"])
    fp32_weights, fp32_states = _readers(chain["fp32_pp2"])
    for name in fp32_weights.tensors:
        assert np.array_equal(fp32_weights.read(name), bf16_states.read(_state(name, MASTER_WEIGHT))), name
    assert {key.split(STATE_SEPARATOR)[1] for key in fp32_states.tensors} == set(ADAM_STATES)
    for key in fp32_states.tensors:
        assert np.array_equal(fp32_states.read(key), bf16_states.read(key)), key


def _bf16_layer_and_optimizer():
    """A Linear cast to bf16 by Paddle's own O2 initialisation, with a multi-precision AdamW whose
    states exist (`ensure_states`)."""
    paddle.seed(3)
    layer = paddle.nn.Sequential(paddle.nn.Linear(4, 3), paddle.nn.LayerNorm(3))
    optimizer = paddle.optimizer.AdamW(parameters=layer.parameters())
    precision.decorate(layer, optimizer, "bfloat16")
    ensure_states(optimizer)
    return layer, optimizer


def test_optimizer_states_are_keyed_by_parameter_under_master_weights():
    layer, optimizer = _bf16_layer_and_optimizer()
    assert {p.dtype for p in layer.parameters()} == {paddle.bfloat16}
    assert all(key.endswith("_fp32_master_0") for key in optimizer._accumulators["moment1"])  # how Paddle files them
    states = states_by_parameter(optimizer)
    assert set(states) == {p.name for p in layer.parameters()}
    for param in layer.parameters():
        assert set(states[param.name]) == {*ADAM_STATES, MASTER_WEIGHT}
        assert states[param.name][MASTER_WEIGHT].dtype == paddle.float32
        assert np.array_equal(states[param.name][MASTER_WEIGHT].numpy(), param.astype("float32").numpy())


def test_fleet_optimizer_variables_of_a_mixed_precision_run_map_to_their_states():
    """The names Paddle gives a multi-precision AdamW's variables in `state_dict()` (what PaddleNLP's
    per-rank .pdopt files hold) map to '<structured name>/<state>'."""
    layer, optimizer = _bf16_layer_and_optimizer()
    structured = {param.name: name for name, param in layer.state_dict().items()}
    names = [key for key, value in optimizer.state_dict().items() if isinstance(value, paddle.Tensor)]
    assert names and all("_fp32_master_0_" in name for name in names)
    mapped = {_state_key(name, structured) for name in names}
    assert mapped == {_state(name, state) for name in structured.values() for state in ADAM_STATES}


def test_autocast_keeps_paddlenlp_lists():
    """What the tracer applies inside the trainer's autocast (set even on CPU, where the level stays
    O0): the embedding white-listed (Paddle's O2 default black-lists it, keeping the residual stream
    in fp32), sums and the parallel cross entropy black-listed."""
    tracer = paddle.base.framework._dygraph_tracer()
    with precision.autocast("bfloat16"):
        white, black = tracer._get_amp_op_list()
    assert {"lookup_table", "lookup_table_v2"} <= set(white)
    assert not {"lookup_table", "lookup_table_v2"} & set(black)
    assert {"reduce_sum", "c_softmax_with_cross_entropy"} <= set(black)


class _AutocastWitness(paddle.nn.Layer):
    """A model that records the autocast white list in force whenever it runs."""

    def __init__(self):
        super().__init__()
        self.white_lists: list[set] = []

    def forward(self, ids):
        self.white_lists.append(set(paddle.base.framework._dygraph_tracer()._get_amp_op_list()[0]))
        return paddle.zeros([*ids.shape, 8])


def test_evaluation_runs_under_the_training_autocast():
    """Before the fix evaluation ran outside autocast, with bf16 parameters: Paddle refused the
    mixed-dtype matmuls (on GPU), and the trainer's last-step evaluation came before its final save."""
    model, ids = _AutocastWitness(), paddle.zeros([2, 4], "int64")
    single = Topology(Layout(world_size=1), None, 0, 0, 0, 0, 0)
    eval_loss(model, lambda logits, labels: logits.mean(), ids, ids, single, "bfloat16")
    assert "lookup_table_v2" in model.white_lists[-1]
    eval_loss(model, lambda logits, labels: logits.mean(), ids, ids, single, None)
    assert "lookup_table_v2" not in model.white_lists[-1]


BF16_RTOL = 2.0**-8  # one bf16 rounding of the loss


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [(1, ()), (2, (*TP2, "--sequence_parallel")), (2, ("--pipeline_parallel_degree", "2"))],
                         ids=["single", "tp2_sp", "pp2"])
def test_bf16_training_and_evaluation_never_mix_dtypes(pretrain_run, run_workers, data_cache, tmp_path, layout):
    """A bf16 training step and evaluation under `dtype_audit` (tests/workers/dtype_audit.py): no op
    of the forward, the loss, the backward or the collectives meets bf16 and fp32 inputs together,
    the one exception being the optimizer's update, which takes each bf16 parameter with its fp32
    master and moments. Before the fix the rotary tables promoted q and k to fp32 and the attention
    multiplied fp32 probabilities by bf16 values (Paddle refuses that matmul on GPU). The step's loss
    is the fp32 run's within one bf16 rounding."""
    (reference, *_), _ = pretrain_run(SINGLE)
    nproc, flags = layout
    results = run_workers("dtype_audit_worker.py", nproc, [*MODEL_FLAGS, *flags, "--data_cache", data_cache,
                                                           "--output_dir", tmp_path / "out"])
    for result in results:
        assert result["parameter_dtypes"] == ["paddle.bfloat16"]
        assert {op for op, _ in result["mixed"]} == {"adamw_"}, result["mixed"]
        np.testing.assert_allclose(result["loss"], reference["losses"][0], rtol=BF16_RTOL)
        assert np.isfinite(result["eval_loss"])


def _gpu_layout(**degrees) -> Layout:
    return Layout(world_size=4, device="gpu", **degrees)


@pytest.mark.parametrize("degrees, partial", [
    ({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2}, True),
    ({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "sequence_parallel": True}, False),
])
def test_partial_send_recv_only_where_every_tp_rank_holds_the_same_activation(degrees, partial):
    assert build_strategy(_gpu_layout(**degrees)).pipeline_configs["enable_partial_send_recv"] is partial
    assert build_strategy(Layout(world_size=4, **degrees)).pipeline_configs["enable_partial_send_recv"] is False


@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_fp16_under_stage2_and_stage3_scales_with_group_sharded_scaler(stage):
    """Its unscale first gathers the reduced gradient slices (`update_slice`) and checks them for inf."""
    scaler = precision.loss_scaler("float16", _gpu_layout(sharding_parallel_degree=4, sharding=stage), 2.0**15)
    assert inspect.getsourcefile(scaler._unscale).endswith("group_sharded_utils.py")
    assert precision.loss_scaler("bfloat16", _gpu_layout(sharding_parallel_degree=4, sharding=stage), 2.0**15) is None


def test_master_grad_with_stage3_is_refused_by_name():
    layout = _gpu_layout(sharding_parallel_degree=4, sharding="stage3")
    with pytest.raises(precision.PrecisionError, match="--amp_master_grad with --sharding stage3"):
        precision.compute_dtype(True, False, True, layout)
    for stage in ("stage1", "stage2"):
        assert precision.compute_dtype(True, False, True, _gpu_layout(sharding_parallel_degree=4, sharding=stage)) \
            == "bfloat16"


def _accumulated(micro: dict, name: str, ranks: list[int], owner: int, steps: int) -> np.ndarray:
    """fp32 sum of every rank's bf16 micro-batch gradients (widened) in the order fleet adds them: per
    micro-batch the owner's own, then the others' (stage2 reduces to the owner after each backward)."""
    total = None
    for step in range(steps):
        for rank in [owner] + [r for r in ranks if r != owner]:
            grad = micro[f"{rank}/{name}/{step}"]
            total = grad.copy() if total is None else total + grad
    return total


MASTER_GRAD_LAYOUTS = {"tp2_pp2": (4, (*TP2, "--pipeline_parallel_degree", "2")),
                       "stage2": (2, ("--sharding_parallel_degree", "2", "--sharding", "stage2"))}


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(MASTER_GRAD_LAYOUTS))
def test_master_grad_accumulates_bf16_micro_batches_into_fp32_bit_for_bit(pretrain_run, run_workers, data_cache,
                                                                          tmp_path, layout):
    """--amp_master_grad with 8 (tp2 x pp2) or 4 (stage2) micro-batches per step (PaddleNLP's benchmark
    recipes use 4 to 1024),
    a bf16 step under `dtype_audit`: every gradient the update receives is the fp32 sum of the bf16
    micro-batch gradients bit for bit (under stage2 the sharding group's, averaged by its 1/2, on
    the rank that owns the parameter); no op mixes dtypes but the fp32 accumulation itself (add_)
    and AdamW's update; the loss is fp32's within one bf16 rounding."""
    (reference, *_), _ = pretrain_run(SINGLE)
    nproc, flags = MASTER_GRAD_LAYOUTS[layout]
    sharding = nproc if layout == "stage2" else 1
    steps = 8 // sharding  # the test model's global batch of 8, one sample per micro-batch
    results = run_workers("master_grad_worker.py", nproc, [*MODEL_FLAGS, *MICRO1, *flags, "--amp_master_grad",
                                                            "--data_cache", data_cache, "--output_dir", tmp_path / "out"])
    checked = set()
    for result in results:
        assert {op for op, _ in result["mixed"]} == {"add_", "adamw_"}, result["mixed"]
        np.testing.assert_allclose(result["loss"], reference["losses"][0], rtol=BF16_RTOL)
        received = dict(np.load(f"{result['files']}.received.npz"))
        micro = dict(np.load(f"{result['files']}.micro.npz"))
        for name, grad in received.items():
            assert f"0/{name}/{steps - 1}" in micro and f"0/{name}/{steps}" not in micro, name
            expected = _accumulated(micro, name, list(range(sharding)), result["sharding_rank"], steps)
            np.testing.assert_array_equal(grad, expected * np.float32(1 / sharding), err_msg=name)
        checked |= set(received)
    assert len(checked) == 39  # every parameter of the test model, on the rank(s) that update it


SCALER_LAYOUTS = {"single": (1, ()), "tp2": (2, TP2), "stage3": (2, STAGE3)}


@pytest.mark.multiproc
@pytest.mark.parametrize("saved_as, resumed_as", [("single", "tp2"), ("stage3", "single")])
def test_fp16_loop_skips_overflowed_updates_without_the_schedule_and_resumes_the_loss_scale(
        run_workers, data_cache, tmp_path, saved_as, resumed_as):
    """Paddle's own scalers as the trainer picks them (plain on one card, fleet's under TP,
    `GroupShardedScaler` under stage3), built past their CPU switch-off, over fp32 compute, with an
    overflowed gradient at steps 1 and 3: those steps leave the weights and the learning rate where
    they were and halve the scale; the scale reached is saved and a resume under another layout starts
    from it. Before the fixes the schedule stepped on every step, each resume restarted at
    --scale_loss, on one card fleet's scaler failed at its first step for want of a process group, and
    under stage3 fleet's scaler looked at the gradients before the reduced slices arrived, missed the
    first overflow and applied it (every later step then overflowed)."""
    out = tmp_path / "out"
    flags = [*MODEL_FLAGS, "--max_steps", "8", "--warmup_steps", "8", "--scale_loss", "1024", "--save_steps", "6",
             "--data_cache", data_cache, "--output_dir", out]
    nproc, layout = SCALER_LAYOUTS[saved_as]
    first, *others = run_workers("loss_scale_worker.py", nproc, ["1,3", *flags, *layout, "--exit_after_steps", "6"],
                                 tag="first")
    skipped = [bool(record.get("update_skipped")) for record in first["history"]]
    assert all([bool(record.get("update_skipped")) for record in other["history"]] == skipped for other in others)
    assert skipped == [True, False, True, False, False, False]
    weights = [first["weights_before"], *first["weights_after_update"]]
    lrs = [record["lr"] for record in first["history"]]  # rising every step of the warmup that an update ran
    for step, was_skipped in enumerate(skipped):
        assert (weights[step + 1] == weights[step]) is was_skipped, step
        if step + 1 < len(lrs):
            assert (lrs[step + 1] == lrs[step]) is was_skipped, (step, lrs)
    assert first["scaler_built"]["scale"] == 1024 and first["scaler_final"]["scale"] == 256
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["lr_scheduler"]["last_epoch"] == 4
    assert state["loss_scaler"] == first["scaler_final"]
    nproc, layout = SCALER_LAYOUTS[resumed_as]
    resumed, *_ = run_workers("loss_scale_worker.py", nproc, ["8", *flags, *layout, "--resume_from_checkpoint",
                                                             "latest"], tag="resumed")
    assert resumed["scaler_built"] == first["scaler_final"]
    assert [record.get("update_skipped", False) for record in resumed["history"]] == [False, True]
    assert resumed["scaler_final"]["scale"] == 128


def test_gpu_check_refuses_clearly_without_a_gpu(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--work_dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "CPU build" in done.stderr and "paddlepaddle-gpu" in done.stderr
    assert not any(tmp_path.iterdir()), "nothing may run before the refusal"
