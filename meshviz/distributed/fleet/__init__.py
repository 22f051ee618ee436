"""Paddle's ``fleet``: hybrid-parallel set-up (dp, pp, sharding, mp), distributed model and optimizer."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ...rank_context import getenv
from ...runtime.agree import alone, same_or_refused
from ...runtime.rollcall import refusing
from ...runtime.world import get_rank, get_world_size, init_parallel_env
from ..collective import barrier
from . import topology  # noqa: F401  (fleet.topology, as in Paddle)
from .optimizer import HybridParallelOptimizer, check_sharding_layout
from .state import FleetState, current, hybrid_group
from .strategy import DistributedStrategy
from .topology import AXIS_NAMES, CommunicateTopology, HybridCommunicateGroup, ParallelMode

__all__ = [
    "init", "DistributedStrategy", "distributed_model", "distributed_optimizer", "get_hybrid_communicate_group",
    "get_hybrid_parallel_topology", "worker_index", "worker_num", "is_first_worker", "barrier_worker",
    "local_rank", "is_worker", "HybridCommunicateGroup", "CommunicateTopology", "ParallelMode",
    "HybridParallelOptimizer", "Fleet", "fleet", "meta_parallel", "utils", "distributed_scaler",
]


_DEGREES = ("dp", "pp", "sharding", "mp", "sep")


class Fleet:
    """The singleton behind the module functions (``fleet.init``, ``fleet.distributed_model`` ...); what it holds
    is per rank."""

    _PER_RANK = frozenset(FleetState.__slots__)

    def __getattr__(self, name):
        if name in Fleet._PER_RANK:
            return getattr(current(), name)
        raise AttributeError(name)

    def __setattr__(self, name, value):
        if name in Fleet._PER_RANK:
            setattr(current(), name, value)
        else:
            object.__setattr__(self, name, value)

    def init(self, role_maker=None, is_collective=True, strategy=None, log_level="INFO"):
        """Start the process group and build the hybrid topology from ``strategy.hybrid_configs``.

        Only collective mode exists here. The degrees must multiply to the world size (``dp_degree=-1``: the
        rest). Where they do not, or the ranks' configs differ, or one rank refuses its arguments, every rank
        raises before anything but one settings check (the refusing rank its own error, the others ValueError
        naming it).
        """
        refused, degrees, order = None, dict.fromkeys(_DEGREES, 0), []
        try:
            if not is_collective:
                raise ValueError("fleet.init: only collective mode (is_collective=True) is supported")
            if strategy is None:
                strategy = DistributedStrategy()
            if not isinstance(strategy, DistributedStrategy):
                raise TypeError(f"fleet.init: strategy must be a DistributedStrategy, got {type(strategy).__name__}")
            h = strategy.hybrid_configs
            degrees, order = {k: h[f"{k}_degree"] for k in _DEGREES}, list(h["order"])
        except (TypeError, ValueError) as e:
            if alone():  # no other rank can wait for this one: before starting a process group
                raise
            refused = e
        try:  # also where this rank refused: the others would wait for it in the check below
            init_parallel_env()
        except Exception:
            if refused is None:
                raise
            raise refused from None
        if refused is None:
            try:
                degrees = _resolved(degrees, get_world_size())
            except ValueError as e:
                refused = e
        # a rank that refused takes part too, so that every rank raises, naming it, not that one alone
        same_or_refused("fleet.init: hybrid_configs", {**degrees, "order": order}, refused)
        self._strategy = strategy
        for axis in ("sep", "cp"):  # Paddle's topology always has them (size 1 unless set), before mp by default
            if axis not in order:
                order.insert(order.index("mp"), axis)
        degrees["cp"] = 1
        self._topology = CommunicateTopology([AXIS_NAMES[a] for a in order], [degrees[a] for a in order])
        self._hcg = HybridCommunicateGroup(self._topology)
        if degrees["mp"] > 1:  # as Paddle: the tracker's model_parallel_rng state (and the global seed, if given)
            from .meta_parallel.rng_tracker import model_parallel_random_seed

            seed = strategy.tensor_parallel_configs["tensor_init_seed"]
            if seed != -1:
                model_parallel_random_seed(seed)
            else:  # Paddle reseeds the global RNG at random here; torch's and numpy's are kept as the user seeded
                import numpy as np

                cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
                kept = np.random.get_state()
                with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
                    model_parallel_random_seed(None)
                np.random.set_state(kept)
        return None

    def _require_init(self):
        hybrid_group()

    def get_hybrid_communicate_group(self) -> HybridCommunicateGroup:
        self._require_init()
        return self._hcg

    def get_hybrid_parallel_topology(self) -> CommunicateTopology:
        self._require_init()
        return self._topology

    def distributed_model(self, model: nn.Module):
        """Data parallel only: ``DataParallel`` over the dp group. mp/sep/sharding: parameters made consistent
        (non-split ones over the mp group, all over sep/dp/sharding) and the model returned; gradients are synced
        by ``distributed_optimizer``'s step. pp > 1: the pipeline runtime (``pipeline_hook._pipeline_model``)."""
        from ...runtime.devices import place_module
        from ..parallel import DataParallel, sync_params_buffers

        self._require_init()
        hcg, strategy = self._hcg, self._strategy
        mode = hcg.get_parallel_mode()
        if mode == ParallelMode.PIPELINE_PARALLEL:
            from .pipeline_hook import _pipeline_model

            return _pipeline_model(model, hcg, strategy)
        if get_world_size() == 1:
            return model
        if isinstance(model, nn.Module):
            self._model = weakref.ref(model)
        check_sharding_layout("fleet.distributed_model", hcg, model)  # before the broadcasts below
        place_module(model, "fleet.distributed_model")  # a CPU model on a GPU rank moves to the GPU, as in Paddle
        if mode == ParallelMode.DATA_PARALLEL:
            return DataParallel(
                model,
                comm_buffer_size=strategy.fuse_grad_size_in_MB,
                last_comm_buffer_size=strategy.last_comm_group_size_MB,
                find_unused_parameters=strategy.find_unused_parameters,
                group=hcg.get_data_parallel_group(),
            )
        if hcg.get_model_parallel_world_size() > 1:
            sync_params_buffers(model, hcg.get_model_parallel_group(), is_model_parallel=True)
            if mode == ParallelMode.TENSOR_PARALLEL:
                _broadcast_inputs(model, hcg, strategy)
        if hcg.get_sep_parallel_world_size() > 1:
            sync_params_buffers(model, hcg.get_sep_parallel_group())
        if hcg.get_sharding_parallel_world_size() > 1:
            sync_params_buffers(model, hcg.get_sharding_parallel_group())
        if hcg.get_data_parallel_world_size() > 1:
            sync_params_buffers(model, hcg.get_data_parallel_group())
        return model

    @refusing(name="fleet.distributed_optimizer")
    def distributed_optimizer(self, optimizer, strategy=None):
        """``optimizer`` wrapped for the hybrid topology ``fleet.init`` built (RuntimeError on a rank that never
        called it, as Paddle raises there: the others' step would wait for this rank's collectives)."""
        if not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "step")):
            raise TypeError(f"fleet.distributed_optimizer expects a torch optimizer, got {type(optimizer).__name__}")
        if self._hcg is None:
            raise RuntimeError("fleet.distributed_optimizer: this rank never called fleet.init; call "
                               "fleet.init(is_collective=True, strategy=...) first, on every rank")
        if strategy is not None and self._strategy is None:
            self._strategy = strategy
        return HybridParallelOptimizer(optimizer, self._hcg, strategy or self._strategy)

    def worker_index(self) -> int:
        return get_rank()

    def worker_num(self) -> int:
        return get_world_size()

    def local_rank(self) -> int:
        return int(getenv("LOCAL_RANK", "0"))

    def is_first_worker(self) -> bool:
        return get_rank() == 0

    def is_worker(self) -> bool:
        return True

    def barrier_worker(self) -> None:
        barrier()


