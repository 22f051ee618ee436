"""The one module through which meshviz touches private torch and ipyparallel symbols (torch 2.11 to 2.15)."""

from __future__ import annotations

import contextlib
import inspect
import re
import sys

import torch
import torch.distributed as tdist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "TORCH_VERSION", "SUPPORTED_TORCH", "missing",
    # torch.distributed
    "new_group_in_order", "all_gather_single", "reduce_scatter_single", "abort_process_group",
    "reset_group_count", "resolve_process_group", "device_mesh_without_backend", "dtensor_local", "dtensor_from_local",
    "dtensor_layout", "linear_keeps_split_batch_dims",
    # tensor subclasses and dispatch
    "NoDTensorRule", "DTensorDecision", "dtensor_special_ops", "dtensor_decision",
    "dtensor_converts_partial_kinds", "dispatch_modes_active", "fast_call", "torch_function_modes",
    "disabled_torch_function_impl", "make_wrapper_subclass", "compiling", "TorchDispatchMode", "tree_map",
    "tree_flatten", "tree_unflatten",
    "flatten_dense_tensors", "unflatten_dense_tensors", "fake_tensor_type", "amp_unscale_",
    "autograd_sequence_nr", "running_node", "in_backward", "will_run", "graph_task_id", "is_ddp_sink",
    # simulated ranks: tensors without storage
    "fake_tensor_mode_type", "fake_data_errors", "fresh_fake_outputs", "wrap_meta", "may_keep_values",
    "known_values", "clear_dtensor_caches", "empty_block", "FakeOps", "install_fake_ddp", "uninstall_fake_ddp",
    "share_dtensor_decisions", "in_sharding_propagation",
    # pipelining
    "PIPELINE_STAGE_METHODS", "pipeline_setup_calls", "pipeline_neighbor_init_ops",
    "pipeline_stage_marks_every_recv", "pipeline_stage_sends_zero_grads", "pipeline_order", "action_fields",
    # ranks as threads
    "install_thread_worlds", "uninstall_thread_worlds", "backend_plugins", "no_dispatch_modes",
    # ipyparallel
    "ar_targets", "ar_children",
]


def _version(text: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


TORCH_VERSION = _version(torch.__version__)
SUPPORTED_TORCH = ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))

# -- torch.distributed ----------------------------------------------------------------------------------------

_c10d = tdist.distributed_c10d
_SORT_RANKS = "sort_ranks" in inspect.signature(tdist.new_group).parameters  # new in torch 2.12/2.13


def _world_timeout():
    """The default process group's timeout (None where unknown): torch gives a new group 30 minutes on gloo."""
    pg = _c10d._get_default_group() if tdist.is_initialized() else None
    for dev in () if pg is None else (pg.bound_device_id, torch.device("cpu"), torch.device("cuda")):
        with contextlib.suppress(Exception):  # no backend for that device, or one without options
            return pg._get_backend(dev).options._timeout
    return None


def new_group_in_order(ranks, timeout=None, backend=None):
    """A process group whose group rank i is ``ranks[i]`` (torch's ``new_group`` sorts them).

    Every rank of the world calls it; a non-member gets ``GroupMember.NON_GROUP_MEMBER``. Where ``new_group``
    has no ``sort_ranks`` (torch 2.11), this is its body without the sort. ``timeout`` None: the world's.
    """
    ranks = [int(r) for r in ranks]
    timeout = timeout or _world_timeout()  # a group one rank makes alone fails then, not in 30 minutes
    if _SORT_RANKS:
        return tdist.new_group(ranks, timeout=timeout, backend=backend, sort_ranks=False)
    default_pg = _c10d._get_default_group()
    default_backend, default_store = _c10d._world.pg_map[default_pg]
    backend = _c10d.Backend(backend or default_backend)
    if timeout is None:
        timeout = _c10d._get_default_timeout(backend)
    me = default_pg.rank()
    name = _c10d._process_group_name(ranks, use_hashed_name=False)
    pg, _ = _c10d._new_process_group_helper(
        len(ranks), ranks.index(me) if me in ranks else None, ranks, backend, default_store, name,
        timeout=timeout, device_id=default_pg.bound_device_id)
    _c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg


