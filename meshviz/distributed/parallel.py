"""Paddle's init_parallel_env, DataParallel, sync_params_buffers and fused_allreduce_gradients."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as tdist
from torch import nn

from ..runtime import groups
from ..runtime.data_parallel import DataParallelEngine, average_gradients, broadcast_params_buffers
from ..runtime.devices import place_module
from ..runtime.groups import Group
from ..runtime.world import init_parallel_env as _join_world

__all__ = ["init_parallel_env", "DataParallel", "fused_allreduce_gradients", "sync_params_buffers"]


def init_parallel_env(backend: str | None = None, timeout: float | None = None) -> Group | None:
    """Paddle's ``init_parallel_env``: start the default process group, or join it, from torchrun's variables or
    Paddle's (see :func:`meshviz.runtime.world.init_parallel_env`; ``backend`` and ``timeout`` in seconds are
    meshviz's). Returns the global :class:`Group` (id 0), the same every call; in a 1-process world None, as
    Paddle's, whose ``init_parallel_env`` does nothing there (meshviz's collectives still run there)."""
    g = _join_world(backend, timeout)
    return g if g.nranks > 1 else None


class DataParallel(nn.Module):
    """Run ``layers`` data-parallel: parameters broadcast from the group's first rank, gradients averaged.

    ``layers`` left on the CPU of a GPU rank move to its GPU (``dist.device()``), as Paddle creates layers on the
    current device; on a GPU the inputs are moved there too.

    Built on ``torch.nn.parallel.DistributedDataParallel``: buckets of ``comm_buffer_size`` MB, the first bucket
    (the parameters defined first, whose gradients are ready last) of ``last_comm_buffer_size`` MB.
    ``state_dict()`` keys are those of ``layers`` (no wrapper prefix); other attributes pass through to it.
    As in Paddle, a parameter marked ``no_sync`` (``p.no_sync = True``) is neither broadcast nor averaged, a
    non-persistent buffer is not broadcast, and the parameters averaged are those that require a gradient at each
    forward (one frozen after the wrap keeps no gradient; freeze the same ones on every rank).
    ``strategy`` (Paddle 1.x's ``ParallelStrategy``, environment only) is checked and not used: the group decides.
    """

    def __init__(self, layers: nn.Module, strategy=None, comm_buffer_size=25, last_comm_buffer_size=1,
                 find_unused_parameters=False, group=None):
        super().__init__()
        if not isinstance(layers, nn.Module):
            raise TypeError(f"DataParallel wraps an nn.Module, got {type(layers).__name__}")
        if strategy is not None and not hasattr(strategy, "nranks"):  # Paddle reads only strategy.nranks
            raise TypeError(f"DataParallel: strategy must be a ParallelStrategy (an object with nranks) or None, "
                            f"got {strategy!r} ({type(strategy).__name__})")
        for name, v in (("comm_buffer_size", comm_buffer_size), ("last_comm_buffer_size", last_comm_buffer_size)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"DataParallel: {name} must be a positive number of MB, got {v!r}")
        _join_world()
        g = groups.resolve(group)
        if not g.is_member():
            raise ValueError(f"DataParallel: this rank ({tdist.get_rank()}) is not in the group {g.ranks}")
        place_module(layers, "DataParallel")  # a CPU model on a GPU rank moves to the GPU, as in Paddle
        self._layers = layers
        self.group = group
        self._ranks = g.ranks
        self.comm_buffer_size = comm_buffer_size
        self.last_comm_buffer_size = last_comm_buffer_size
        self.find_unused_parameters = find_unused_parameters
        engine = DataParallelEngine(layers, g, comm_buffer_size, last_comm_buffer_size, find_unused_parameters)
        # kept out of the module tree: keys stay free of a prefix
        object.__setattr__(self, "_engine", engine)

    def __deepcopy__(self, memo):
        """A copy of the wrapped layer, data-parallel over the same group (an EMA model deep-copies the model it
        follows, often on one rank only): nothing is sent at the copy; a forward that records a gradient builds its
        reducer. The copy's parameters keep the marks DataParallel reads (``no_sync``)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        shared = ("_engine", "group")  # a process group cannot be copied: the copy uses this one
        state = copy.deepcopy({k: v for k, v in self.__dict__.items() if k not in shared}, memo)
        new.__dict__.update(state, group=self.group)
        for (_, p), (_, q) in zip(self._layers.named_parameters(), new._layers.named_parameters()):
            if hasattr(p, "no_sync") and not hasattr(q, "no_sync"):
                q.no_sync = p.no_sync
        e = self._engine
        object.__setattr__(new, "_engine", DataParallelEngine(new._layers, e.group, e.bucket_mb, e.first_bucket_mb,
                                                              e.find_unused_parameters, lazy=True))
        return new

    @property
    def _ddp(self):
        """The torch DDP the gradients are averaged by now (None with nothing to train)."""
        return self._engine.ddp

    # -- running ---------------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        return self._engine.forward(*inputs, **kwargs)

    def no_sync(self):
        """Inside: gradients accumulate locally. The next backward outside averages the accumulated sum."""
        return self._engine.no_sync()

    def scale_loss(self, loss):
        """Paddle's deprecated ``scale_loss``, kept by Paddle as a method that returns ``loss`` as it is."""
        warnings.warn("DataParallel.scale_loss is deprecated since Paddle 2.0 and does nothing",
                      DeprecationWarning, stacklevel=2)
        return loss

    def apply_collective_grads(self):
        """Paddle's deprecated ``apply_collective_grads``, kept by Paddle as a method that does nothing (the
        gradients are averaged in the backward)."""
        warnings.warn("DataParallel.apply_collective_grads is deprecated since Paddle 2.0 and does nothing",
                      DeprecationWarning, stacklevel=2)

    def train(self, mode: bool = True):
        super().train(mode)
        self._engine.train(mode)
        return self

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self, destination=None, include_sublayers=True, structured_name_prefix="", prefix=None,
                   keep_vars=False, **kwargs):
        """The wrapped layer's parameters and persistent buffers; ``include_sublayers=False``: its own only."""
        prefix = structured_name_prefix if prefix is None else prefix
        if include_sublayers:
            return self._layers.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        own = self._layers.state_dict(prefix=prefix, keep_vars=keep_vars)
        out = destination if destination is not None else type(own)()
        out.update((k, v) for k, v in own.items() if "." not in k[len(prefix):])
        return out

    def set_state_dict(self, state_dict, use_structured_name=True):
        """Paddle's ``Layer.set_state_dict``: load every entry whose key and shape match; a parameter or buffer the
        dict lacks, or gives another shape, is skipped with a warning. Returns ``(missing_keys, unexpected_keys)``."""
        if not use_structured_name:
            raise ValueError("set_state_dict: use_structured_name=False matches Paddle's parameter names "
                             "(linear_0.w_0), which torch parameters do not have; pass the state_dict's keys")
        given = _strip_prefix(state_dict)
        own = self._layers.state_dict(keep_vars=True)
        load, missing = {}, []
        for k, v in own.items():
            if k not in given:
                why = f"{k} is not found in the provided dict."
            elif hasattr(given[k], "shape") and list(given[k].shape) != list(v.shape):
                why = f"{k} receives a shape {list(given[k].shape)}, but the expected shape is {list(v.shape)}."
            else:
                load[k] = given[k]
                continue
            missing.append(k)
            warnings.warn(f"Skip loading for {k}. {why}", stacklevel=2)
        self._layers.load_state_dict(load, strict=False)
        return missing, [k for k in given if k not in load]

    def load_state_dict(self, state_dict, strict=True, assign=False):
        return self._layers.load_state_dict(_strip_prefix(state_dict), strict=strict, assign=assign)

    load_dict = set_state_dict
    set_dict = set_state_dict

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            layers = self._modules.get("_layers")
            if layers is None:
                raise
            return getattr(layers, name)

    def extra_repr(self) -> str:
        return f"group={self._ranks}, comm_buffer_size={self.comm_buffer_size}MB"


