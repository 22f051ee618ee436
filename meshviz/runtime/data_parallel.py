"""The data-parallel engine: replicas made equal and gradients averaged over an explicitly passed group."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import compat, trace
from . import rollcall
from .comm import FUSE_BYTES, Call, CollectiveOp, all_reduce_mean_, local, run
from .groups import Group

__all__ = ["DataParallelEngine", "broadcast_params_buffers", "average_gradients", "FUSE_BYTES"]


class DataParallelEngine:
    """``module`` trained data-parallel over the member group ``g``: gradients averaged in backward.

    Built on torch DDP: buckets of ``bucket_mb`` MB, the first one (the parameters defined first, whose gradients
    are ready last) of ``first_bucket_mb`` MB; DDP's constructor broadcasts parameters and buffers from the
    group's first rank. A module with nothing to train gets no DDP (``ddp`` is None): its replicas are made equal.
    """

    def __init__(self, module: nn.Module, g: Group, bucket_mb, first_bucket_mb, find_unused_parameters=False):
        self.module = module
        self.group = g
        self.key = tuple(g.ranks)
        self.ddp = None
        if not any(p.requires_grad for p in module.parameters()):
            broadcast_params_buffers(module, g)
            return
        made = []
        nbytes = sum(t.numel() * t.element_size() for t in module.state_dict().values())
        devs = {p.device for p in module.parameters()}
        gpu = next(iter(devs)) if len(devs) == 1 and next(iter(devs)).type == "cuda" else None
        run(Call(CollectiveOp.BROADCAST, g, lambda g: made.append(DDP(
            module,
            device_ids=None if gpu is None else [gpu.index],  # on a GPU, DDP moves the inputs there too
            process_group=g.process_group,
            bucket_cap_mb=bucket_mb,
            bucket_cap_mb_list=[first_bucket_mb, bucket_mb],
            find_unused_parameters=find_unused_parameters,
        )), nbytes=nbytes, name="DataParallel.sync_params", src=g.ranks[0]))
        self.ddp = made[0]
        # Paddle syncs buffers at the wrap only: each rank's BatchNorm statistics then follow its own batches
        # (set after the constructor, whose sync still includes the buffers, on every torch this supports)
        self.ddp.broadcast_buffers = False
        if trace.active():
            # a Python hook per bucket costs 5-10% of a small step on gloo (bench/README): only when traced
            self.ddp.register_comm_hook(g, _allreduce_hook)

    def forward(self, *inputs, **kwargs):
        if self.ddp is None:
            return self.module(*inputs, **kwargs)
        out = self.ddp(*inputs, **kwargs)
        if self.ddp.require_backward_grad_sync and torch.is_grad_enabled():
            # DDP's bucket all-reduces bypass the comm layer (its C++ hook): a rank blocked in the backward that
            # follows is shown as inside them on this group
            rollcall.current().begin_region("all_reduce", self.key, "DataParallel gradients")
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Inside: gradients accumulate locally. The next backward outside averages the accumulated sum."""
        if self.ddp is None:
            yield
            return
        with self.ddp.no_sync():
            yield

    def train(self, mode: bool) -> None:
        if self.ddp is not None:
            self.ddp.training = mode


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


def broadcast_params_buffers(model: nn.Module, g: Group, src: int | None = None, skip_distributed=False) -> None:
    """Broadcast ``model``'s parameters and buffers from global rank ``src`` (default: the group's first rank),
    one flat buffer per dtype. ``skip_distributed``: leave the tensors marked ``is_distributed`` alone."""
    if not g.is_member():
        return
    src = g.ranks[0] if src is None else src
    # ``is True``: a torch tensor's own ``is_distributed`` is a method, truthy on every tensor not marked
    tensors = [t for t in list(model.parameters()) + list(model.buffers())
               if not (skip_distributed and getattr(t, "is_distributed", False) is True)]
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        ts = [t for t in tensors if t.dtype == dtype]
        flat = local(compat.flatten_dense_tensors([t.detach() for t in ts]))
        run(Call(CollectiveOp.BROADCAST, g, lambda g: tdist.broadcast(flat, src, group=g.process_group, async_op=True),
                 tensors=(flat,), peers={"src": src}, sync_op=True, src=src))
        with torch.no_grad():
            for t, v in zip(ts, compat.unflatten_dense_tensors(flat, ts)):
                t.copy_(v)


def average_gradients(parameters, group, bucket_bytes: int = FUSE_BYTES) -> None:
    """Replace the gradient of every parameter that has one on some rank by its mean over ``group`` (one
    all-reduce per buffer of about ``bucket_bytes`` per dtype), a rank without it counting zero, as DDP counts a
    parameter a rank did not use; one that no rank has a gradient for keeps none.

    Each rank packs every parameter that requires a gradient, so the buffers agree whichever gradients a rank has
    (packing only the gradients there are hangs the ranks on buffers of different sizes); one more element per
    parameter says whether the rank had its gradient. Where every rank is known to have every gradient, call
    :func:`~meshviz.runtime.comm.all_reduce_mean_` on them."""
    params = [p for p in parameters if getattr(p, "grad", None) is not None or getattr(p, "requires_grad", False)]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    by_dtype: dict = {}  # dtype -> indices into params
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    flags = {dt: torch.tensor([params[i].grad is not None for i in ix], dtype=dt, device=grads[ix[0]].device)
             for dt, ix in by_dtype.items()}
    # each dtype's flags first: they join its first buffer (last, they could open a buffer of their own)
    all_reduce_mean_(list(flags.values()) + grads, group, bucket_bytes=bucket_bytes)
    if all(p.grad is not None for p in params):
        return
    for dt, ix in by_dtype.items():
        for i, somewhere in zip(ix, flags[dt].tolist()):
            if params[i].grad is None and somewhere:
                params[i].grad = grads[i]