# torch 2.13 renamed the tensor forms (the old names warn); 2.11 has only the old ones
all_gather_single = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
reduce_scatter_single = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor


def abort_process_group(group=None) -> None:
    """Tear a process group down at once (every group of this rank when ``group`` is None)."""
    _c10d._abort_process_group(group)


def reset_group_count() -> None:
    """Restart torch's group numbering: group names (and so store keys) come from it, so every rank of a new
    world must start from 0."""
    _c10d._world.group_count = 0


def resolve_process_group(name: str):
    """The process group registered under ``name`` (functional collectives carry only the name)."""
    return _c10d._resolve_process_group(name)


def device_mesh_without_backend(device_type: str, mesh, mesh_dim_names=None):
    """A DeviceMesh that creates no process groups (for a rank outside the mesh)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names, _init_backend=False)


def dtensor_local(dt) -> torch.Tensor:
    """A DTensor's local tensor without autograd (``to_local()`` records a node)."""
    return dt._local_tensor


_specs: dict = {}  # (id(mesh), placements, shape, stride, dtype) -> (mesh, DTensorSpec)


def dtensor_from_local(local: torch.Tensor, device_mesh, placements: tuple, shape, stride, layout=None):
    """``DTensor.from_local(local, device_mesh, placements, run_check=False, shape=shape, stride=stride)`` for a
    ``local`` without autograd history: the DTensor built directly on a DTensorSpec reused across calls (from_local
    goes through an autograd Function and builds a fresh spec each time: most of a small reshard's fixed cost).
    ``layout``: a layout only torch can name, as :func:`dtensor_layout` gave it (placements and their order)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    if local.device.type != device_mesh.device_type and local.device.type != "meta":
        local = local.to(device_mesh.device_type)
    key = (id(device_mesh), placements, tuple(shape), tuple(stride), local.dtype, layout)
    hit = _specs.get(key)
    if hit is None or hit[0] is not device_mesh:
        if len(_specs) >= 4096:
            _specs.clear()
        meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
        if layout is None:
            spec = DTensorSpec(device_mesh, placements, tensor_meta=meta)
        else:
            spec = DTensorSpec(device_mesh, layout[0], tensor_meta=meta, shard_order=layout[1],
                               use_strided_shard_as_shard_order=layout[2])
        hit = _specs[key] = (device_mesh, spec)
    return DTensor(local, hit[1], requires_grad=False)


# -- the autograd engine (meshviz/compat/autograd.py), DTensor's sharding decisions (meshviz/compat/decisions.py) --

from .autograd import autograd_sequence_nr, graph_task_id, in_backward, is_ddp_sink, running_node, will_run  # noqa: E402
from .decisions import (  # noqa: E402
    DTensorDecision,
    NoDTensorRule,
    dtensor_decision,
    dtensor_layout,
    dtensor_special_ops,
)


def dtensor_converts_partial_kinds() -> bool:
    """Whether DTensor turns one Partial reduction into another inside an op (``P(avg) + P(sum)``): torch 2.12 and
    later do; 2.11 raises."""
    return TORCH_VERSION >= (2, 12)


def dispatch_modes_active() -> bool:
    """Whether a Python dispatch mode is on the calling thread's stack."""
    return torch._C._len_torch_dispatch_stack() > 0


def linear_keeps_split_batch_dims() -> bool:
    """Whether DTensor runs a Linear over an activation split on a batch dim other than the first (``[s, b, h]``
    with ``b`` split) without gathering it: torch 2.12 and later (the flattened batch is a ``_StridedShard``);
    torch 2.11 gathers the activation first, so such plans put the split batch dim first."""
    return TORCH_VERSION >= (2, 12)


# -- tensor subclasses and dispatch ---------------------------------------------------------------------------

disabled_torch_function_impl = torch._C._disabled_torch_function_impl
make_wrapper_subclass = torch.Tensor._make_wrapper_subclass
flatten_dense_tensors = _flatten_dense_tensors
unflatten_dense_tensors = _unflatten_dense_tensors
amp_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_