def _strip_prefix(sd):
    keys = list(sd.keys())
    for pre in ("module.", "_layers."):
        if keys and all(k.startswith(pre) for k in keys):
            return type(sd)((k[len(pre):], v) for k, v in sd.items())
    return sd


def sync_params_buffers(model: nn.Module, comm_group=None, src_rank=None, is_model_parallel=False, fuse_params=True,
                        is_moe_sharding_parallel=False):
    """Paddle's ``sync_params_buffers``: broadcast ``model``'s parameters and persistent buffers from global rank
    ``src_rank`` (default: the group's first rank; Paddle's is 0) over ``comm_group`` (None: the world).

    With ``is_model_parallel`` the parameters marked ``is_distributed`` (model-parallel shards) are skipped; so are
    those marked ``no_sync``, but with ``is_moe_sharding_parallel`` the ones also marked ``expert``. Tensors are
    always packed one flat buffer per dtype (``fuse_params`` changes how Paddle sends them, not what arrives).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"sync_params_buffers: model must be an nn.Module, got {type(model).__name__}")
    broadcast_params_buffers(model, groups.resolve(comm_group), src_rank, skip_distributed=is_model_parallel,
                             expert_too=is_moe_sharding_parallel)


def fused_allreduce_gradients(parameter_list, hcg=None):
    """Average the gradients of ``parameter_list`` over the data-parallel group of ``hcg`` (None: the world).

    Gradients are packed into buffers of up to 128 MB per dtype, each all-reduced once, then divided by the
    group size, as Paddle does. Parameters that do not require a gradient are skipped (Paddle's ``trainable``).
    """
    try:
        params = None if isinstance(parameter_list, (str, bytes, torch.Tensor)) else list(parameter_list)
    except TypeError:  # not iterable
        params = None
    if params is None or not all(isinstance(p, torch.Tensor) for p in params):
        what = type(parameter_list).__name__ if params is None else \
            next(type(p).__name__ for p in params if not isinstance(p, torch.Tensor))
        raise TypeError(f"fused_allreduce_gradients: parameter_list is a list of parameters (such as "
                        f"list(model.parameters())), got {what}")
    _join_world()
    average_gradients([p for p in params if p.requires_grad], None if hcg is None else hcg.get_data_parallel_group())
