"""Paddle's DataParallel on torch DDP, and fused_allreduce_gradients."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import compat, trace
from ..runtime import groups, rollcall
from ..runtime.comm import FUSE_BYTES, Call, CollectiveOp, all_reduce_mean_, run
from ..runtime.devices import place_module
from ..runtime.world import init_parallel_env

__all__ = ["DataParallel", "fused_allreduce_gradients", "sync_params_buffers"]


class DataParallel(nn.Module):
    """Run ``layers`` data-parallel: parameters broadcast from the group's first rank, gradients averaged.

    ``layers`` left on the CPU of a GPU rank move to its GPU (``dist.device()``), as Paddle creates layers on the
    current device; on a GPU the inputs are moved there too.

    Built on ``torch.nn.parallel.DistributedDataParallel``: buckets of ``comm_buffer_size`` MB, the first bucket
    (the parameters defined first, whose gradients are ready last) of ``last_comm_buffer_size`` MB.
    ``state_dict()`` keys are those of ``layers`` (no wrapper prefix); other attributes pass through to it.
    """

    def __init__(self, layers: nn.Module, strategy=None, comm_buffer_size=25, last_comm_buffer_size=1,
                 find_unused_parameters=False, group=None):
        super().__init__()
        if not isinstance(layers, nn.Module):
            raise TypeError(f"DataParallel wraps an nn.Module, got {type(layers).__name__}")
        for name, v in (("comm_buffer_size", comm_buffer_size), ("last_comm_buffer_size", last_comm_buffer_size)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"DataParallel: {name} must be a positive number of MB, got {v!r}")
        init_parallel_env()
        g = groups.resolve(group)
        ranks, pg = g.ranks, g.process_group
        if not g.is_member():
            raise ValueError(f"DataParallel: this rank ({tdist.get_rank()}) is not in the group {ranks}")
        place_module(layers, "DataParallel")  # a CPU model on a GPU rank moves to the GPU, as in Paddle
        self._layers = layers
        self.group = group
        self._ranks = ranks
        self._key = tuple(ranks)
        self.comm_buffer_size = comm_buffer_size
        self.last_comm_buffer_size = last_comm_buffer_size
        self.find_unused_parameters = find_unused_parameters
        has_grad = any(p.requires_grad for p in layers.parameters())
        if has_grad:
            made = []  # DDP's constructor broadcasts the parameters and buffers from the group's first rank
            nbytes = sum(t.numel() * t.element_size() for t in layers.state_dict().values())
            devs = {p.device for p in layers.parameters()}
            gpu = next(iter(devs)) if len(devs) == 1 and next(iter(devs)).type == "cuda" else None
            run(Call(CollectiveOp.BROADCAST, g, lambda g: made.append(DDP(
                layers,
                device_ids=None if gpu is None else [gpu.index],  # on a GPU, DDP moves the inputs there too
                process_group=pg,
                bucket_cap_mb=comm_buffer_size,
                bucket_cap_mb_list=[last_comm_buffer_size, comm_buffer_size],
                find_unused_parameters=find_unused_parameters,
            )), nbytes=nbytes, name="DataParallel.sync_params", src=ranks[0]))
            ddp = made[0]
            if trace.active():
                # a Python hook per bucket costs 5-10% of a small step on gloo (bench/README): only when traced
                ddp.register_comm_hook(g, _allreduce_hook)
        else:  # nothing to train: only make the replicas equal
            sync_params_buffers(layers, group)
            ddp = None
        object.__setattr__(self, "_ddp", ddp)  # kept out of the module tree: keys stay free of a prefix

    # -- running ---------------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        if self._ddp is None:
            return self._layers(*inputs, **kwargs)
        out = self._ddp(*inputs, **kwargs)
        if self._ddp.require_backward_grad_sync and torch.is_grad_enabled():
            # DDP's bucket all-reduces bypass the comm layer (its C++ hook): a rank blocked in the backward that
            # follows is shown as inside them on this group
            rollcall.current().begin_region("all_reduce", self._key, "DataParallel gradients")
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Inside: gradients accumulate locally. The next backward outside averages the accumulated sum."""
        if self._ddp is None:
            yield
            return
        with self._ddp.no_sync():
            yield

    def train(self, mode: bool = True):
        super().train(mode)
        if self._ddp is not None:
            self._ddp.training = mode
        return self

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self, destination=None, include_sublayers=True, structured_name_prefix="", prefix=None,
                   keep_vars=False, **kwargs):
        prefix = structured_name_prefix if prefix is None else prefix
        return self._layers.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def set_state_dict(self, state_dict, use_structured_name=True, strict=True):
        return self._layers.load_state_dict(_strip_prefix(state_dict), strict=strict)

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


def _allreduce_hook(group, bucket):
    """DDP's own averaging all-reduce of one gradient bucket, issued through the comm layer (installed only when
    tracing at wrap time; untraced, DDP's C++ hook all-reduces the buckets)."""
    buf = bucket.buffer()
    buf.div_(group.nranks)
    works = []
    run(Call(CollectiveOp.ALL_REDUCE, group,
             lambda g: works.append(tdist.all_reduce(buf, group=g.process_group, async_op=True)),
             tensors=(buf,), sync_op=False, name="DataParallel.bucket", reduce_op="avg", bucket=bucket.index()))
    return works[0].get_future().then(lambda f: f.value()[0])


def sync_params_buffers(model: nn.Module, group=None, src_rank=None, is_model_parallel=False):
    """Broadcast ``model``'s parameters and buffers from ``src_rank`` (default: the group's first rank).

    With ``is_model_parallel`` the parameters marked ``is_distributed`` (model-parallel shards) are skipped.
    """
    from .collective import broadcast

    g = groups.resolve(group)
    if not g.is_member():
        return
    src = g.ranks[0] if src_rank is None else src_rank
    tensors = [t for t in list(model.parameters()) + list(model.buffers())
               if not (is_model_parallel and getattr(t, "is_distributed", False))]
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        ts = [t for t in tensors if t.dtype == dtype]
        flat = compat.flatten_dense_tensors([t.detach() for t in ts])
        broadcast(flat, src, group=g)
        with torch.no_grad():
            for t, v in zip(ts, compat.unflatten_dense_tensors(flat, ts)):
                t.copy_(v)


def fused_allreduce_gradients(parameter_list, hcg=None):
    """Average the gradients of ``parameter_list`` over the data-parallel group of ``hcg`` (None: the world).

    Gradients are packed into buffers of up to 128 MB per dtype, each all-reduced once, then divided by the
    group size, as Paddle does. Parameters without a gradient are skipped.
    """
    group = None if hcg is None else hcg.get_data_parallel_group()
    _fused_mean(parameter_list, group)


def _fused_mean(parameter_list, group):
    init_parallel_env()
    grads = [p.grad for p in parameter_list if getattr(p, "grad", None) is not None]
    all_reduce_mean_(grads, group, bucket_bytes=FUSE_BYTES)
