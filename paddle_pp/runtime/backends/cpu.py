"""Fleet hybrid parallel on CPU processes over gloo: every Paddle internal we replace, in one place.

Stock Paddle 3.3.1 fleet assumes NCCL: its tensor-parallel ops have no CPU kernels, its pipeline
p2p uses calc-stream variants gloo lacks, and its gloo groups collide in one shared store. Each
patch below names the failing upstream call it replaces. `apply()` is idempotent, is called by
`paddle_pp.runtime.topology` only when the device is CPU, and fails loudly if an internal it replaces has
moved (a different Paddle version). Nothing here runs on GPU, where NCCL and stock fleet run.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import types
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer

from paddle_pp.runtime.launch import free_port
from paddle_pp.runtime.normal_range import exp_normal, flush_subnormals_
from paddle_pp.runtime.startup import GIVEN_MATH_THREADS

TARGET_PADDLE_VERSION = "3.3.1"

_applied = False
STORE_TIMEOUT_S = 900  # Paddle's default FLAGS_stop_check_timeout, the job store's own timeout
LISTEN_PROBE_INTERVAL_S, LISTEN_PROBE_CONNECT_S = 0.01, 5.0
PROCESS_FDS = "/proc/self/fd"
_group_stores: list[Any] = []  # per-group TCPStores must outlive their process groups


class CPUBackendError(RuntimeError):
    """A Paddle internal that the CPU backend replaces is missing."""


def _require(module: Any, name: str) -> Any:
    if not hasattr(module, name):
        raise CPUBackendError(
            f"paddle {paddle.__version__} has no {module.__name__}.{name}, which paddle_pp's CPU backend "
            f"replaces (written for paddle {TARGET_PADDLE_VERSION}); install paddlepaddle=={TARGET_PADDLE_VERSION} "
            "for CPU runs, or run on GPU where no patch is applied."
        )
    return getattr(module, name)


def _replace(module: Any, name: str, value: Any) -> None:
    _require(module, name)
    setattr(module, name, value)


def _group_or_default(group: Any) -> Any:
    from paddle.distributed import collective

    return collective._get_default_group() if group is None else group


# ---------------------------------------------------------------- tensor-parallel ops (mp_ops)

class _CopyToParallel(PyLayer):
    """Identity forward, all-reduce backward: replaces `_C_ops.c_identity` (no CPU kernel). The output
    is a view of the input (returning the input itself is an in-place op to PyLayer), so the q, k and
    v projections of one input keep one copy of it for backward, not three."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        dy = dy.clone()
        dist.all_reduce(dy, group=ctx.group)
        return dy


class _ReduceFromParallel(PyLayer):
    """All-reduce forward, identity backward: replaces `all_reduce_on_calc_stream` + `c_identity` grad."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, dy):
        return dy


def _gather_last_axis(x, group):
    parts: list = []
    dist.all_gather(parts, x, group=group)
    return paddle.concat(parts, axis=-1)


def _own_slice_last_axis(x, group):
    width = x.shape[-1] // group.nranks
    return x[..., group.rank * width:(group.rank + 1) * width].clone()


class _SplitLastAxis(PyLayer):
    """Keep this rank's slice forward, all-gather backward: replaces `_C_ops.c_split` (no CPU kernel)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_slice_last_axis(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _gather_last_axis(dy, ctx.group)