class _Seen(TorchDispatchMode):
    """Notes every op that reaches the Python dispatcher, and runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _meta_stand_in(x):
    if isinstance(x, torch.Tensor):
        if type(x) is not torch.Tensor:
            raise TypeError  # a subclass may answer the binding's __torch_function__ itself
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def fast_call(op, args, kwargs):
    """What runs the aten op ``op`` on these plain-tensor arguments as ``op(*args, **kwargs)`` does, for less: the
    Tensor method or torch function of its name, where torch resolves that call on such arguments to ``op`` and
    nothing else (an OpOverload's call matches its arguments against the schema each time: 2-6 us more for add,
    sum); else ``op``. Checked once on meta stand-ins of the arguments, out of sight of the thread's modes; call it
    with the same kinds of arguments (an op call key fixes them), and only while no torch function mode is on
    (:func:`torch_function_modes`)."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return op
    name = op._schema.name.split("::", 1)[1]
    first_is_tensor = bool(args) and type(args[0]) is torch.Tensor
    candidates = [getattr(torch._C.TensorBase, name, None) if first_is_tensor else None,
                  getattr(torch._C._VariableFunctions, name, None)]
    with no_dispatch_modes(), torch._C.DisableTorchFunction():
        try:
            sargs, skwargs = tree_map(_meta_stand_in, (tuple(args), dict(kwargs)))
            want = op(*sargs, **skwargs)
        except Exception:  # a tensor subclass, an op without a meta kernel: not checked, so not replaced
            return op
        for candidate in candidates:
            if candidate is None:
                continue
            seen = _Seen()
            try:
                with seen:
                    got = candidate(*sargs, **skwargs)
            except Exception:
                continue
            if len(seen.ops) == 1 and seen.ops[0] is op and type(got) is type(want):  # a list stays a list
                return candidate
    return op


def compiling() -> bool:
    """Whether this thread holds torch.compile's lock (Dynamo converting a frame, Inductor compiling it): another
    rank thread calling a compiled function waits on that lock without handing the baton back."""
    m = sys.modules.get("torch._dynamo.convert_frame")
    lock = getattr(m, "compile_lock", None)
    return lock is not None and lock._is_owned()


def torch_function_modes() -> int:
    """How many torch function modes are on (``with torch.device(...)`` is one)."""
    return torch._C._len_torch_function_stack()


# -- simulated ranks: tensors without storage (meshviz/compat/simulated.py) ---------------------------------

from .pipeline_meta import check as _check_stage_meta  # noqa: E402
from .simulated import (  # noqa: E402
    FakeOps,
    clear_dtensor_caches,
    empty_block,
    fake_data_errors,
    fake_tensor_mode_type,
    fake_tensor_type,
    fresh_fake_outputs,
    in_sharding_propagation,
    install_fake_ddp,
    known_values,
    may_keep_values,
    share_dtensor_decisions,
    uninstall_fake_ddp,
    wrap_meta,
)

# -- pipelining -------------------------------------------------------------------------------------------