def _resolved(degrees: dict, world: int) -> dict:
    """The degrees with ``dp_degree=-1`` resolved; ValueError where they do not multiply to ``world``."""
    degrees = dict(degrees)
    others = degrees["pp"] * degrees["sharding"] * degrees["mp"] * degrees["sep"]
    if degrees["dp"] == -1:
        if world % others:
            raise ValueError(f"fleet.init: world size {world} is not divisible by pp*sharding*mp*sep = {others}")
        degrees["dp"] = world // others
    if degrees["dp"] * others != world:
        raise ValueError(
            f"fleet.init: dp_degree*pp_degree*sharding_degree*mp_degree*sep_degree = "
            f"{degrees['dp']}*{degrees['pp']}*{degrees['sharding']}*{degrees['mp']}*{degrees['sep']} = "
            f"{degrees['dp'] * others}, but the world has {world} ranks")
    return degrees


def _broadcast_inputs(model: nn.Module, hcg, strategy) -> None:
    """Paddle's TensorParallel: the tensor inputs of every forward come from the mp group's first rank (unless
    ``hybrid_configs["mp_configs"]["need_broadcast_data"]`` is False). A hook, so the model and its state_dict keys
    stay the user's."""
    from .utils.hybrid_parallel_util import broadcast_input_data

    if not strategy.hybrid_configs["mp_configs"].get("need_broadcast_data", True):
        return
    if getattr(model, "_meshviz_mp_broadcast", None) is not None:  # distributed_model called again
        return

    def hook(module, args, kwargs):
        return broadcast_input_data(hcg, *args, **kwargs)

    model._meshviz_mp_broadcast = model.register_forward_pre_hook(hook, with_kwargs=True)


fleet = Fleet()
init = fleet.init
distributed_model = fleet.distributed_model
distributed_optimizer = fleet.distributed_optimizer
get_hybrid_communicate_group = fleet.get_hybrid_communicate_group
get_hybrid_parallel_topology = fleet.get_hybrid_parallel_topology
worker_index = fleet.worker_index
worker_num = fleet.worker_num
local_rank = fleet.local_rank
is_first_worker = fleet.is_first_worker
is_worker = fleet.is_worker
barrier_worker = fleet.barrier_worker

from . import meta_parallel, utils  # noqa: E402  (after fleet exists: they look up its hybrid group)
from .scaler import distributed_scaler  # noqa: E402


def __getattr__(name):
    if name == "auto":  # Paddle's fleet.auto is paddle.distributed.auto_parallel (set_mesh / get_mesh)
        from .. import auto_parallel

        return auto_parallel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