class _GatherLastAxis(PyLayer):
    """All-gather forward, own slice backward: replaces `_C_ops.c_concat` (no CPU kernel)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_axis(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _own_slice_last_axis(dy, ctx.group)


class _VocabParallelCrossEntropy(PyLayer):
    """Softmax cross-entropy over vocab-split logits: replaces `_C_ops.c_softmax_with_cross_entropy`.

    Max and sum of exponentials are all-reduced so every rank sees the full-vocab normaliser; the
    target logit comes from the rank whose slice holds it. Gradient: softmax - onehot, locally.
    """

    @staticmethod
    def forward(ctx, logits, label, group, ignore_index):
        local_vocab = logits.shape[-1]
        start = group.rank * local_vocab
        row_max = logits.max(axis=-1, keepdim=True)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max
        exp = exp_normal(shifted)  # logits 87 nats under the row's maximum: 0, not subnormal
        denom = exp.sum(axis=-1, keepdim=True)
        dist.all_reduce(denom, group=group)

        local_label = label.astype("int64") - start
        owned = paddle.logical_and(local_label >= 0, local_label < local_vocab)
        safe_index = paddle.where(owned, local_label, paddle.zeros_like(local_label))
        target = paddle.take_along_axis(shifted, safe_index, axis=-1) * owned.astype(logits.dtype)
        dist.all_reduce(target, group=group)

        kept = (label != ignore_index).astype(logits.dtype)
        loss = (paddle.log(denom) - target) * kept
        softmax = flush_subnormals_(exp / denom)
        ctx.save_for_backward(softmax, safe_index, owned.astype(logits.dtype), kept)
        ctx.mark_non_differentiable(softmax)
        return loss, softmax

    @staticmethod
    def backward(ctx, dloss, _dsoftmax=None):
        softmax, safe_index, owned, kept = ctx.saved_tensor()
        onehot = paddle.nn.functional.one_hot(safe_index.squeeze(-1), softmax.shape[-1]).astype(softmax.dtype)
        grad = (softmax - onehot * owned) * (dloss * kept)
        return flush_subnormals_(grad), None


def _c_identity(tensor, group=None, skip_c_identity_dynamic=False):
    if group is not None and not group.is_member():
        return None
    if skip_c_identity_dynamic:
        return tensor
    return _CopyToParallel.apply(tensor, _group_or_default(group))


def _mp_allreduce(tensor, op=None, group=None, use_calc_stream=True, use_model_parallel=True,
                  skip_c_identity_dynamic=False):
    if group is not None and not group.is_member():
        return None
    if op is not None and op != dist.ReduceOp.SUM:
        raise ValueError(f"_mp_allreduce supports only ReduceOp.SUM, got {op}")
    return _ReduceFromParallel.apply(tensor, _group_or_default(group))


def _c_split(tensor, group=None):
    if group is not None and not group.is_member():
        return None
    return _SplitLastAxis.apply(tensor, _group_or_default(group))


def _c_concat(tensor, group=None):
    if group is not None and not group.is_member():
        return None
    return _GatherLastAxis.apply(tensor, _group_or_default(group))


def _c_softmax_with_cross_entropy(logits, label, group=None, return_softmax=False, ignore_index=-100):
    if group is not None and not group.is_member():
        return None
    if len(label.shape) == len(logits.shape) - 1:
        label = label.unsqueeze(-1)
    loss, softmax = _VocabParallelCrossEntropy.apply(logits, label, _group_or_default(group), ignore_index)
    return (loss, softmax) if return_softmax else loss


_TP_OPS = {
    "_c_identity": _c_identity,
    "_mp_allreduce": _mp_allreduce,
    "_c_split": _c_split,
    "_c_concat": _c_concat,
    "_c_softmax_with_cross_entropy": _c_softmax_with_cross_entropy,
}


def _patch_tp_ops() -> None:
    from paddle.distributed import collective
    from paddle.distributed.fleet.layers.mpu import mp_ops

    for name, replacement in _TP_OPS.items():
        _replace(mp_ops, name, replacement)  # mp_layers calls them as mp_ops.<name>
        _replace(collective, name, replacement)  # re-exported aliases (PaddleNLP's parallel_matmul uses these)


# ---------------------------------------------------------------- device id and input broadcast

def _patch_device_id() -> None:
    """`PipelineLayer.__init__` reads `ParallelEnv().device_id`; `_device_id` is never set on CPU."""
    from paddle.distributed import parallel

    _require(parallel.ParallelEnv, "device_id")
    parallel.ParallelEnv.device_id = property(lambda self: getattr(self, "_device_id", 0))


def _broadcast_input_data(hcg, *inputs, **kwargs):
    """`hybrid_parallel_util.broadcast_input_data` asserts a GPU/XPU device; the broadcast itself works on gloo."""
    from paddle.distributed.fleet.utils import hybrid_parallel_util as util

    place = paddle.CPUPlace()
    if inputs:
        inputs = util._broadcast_nested_data(hcg, "cpu", place, inputs)
    if kwargs:
        kwargs = util._broadcast_nested_data(hcg, "cpu", place, kwargs)
    return inputs, kwargs


def _patch_input_broadcast() -> None:
    from paddle.distributed.fleet.meta_parallel import tensor_parallel
    from paddle.distributed.fleet.utils import hybrid_parallel_util

    _require(hybrid_parallel_util, "_broadcast_nested_data")
    _replace(hybrid_parallel_util, "broadcast_input_data", _broadcast_input_data)
    _replace(tensor_parallel, "broadcast_input_data", _broadcast_input_data)  # imported by name there


# ---------------------------------------------------------------- pipeline p2p

_edge_groups: dict[tuple[int, int, str], Any] = {}  # (src, dst, "fwd" | "bwd") -> 2-rank gloo group
_p2p_threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="paddle_pp_p2p")  # one per edge direction (and ring stream)


def create_pipeline_edge_groups(hcg, wrap_around: bool) -> None:
    """One 2-rank gloo group per pipeline edge and direction; every rank creates all, in one order.

    Gloo tags each send and recv with its group's running op count, so p2p on the shared pipe
    group pairs up only while both peers have done equally many ops on it: with pp >= 3 a middle
    stage's send carries a later tag than the next stage's receive expects, and both wait until
    gloo's 30 s timeout aborts them. A group that carries one direction between two ranks always
    pairs the i-th send with the i-th receive. Activations ("fwd") and gradients ("bwd") get
    separate groups, so with pp = 2, where both neighbours are one rank, they cannot cross.
    `wrap_around` adds the last -> first stage edges the interleaved (virtual) schedule uses.
    """
    for ranks in hcg.topology().get_comm_list("pipe"):
        edges = len(ranks) if wrap_around else len(ranks) - 1
        for i in range(edges):
            a, b = ranks[i], ranks[(i + 1) % len(ranks)]
            _edge_groups[(a, b, "fwd")] = dist.new_group([a, b])
            _edge_groups[(b, a, "bwd")] = dist.new_group([a, b])


RING_STREAMS = ("kv", "grad")  # ring attention's two streams, in flight at once in backward


def create_ring_edge_groups(hcg) -> None:
    """One 2-rank gloo group per edge of every context-parallel ring (fleet's `sep` groups) and
    stream, for the same reason as the pipeline's: on one shared group gloo would pair a rank's i-th
    send with a peer's receive of another round, and the k/v and gradient streams overlap. Every
    rank creates all of them, in one order."""
    for ranks in hcg.topology().get_comm_list("sep"):
        for i in range(len(ranks)):
            a, b = ranks[i], ranks[(i + 1) % len(ranks)]
            for stream in RING_STREAMS:
                _edge_groups[(a, b, f"ring_{stream}")] = dist.new_group([a, b])


def start_ring_shift(sent, received, me: int, nxt: int, prev: int, stream: str) -> Callable[[], None]:
    """Start one step along a context-parallel ring: `sent` to the next rank, `received` from the
    previous, one thread per edge direction (gloo's send blocks until the peer receives); returns
    the wait. Replaces `batch_isend_irecv` on the cp group, which gloo's calc-stream p2p cannot run."""
    futures = [_p2p_threads.submit(_transfer, sent, _edge(me, nxt, f"ring_{stream}"), nxt, True),
               _p2p_threads.submit(_transfer, received, _edge(prev, me, f"ring_{stream}"), prev, False)]

    def wait() -> None:
        for future in futures:
            future.result()

    return wait


def exchange_rows(rows, counts, me: int, group):
    """Replaces `alltoall_single` for expert parallelism (gloo has no all-to-all: NotImplementedError;
    and an all_gather of unequal shapes aborts the process): every rank pads its rows to the
    longest send of the group (`counts[s, d]`: rows rank s sends rank d, known to all), one
    all_gather, and each keeps the rows addressed to it, by source. It moves ep x the longest send
    to every rank where an all-to-all moves only its own rows (bench/expert_parallel.py measures both)."""
    longest = int(counts.sum(axis=1).max())
    padding = paddle.zeros([longest - rows.shape[0], *rows.shape[1:]], rows.dtype)
    gathered: list = []
    dist.all_gather(gathered, paddle.concat([rows, padding]) if padding.shape[0] else rows, group=group)
    starts = np.concatenate([np.zeros([len(counts), 1], np.int64), np.cumsum(counts, axis=1)], axis=1)
    return paddle.concat([gathered[s][int(starts[s, me]):int(starts[s, me + 1])] for s in range(len(counts))])


def _edge(src: int, dst: int, direction: str) -> Any:
    try:
        return _edge_groups[(src, dst, direction)]
    except KeyError:
        raise CPUBackendError(
            f"no p2p group {src}->{dst} ({direction}); paddle_pp.topology.init_distributed creates the pipeline's "
            "(with wrap-around edges only when --virtual_pp_degree > 1) and the context-parallel rings'") from None


def _transfer(tensors, group, peer: int, send: bool) -> None:
    """Blocking sends or receives of one edge, in order (their tags follow the group's op count)."""
    process_group, peer_in_group = group.process_group, group.get_group_rank(peer)
    for tensor in tensors if isinstance(tensors, (tuple, list)) else [tensors]:
        (process_group.send if send else process_group.recv)(tensor, peer_in_group, True)


def _pipeline_p2p(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, hcg) -> list:
    """Replaces `p2p_communication._batched_p2p_ops` and `_p2p_ops` (NCCL calc-stream p2p on the
    shared pipe group, which gloo lacks and whose tags diverge).

    NCCL's grouped p2p posts every send and receive at once. Paddle's gloo send blocks until the
    peer receives, even with sync_op=False, so one thread per edge runs its transfers (gloo
    releases the GIL while it waits) and all are joined before returning; a gloo error surfaces
    here as a Python exception rather than an abort."""
    me, prev, nxt = hcg.get_global_rank(), hcg._get_p2p_prev_rank(), hcg._get_p2p_next_rank()
    _run_on_edges([(tensors, edge) for tensors, edge in ((tensor_send_next, (me, nxt, "fwd")),
                                                         (tensor_recv_prev, (prev, me, "fwd")),
                                                         (tensor_send_prev, (me, prev, "bwd")),
                                                         (tensor_recv_next, (nxt, me, "bwd")))
                   if tensors is not None], me)
    return []


def _run_on_edges(transfers: list, me: int) -> None:
    """Each (tensors, (src, dst, direction)) on its edge group, one thread per edge (this rank sends
    when it is src), all joined before returning."""
    futures = [_p2p_threads.submit(_transfer, tensors, _edge(*edge), edge[1] if edge[0] == me else edge[0],
                                   edge[0] == me) for tensors, edge in transfers]
    for future in futures:
        future.result()


def _meta_on_edges(upstream_send, upstream_recv):
    """`SendRecvMeta.send_meta/recv_meta` send shapes over the shared pipe group (same tag problem);
    these route them over the edge group of the direction they describe."""
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    def send_meta(self, tensor, group, reverse=False, broadcast=False):
        if not broadcast:
            me = p2p._hcg.get_global_rank()
            group = _edge(me, p2p._hcg._get_p2p_prev_rank(), "bwd") if reverse else \
                _edge(me, p2p._hcg._get_p2p_next_rank(), "fwd")
        return upstream_send(self, tensor, group, reverse, broadcast)

    def recv_meta(self, group, reverse=False, broadcast=False):
        if not broadcast:
            me = p2p._hcg.get_global_rank()
            group = _edge(p2p._hcg._get_p2p_next_rank(), me, "bwd") if reverse else \
                _edge(p2p._hcg._get_p2p_prev_rank(), me, "fwd")
        return upstream_recv(self, group, reverse, broadcast)

    return send_meta, recv_meta


def _interleave_sanity(needs_double_accumulation: bool):
    """Replaces the interleaved schedules' `_check_sanity`. Paddle asserts pp > 2 there because with
    NCCL two messages to the single neighbour of pp = 2 can meet the wrong receive; the edge groups
    above rule that out on CPU. The other checks are kept as upstream has them."""

    def check_sanity(self):
        if not paddle.in_dynamic_mode():
            raise AssertionError("virtual pipeline stage with interleave only supports eager dygraph mode")
        if needs_double_accumulation and self.accumulate_steps < 2 * self.num_stages:
            raise AssertionError(f"accumulate_steps ({self.accumulate_steps}) should be >= 2 * num_stages "
                                 f"({self.num_stages}) for pipeline with interleave")

    return check_sanity


def _dualpipev_commit(self, p2p_overlap: bool = False, use_outer_event_wait: bool = False) -> None:
    """Replaces `DualPipeVParallel._commit_and_wait_comm`, which asks the device for its current
    stream and a GPU build's `deep_ep` for events to order the p2p stream against compute, on every
    call. A CPU rank has one stream (and p2p overlap is off), so the exchange is all there is: the
    activations' messages, then the gradients', each set complete before the next, as upstream
    orders them; then the sent activations are freed."""
    for ops in (self.comm_forward_ops, self.comm_backward_ops):
        if ops:
            _dualpipev_p2p(ops)
    self.comm_forward_ops, self.comm_backward_ops = [], []
    self._free_tensors()


def _dualpipev_p2p(ops: list) -> None:
    """In place of `batch_isend_irecv` in `dualpipev.py` (NCCL's grouped calc-stream p2p, which gloo
    lacks). DualPipeV's two chunks per stage send both ways between neighbours; each message goes
    over the edge group of its direction (down the stages "fwd", up "bwd"), one thread per edge
    runs that edge's transfers in the order posted (as NCCL orders a pair's messages), and all are
    joined before returning."""
    from paddle.distributed import fleet, isend

    me = dist.get_rank()
    stage = fleet.get_hybrid_communicate_group().get_pipe_parallel_group().ranks.index
    by_edge: dict[tuple[int, int, str], list] = {}
    for op in ops:
        src, dst = (me, op.peer) if op.op is isend else (op.peer, me)
        by_edge.setdefault((src, dst, "fwd" if stage(dst) > stage(src) else "bwd"), []).append(op.tensor)
    _run_on_edges([(tensors, edge) for edge, tensors in by_edge.items()], me)


def _patch_dualpipev() -> None:
    from paddle.distributed.fleet.meta_parallel import dualpipev

    _replace(dualpipev.DualPipeVParallel, "_commit_and_wait_comm", _dualpipev_commit)


def _patch_pipeline_p2p() -> None:
    from paddle.distributed.fleet.meta_parallel import pipeline_parallel
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication

    _require(p2p_communication, "_batched_p2p_ops")
    _replace(p2p_communication, "_batched_p2p_ops", _pipeline_p2p)
    _replace(p2p_communication, "_p2p_ops", _pipeline_p2p)
    meta = _require(p2p_communication, "SendRecvMeta")
    send_meta, recv_meta = _meta_on_edges(meta.send_meta, meta.recv_meta)
    meta.send_meta, meta.recv_meta = send_meta, recv_meta
    for name, needs_double_accumulation in (("PipelineParallelWithInterleave", True),
                                            ("PipelineParallelWithInterleaveFthenB", False)):
        _require(pipeline_parallel, name)._check_sanity = _interleave_sanity(needs_double_accumulation)


# ---------------------------------------------------------------- group-sharded stage2 / stage3

class _ModuleView(types.ModuleType):
    """A module as one upstream module sees it: `overrides` replace a few attributes, every other
    attribute is the real module's. Bound as that module's global, it changes nothing elsewhere."""

    def __init__(self, real: types.ModuleType, **overrides: Any):
        super().__init__(real.__name__)
        self._real = real
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _param_storage_on_host(upstream):
    """`ParamStorage.add_rank_params(convert_gpu=True)` moves each parameter into the rank buffer by
    `param.cpu()` then `param._clear_data()`: on CPU `.cpu()` is the same tensor, so it clears the
    value it is about to copy ("Tensor not initialized yet"). On CPU the buffer is already where it
    belongs: copy without the device move."""

    def add_rank_params(self, trainable_params, param2align, convert_gpu=True):
        return upstream(self, trainable_params, param2align, convert_gpu and self._device != "cpu")

    return add_rank_params


def _patch_group_sharded() -> None:
    """Paddle's own stage2 (`os_g`) and stage3 (`p_g_os`) on CPU processes over gloo. Their
    collectives are plain broadcast / reduce / all_reduce / all_gather, which gloo has; what stops
    them is device bookkeeping:
    - `group_sharded_parallel` asserts the device is gpu, xpu or a custom device: there it sees
      "cpu" listed as one, so it builds the same wrappers with device="cpu";
    - `GroupShardedOptimizerStage2.__init__` and `GroupShardedStage3.__init__` assert
      `core.is_compiled_with_cuda()` (their only use of it): there it answers True;
    - `GroupShardedOptimizerStage2.__init__` parses a device id from `paddle.get_device()` ("cpu"
      has none: IndexError): there it reads "cpu:0";
    - `ParamStorage.add_rank_params`: see `_param_storage_on_host`.
    `GroupShardedClipGrad` (stage3's clip) moves the norm with `.cuda()` on CPU and misses the TP
    group; the trainer replaces it (`training.grad_norm.ShardedParamsClip`), so it is not patched."""
    from paddle.base import core
    from paddle.distributed.fleet.meta_parallel.sharding import (
        group_sharded_optimizer_stage2 as optimizer_stage2,
        group_sharded_stage3 as stage3,
        group_sharded_storage as storage,
    )
    from paddle.distributed.sharding import group_sharded

    custom_types = paddle.device.get_all_custom_device_type
    _replace(group_sharded, "paddle", _ModuleView(
        paddle, device=_ModuleView(paddle.device, get_all_custom_device_type=lambda: [*custom_types(), "cpu"])))
    cuda_core = _ModuleView(core, is_compiled_with_cuda=lambda: True)
    _replace(optimizer_stage2, "core", cuda_core)
    _replace(stage3, "core", cuda_core)
    _replace(optimizer_stage2, "paddle", _ModuleView(paddle, get_device=lambda: "cpu:0"))
    param_storage = _require(storage, "ParamStorage")
    param_storage.add_rank_params = _param_storage_on_host(_require(param_storage, "add_rank_params"))


# ---------------------------------------------------------------- sequence parallelism

def _sequence_reduce_scatter(input):
    """`sequence_parallel_utils.reduce_scatter` calls `dist.stream.reduce_scatter(sync_op=True)`,
    which gloo lacks ("ProcessGroupGLOO does not support reduce_scatter with sync_op flag",
    process_group.h:211): all-reduce over the mp group, then keep this rank's rows of axis 0."""
    from paddle.distributed import fleet

    group = fleet.get_hybrid_communicate_group().get_model_parallel_group()
    if input.shape[0] % group.nranks:
        raise ValueError(f"sequence length {input.shape[0]} does not split over {group.nranks} tensor-parallel ranks")
    summed = input.clone()
    dist.all_reduce(summed, group=group)
    rows = input.shape[0] // group.nranks
    return summed[group.rank * rows:(group.rank + 1) * rows].clone()


def _patch_sequence_parallel() -> None:
    from paddle.distributed.fleet.utils import sequence_parallel_utils

    _replace(sequence_parallel_utils, "reduce_scatter", _sequence_reduce_scatter)  # ReduceScatterOp, AllGatherOp's grad


# ---------------------------------------------------------------- gloo group creation

def _endpoint_host() -> str:
    endpoint = os.environ.get("PADDLE_CURRENT_ENDPOINT", "127.0.0.1:0")
    return endpoint.rsplit(":", 1)[0]


def _make_new_process_group_impl(upstream):
    """Replaces `collective._new_process_group_impl` for gloo sub-groups.

    `ProcessGroupGloo`'s constructor rendezvouses on the store it is given without a key prefix,
    so overlapping groups on the one global store overwrite each other's keys (hangs, "Connection
    refused", "sizeof(impl_) == bytes.size()"). Each sub-group gets its own TCPStore: its rank 0
    publishes a free port on the global store, then serves it; the members connect as clients.
    """
    from paddle.base import core

    def new_process_group_impl(backend, store, rank, world_size, group_name, pg_options, group_id=0,
                               nccl_comm_init_option=0, nccl_config=None):
        set_tcp_nodelay()  # the job store's client, made just before the first (default) group
        if backend != "gloo" or group_id == 0:
            return upstream(backend, store, rank, world_size, group_name, pg_options, group_id,
                            nccl_comm_init_option, nccl_config)
        group_store = make_group_store(store, rank, world_size, f"paddle_pp/gloo_group_store/{group_id}")
        set_tcp_nodelay()  # the group store's client, before gloo's rendezvous talks through it
        return core.ProcessGroupGloo.create(group_store, rank, world_size, group_id)

    return new_process_group_impl


def make_group_store(store, rank: int, world_size: int, key: str):
    """A group's own TCPStore (kept alive in `_group_stores`): its rank 0 publishes a free port under
    `key` on the job's `store`, then serves it; the members wait until it listens, then connect."""
    from paddle.base import core

    if rank == 0:
        host = _endpoint_host()
        port = free_port(host)
        store.set(key, f"{host}:{port}".encode())
        group_store = core.TCPStore(host, port, True, world_size, STORE_TIMEOUT_S)
    else:
        host, port = bytes(store.get(key)).decode().rsplit(":", 1)
        wait_until_listening(host, int(port))
        group_store = core.TCPStore(host, int(port), False, world_size, STORE_TIMEOUT_S)
    _group_stores.append(group_store)
    return group_store


def set_tcp_nodelay(enabled: bool = True) -> None:
    """Set TCP_NODELAY (Nagle's algorithm off; `enabled` False turns it back on: `bench/job_startup.py`)
    on every TCP socket of this process (idempotent, and harmless on any socket).

    Paddle 3.3.1's TCPStore client (`tcputils::tcp_connect`) leaves Nagle's algorithm on, and every
    request is several small sends (a command, then a key's length, then its bytes): the second send
    waits for the server's acknowledgement of the first, which Linux delays by 40 ms. So every store
    operation took 44 ms here, and a gloo group's creation, about ten of them, 0.4 s on 2 ranks and
    1.3 s on 4 (`bench/job_startup.py`), a dozen groups in a row at a hybrid job's start. The server
    side already sets the option on the sockets it accepts."""
    if not os.path.isdir(PROCESS_FDS):  # not Linux: the start-up stays as slow as Paddle makes it
        return
    for name in os.listdir(PROCESS_FDS):
        try:
            sock = socket.socket(fileno=int(name))
        except OSError:  # not a socket, or closed since the listing
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, int(enabled))
        except OSError:  # a socket in a state that refuses the option is left as it is
            pass
        finally:
            sock.detach()  # the fd stays the owner's


def wait_until_listening(host: str, port: int, timeout: float = STORE_TIMEOUT_S) -> None:
    """Return once `host:port` accepts connections (or after `timeout`, leaving the failure to Paddle).

    A TCPStore's server blocks in its constructor until every member has connected, so its address
    is published before it listens, and a member that connects first is refused; Paddle's client
    (`tcputils::tcp_connect`) then sleeps 3 s (`kDelay`) before it tries again, which happened at
    about every second group creation once the store answered in microseconds. Probing every 10 ms
    here costs a refused connection each; the one that succeeds is closed before Paddle connects,
    which the server sees as a client that left without a request."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=LISTEN_PROBE_CONNECT_S).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(LISTEN_PROBE_INTERVAL_S)


def wait_for_job_store() -> None:
    """On a non-zero rank, wait until rank 0's job-wide TCPStore listens (`wait_until_listening`),
    at the endpoint Paddle's `CreateOrGetGlobalTCPStore` connects to: PADDLE_MASTER, else the first
    of PADDLE_TRAINER_ENDPOINTS. Called before `fleet.init`, which creates that store."""
    if int(os.environ.get("PADDLE_TRAINER_ID", "0")) == 0 or int(os.environ.get("PADDLE_TRAINERS_NUM", "1")) < 2:
        return
    endpoint = os.environ.get("PADDLE_MASTER") or os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",")[0]
    if ":" in endpoint:
        host, port = endpoint.rsplit(":", 1)
        wait_until_listening(host, int(port))


def _patch_group_creation() -> None:
    from paddle.distributed import collective

    upstream = _require(collective, "_new_process_group_impl")
    _replace(collective, "_new_process_group_impl", _make_new_process_group_impl(upstream))


# ---------------------------------------------------------------- rank alignment

_barriers_passed = 0


def store_barrier() -> None:
    """Hold every rank until all arrive, waiting on the global TCPStore (900 s timeout), not gloo.

    Gloo gives every send, recv and collective a fixed 30 s timeout (gloo's kDefaultTimeout; Paddle
    3.3.1 exposes no setting) and aborts the process when it expires. Ranks that reach a collective
    after unequal work (building a stage, preprocessing data) on an oversubscribed CPU can wait
    longer than that, so callers align them here first. Every rank must call it equally often."""
    from paddle.base import core

    global _barriers_passed
    _barriers_passed += 1
    store = core.create_or_get_global_tcp_store()
    key = f"paddle_pp/barrier/{_barriers_passed}"
    if store.add(key, 1) == dist.get_world_size():
        store.set(f"{key}/open", b"1")
    store.wait(f"{key}/open")


def exit_process(code: int) -> None:
    """Leave a multi-rank CPU job without running C++ destructors.

    Normal interpreter exit tears down gloo contexts and the per-group TCP stores in arbitrary
    order while peers still hold connections to them; about one exit in 30 died of a silent
    SIGABRT that way, after the rank's work and results were complete. Every rank first waits on
    the store until all have finished, then exits at once."""
    try:
        store_barrier()
    except (RuntimeError, ValueError):
        # "connection reset": the store's host (rank 0) left, which it does only once the barrier
        # opened, so every rank has finished; Paddle raises ValueError or RuntimeError for it.
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------- math threads

def set_math_threads() -> int:
    """The math library's threads (matmuls) for this rank, unless OMP_NUM_THREADS was given: this
    process's cores over the ranks launched on this machine. Paddle 3.3.1's import sets an unset
    OMP_NUM_THREADS to 1 (and warns when it is set higher), so a one-card run used one core of two:
    23 GFLOP/s on a 2048^3 fp32 matmul where two threads reach 37-39 (Paddle's own call, without its
    warning)."""
    if GIVEN_MATH_THREADS:
        return int(GIVEN_MATH_THREADS)
    threads = max(1, len(os.sched_getaffinity(0)) // max(1, int(os.environ.get("PADDLE_LOCAL_SIZE", "1"))))
    paddle.base.core.set_num_threads(threads)
    return threads


# ---------------------------------------------------------------- entry point

def apply() -> None:
    """Install every patch once; a no-op on the second call."""
    global _applied
    if _applied:
        return
    if paddle.__version__ != TARGET_PADDLE_VERSION:
        warnings.warn(
            f"paddle_pp's CPU backend was written for paddle {TARGET_PADDLE_VERSION}, found {paddle.__version__}; "
            "hybrid-parallel CPU runs are verified only on the target version.",
            stacklevel=2,
        )
    _patch_device_id()
    _patch_input_broadcast()
    _patch_tp_ops()
    _patch_pipeline_p2p()
    _patch_dualpipev()
    _patch_group_creation()
    _patch_group_sharded()
    _patch_sequence_parallel()
    set_math_threads()
    _applied = True