# the PipelineStage methods a traced stage overrides (torch's schedules call them)
PIPELINE_STAGE_METHODS = ("get_fwd_recv_ops", "get_bwd_recv_ops", "get_fwd_send_ops", "get_bwd_send_ops",
                          "forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def pipeline_setup_calls() -> tuple[str, ...]:
    """The PipelineStage methods a schedule calls before the first step that may exchange metadata or a dummy tensor
    with the neighbours over point-to-point ops on the stage's device: the infra set-ups (torch 2.11 to 2.15) and
    the warm-up votes (torch 2.12 to 2.14)."""
    calls = ("_prepare_forward_infra", "_prepare_backward_infra")
    if (2, 12) <= TORCH_VERSION < (2, 15):
        calls += ("_warmup_forward_vote", "_warmup_backward_result")
    return calls


def pipeline_stage_marks_every_recv() -> bool:
    """Whether PipelineStage makes every received activation need a gradient (an integer one, such as position ids,
    raises): torch 2.11; 2.12 and later leave integer activations alone."""
    return TORCH_VERSION < (2, 12)


def pipeline_stage_sends_zero_grads() -> bool:
    """Whether PipelineStage sends zeros back for a received activation that got no gradient: torch 2.13 and later;
    2.11 and 2.12 expect a gradient for every one and raise on a missing one."""
    return TORCH_VERSION >= (2, 13)


def pipeline_neighbor_init_ops() -> str | None:
    """The PipelineStage method returning the point-to-point ops that send each neighbour a dummy tensor before the
    first step (torch 2.11 to 2.14); None on torch 2.15, which sends none."""
    return "_get_init_p2p_neighbors_ops" if TORCH_VERSION < (2, 15) else None


def pipeline_order(schedule) -> dict:
    """pipe rank -> the schedule's list of actions (None for idle slots)."""
    return schedule.pipeline_order


def action_fields(action) -> tuple[str, int, int]:
    """(computation type letter, stage index, micro-batch index) of one schedule action."""
    ct = action.computation_type
    return str(getattr(ct, "value", ct)), action.stage_index, action.microbatch_index


# -- ranks as threads ----------------------------------------------------------------------------------------

def _threaded_pg():
    # torch's threaded process group (for its own tests); meshviz uses its thread-local c10d world only
    from torch.testing._internal.distributed import multi_threaded_pg

    return multi_threaded_pg


def install_thread_worlds() -> None:
    """Give every thread its own c10d world (default group, group names and ranks) and its own registry of
    group names, so that threads can be ranks of one process. Undo with :func:`uninstall_thread_worlds`.

    Also sets the no-op CUDA device guard from the calling (long-lived) thread when there is no usable GPU:
    FakeTensorMode (DTensor's shape propagation) sets it on first use, and on torch 2.11's CUDA build a guard set
    by a thread that has since ended crashes the next thread that asks for it."""
    if not torch.cuda.is_available() and hasattr(torch._C, "_ensureCUDADeviceGuardSet"):
        torch._C._ensureCUDADeviceGuardSet()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    world = _threaded_pg()._install_threaded_pg()
    if not hasattr(world, "comms"):  # torch 2.11's destroy_process_group reads _world.comms; its thread world lacks it
        import threading

        tls = threading.local()

        class _World(type(world)):
            @property
            def comms(self):
                if not hasattr(tls, "comms"):
                    tls.comms = []
                return tls.comms

        world.__class__ = _World


def uninstall_thread_worlds() -> None:
    _threaded_pg()._uninstall_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(False)


def no_dispatch_modes():
    """A context in which the calling thread's Python dispatch modes are off (a thread group's own copies must not
    show up as the rank's ops)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def backend_plugins() -> dict:
    """c10d's table of registered third-party backends (name in capitals -> plugin)."""
    return tdist.Backend._plugins


# -- ipyparallel ------------------------------------------------------------------------------------------

def ar_targets(ar):
    """The engine ids an AsyncResult was sent to (None: every engine of its view)."""
    return ar._targets


def ar_children(ar) -> list:
    """An AsyncResult's per-engine futures, in the order of :func:`ar_targets`."""
    return ar._children


def missing() -> list[str]:
    """The private symbols this module relies on that the installed torch / ipyparallel lack."""
    out = []
    checks = {
        "distributed_c10d._world.pg_map": lambda: _c10d._world.pg_map,
        "distributed_c10d._world.group_count": lambda: _c10d._world.group_count,
        "distributed_c10d._abort_process_group": lambda: _c10d._abort_process_group,
        "distributed_c10d._resolve_process_group": lambda: _c10d._resolve_process_group,
        "DeviceMesh(_init_backend=)": lambda: _param("torch.distributed.device_mesh", "DeviceMesh.__init__",
                                                     "_init_backend"),
        "DTensor._local_tensor": lambda: _slot("torch.distributed.tensor", "DTensor", "_local_tensor"),
        "DTensor(local, DTensorSpec(mesh, placements, tensor_meta=TensorMeta(...)), requires_grad=)": _dtensor_spec,
        "torch._C._disabled_torch_function_impl": lambda: disabled_torch_function_impl,
        "torch._subclasses.fake_tensor.FakeTensor": fake_tensor_type,
        "FakeTensorMode.fake_tensor_converter.from_meta_and_device/is_our_fake": _fake_mode_parts,
        "fake_tensor DataDependentOutputException/DynamicOutputShapeException": fake_data_errors,
        "torch.nn.parallel.distributed._verify_param_shape_across_processes": lambda: _attr(
            "torch.nn.parallel.distributed", "_verify_param_shape_across_processes"),
        "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear": lambda: (
            _attr("torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding"
                  ".cache_clear")),
        "autograd engine queue_callback": lambda: torch.autograd.Variable._execution_engine.queue_callback,
        "torch._C._will_engine_execute_node": lambda: torch._C._will_engine_execute_node,
        "torch._dynamo.convert_frame.compile_lock._is_owned": lambda: _attr(
            "torch._dynamo.convert_frame", "compile_lock._is_owned"),
        "torch.distributed.pipelining.PipelineStage methods": _stage_methods,
        "torch.distributed.pipelining schedule actions": _action_fields,
        "ipyparallel AsyncResult._targets/_children": _ar_fields,
        "multi_threaded_pg._install_threaded_pg/_uninstall_threaded_pg": lambda: (
            _threaded_pg()._install_threaded_pg, _threaded_pg()._uninstall_threaded_pg),
        "_distributed_c10d._set_thread_isolation_mode": lambda: torch._C._distributed_c10d._set_thread_isolation_mode,
        "Backend._plugins": backend_plugins,
        "torch.utils._python_dispatch._disable_current_modes": lambda: _attr(
            "torch.utils._python_dispatch", "_disable_current_modes"),
        "DistributedBackendOptions.global_ranks_in_group/group_id": _backend_options,
    }
    if not _SORT_RANKS:
        checks["distributed_c10d._new_process_group_helper"] = lambda: _param(
            "torch.distributed.distributed_c10d", "_new_process_group_helper", "device_id")
        checks["distributed_c10d._process_group_name"] = lambda: _c10d._process_group_name
        checks["distributed_c10d._world.pg_group_ranks"] = lambda: _c10d._world.pg_group_ranks
        checks["distributed_c10d._get_default_timeout"] = lambda: _c10d._get_default_timeout
    for name, check in checks.items():
        try:
            check()
        except Exception:
            out.append(name)
    return out


def _fake_mode_parts():
    mode = fake_tensor_mode_type()
    mode.is_our_fake  # noqa: B018
    mode.may_turn_const  # noqa: B018
    conv = _attr("torch._subclasses.fake_tensor", "FakeTensorConverter")
    conv.from_meta_and_device  # noqa: B018


def _attr(module: str, path: str):
    import importlib

    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _param(module: str, path: str, name: str):
    if name not in inspect.signature(_attr(module, path)).parameters:
        raise AttributeError(name)


def _slot(module: str, cls: str, name: str):
    c = _attr(module, cls)
    if name not in getattr(c, "__slots__", ()) and name not in c.__annotations__ and not hasattr(c, name):
        raise AttributeError(name)


def _stage_methods():
    from torch.distributed.pipelining import PipelineStage

    for m in PIPELINE_STAGE_METHODS + pipeline_setup_calls() + tuple(filter(None, [pipeline_neighbor_init_ops()])):
        getattr(PipelineStage, m)
    _check_stage_meta()


def _action_fields():
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    action_fields(_Action(0, _ComputationType.FORWARD, 0))
    _attr("torch.distributed.pipelining", "Schedule1F1B.__init__")


def _backend_options():
    opts = torch._C._distributed_c10d._DistributedBackendOptions()
    opts.global_ranks_in_group, opts.group_id  # noqa: B018 (what a backend created with extended_api reads)


def _ar_fields():
    from ipyparallel.client.asyncresult import AsyncResult

    src = inspect.getsource(AsyncResult.__init__)
    if "self._targets" not in src or "self._children" not in src:
        raise AttributeError("_targets/_children")


def _dtensor_spec():
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    wanted = ((DTensorSpec, ("mesh", "placements", "tensor_meta")), (TensorMeta, ("shape", "stride", "dtype")))
    for cls, names in wanted:
        params = inspect.signature(cls).parameters
        if any(n not in params for n in names):
            raise AttributeError(f"{cls.__name__}({', '.join(names)})")
