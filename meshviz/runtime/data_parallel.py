"""The data-parallel engine: replicas made equal and gradients averaged over an explicitly passed group."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as tdist
from torch import nn
from torch.autograd import Variable
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import get_gradient_edge
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import compat, trace
from ..compat.dynamo import eager
from . import rollcall
from .comm import FUSE_BYTES, Call, CollectiveOp, all_reduce_mean_, local, run
from .groups import Group

__all__ = ["DataParallelEngine", "broadcast_params_buffers", "average_gradients", "tensors_in", "reached_in_backward",
           "FUSE_BYTES"]


class DataParallelEngine:
    """``module`` trained data-parallel over the member group ``g``: gradients averaged in backward.

    Built on torch DDP: buckets of ``bucket_mb`` MB, the first one (the parameters defined first, whose gradients
    are ready last) of ``first_bucket_mb`` MB; DDP's constructor broadcasts parameters and persistent buffers from
    the group's first rank. As in Paddle, a parameter marked ``no_sync`` is neither broadcast nor averaged, nor is a
    non-persistent buffer broadcast. The parameters to average are those that require a gradient at each forward:
    where that set changed since the last one (a layer frozen or unfrozen after the wrap, on every rank alike), the
    reducer is built again over the new set, without a broadcast. With nothing to train there is no DDP (``ddp`` is
    None): the replicas are made equal at the wrap. Without ``find_unused_parameters``, as Paddle's reducer, the first
    synced forward looks for parameters its loss cannot use: where some rank has one (and no_sync() steps came
    before none), DDP is built again to search for them at every backward from that one on (a gradient averaged with
    zeros from the ranks that did not use it, none where no rank did); else nothing changes: a rank that leaves one
    out sends its zeros for it at the end of that backward (see :func:`_check_after_backward`). With
    ``find_unused_parameters``, where that forward runs a custom autograd Function (a reentrant checkpoint) on some
    rank, those zeros replace DDP's search, which cannot see the Function's parameters.
    """

    def __init__(self, module: nn.Module, g: Group, bucket_mb, first_bucket_mb, find_unused_parameters=False,
                 lazy=False):
        self.module = module
        self.group = g
        self.key = tuple(g.ranks)
        self.bucket_mb, self.first_bucket_mb = bucket_mb, first_bucket_mb
        self.find_unused_parameters = find_unused_parameters
        self.find = find_unused_parameters  # whether DDP searches for unused parameters at every backward
        self.probe = True  # whether the next synced forward looks for them (and for hidden ones)
        self.accumulated = False  # a forward inside no_sync() since the last synced one
        self.sync = True  # False inside no_sync()
        self.ddp = self.retired = None
        self.seen = None  # where a custom Function may hide parameters: those whose gradient came this backward
        self.params = list(module.parameters())  # the set DDP was given: a changed flag is read from these alone
        self.flags = [p.requires_grad for p in self.params]
        self.trained = _trained(module)
        # ``lazy``: a copy of replicas already equal (a deep copy, which one rank may make alone): no collective
        # until its first forward that records a gradient builds the reducer
        self.lazy = lazy
        if lazy:
            return
        if not self.trained:
            broadcast_params_buffers(module, g)
            return
        nbytes = sum(t.numel() * t.element_size() for t in _synced(module))
        made: list = []
        run(Call(CollectiveOp.BROADCAST, g, lambda g: made.append(self._build(True)), nbytes=nbytes,
                 name="DataParallel.sync_params", src=g.ranks[0]))
        self._install(made[0])

    def _build(self, init_sync: bool):
        module = self.module
        ignore = [n for n, t, is_param in _named_tensors(module) if not _is_synced(module, n, t, is_param)]
        before = module.__dict__.get("_ddp_params_and_buffers_to_ignore", _ABSENT)
        if ignore or before is not _ABSENT:
            module._ddp_params_and_buffers_to_ignore = list(dict.fromkeys(
                ignore + ([] if before is _ABSENT else list(before))))
        devs = {p.device for p in module.parameters()}
        gpu = next(iter(devs)) if len(devs) == 1 and next(iter(devs)).type == "cuda" else None
        try:
            return DDP(
                module,
                device_ids=None if gpu is None else [gpu.index],  # on a GPU, DDP moves the inputs there too
                process_group=self.group.process_group,
                bucket_cap_mb=self.bucket_mb,
                bucket_cap_mb_list=[self.first_bucket_mb, self.bucket_mb],
                find_unused_parameters=self.find,
                init_sync=init_sync,
            )
        finally:
            if before is _ABSENT:
                module.__dict__.pop("_ddp_params_and_buffers_to_ignore", None)
            else:
                module._ddp_params_and_buffers_to_ignore = before

    def _install(self, ddp) -> None:
        self.ddp = ddp
        ddp.training = self.module.training
        # Paddle syncs buffers at the wrap only: each rank's BatchNorm statistics then follow its own batches
        # (set after the constructor, whose sync still includes the buffers, on every torch this supports)
        ddp.broadcast_buffers = False
        if trace.active():
            # a Python hook per bucket costs 5-10% of a small step on gloo (bench/README): only when traced
            ddp.register_comm_hook(self.group, _allreduce_hook)

    def _refresh(self) -> None:
        """Build the reducer again where the parameters that require a gradient are no longer those it has."""
        flags = [p.requires_grad for p in self.params]
        if flags == self.flags:
            return
        self.flags = flags
        now = _trained(self.module)
        if now == self.trained:
            return
        if self.ddp is not None:
            self.ddp.reducer._remove_autograd_hooks()
        self.trained, self.ddp = now, None
        self.find, self.probe = self.find_unused_parameters, True  # looked at again
        if now:
            self._install(self._build(False))

    def forward(self, *inputs, **kwargs):
        self.retired = None
        if self.lazy:
            if not torch.is_grad_enabled():
                return self.module(*inputs, **kwargs)
            self.lazy = False
            self.flags = [p.requires_grad for p in self.params]
            self.trained = _trained(self.module)
            if self.trained:
                self._install(self._build(False))
        self._refresh()
        if self.ddp is None:
            return self.module(*inputs, **kwargs)
        self.ddp.require_backward_grad_sync = self.sync
        out = self.ddp(*inputs, **kwargs)
        if torch.is_grad_enabled():
            self._after_forward(out)
        return out

    @eager  # a collective and the rank's bookkeeping: eager in a compiled model too
    def _after_forward(self, out) -> None:
        if not self.sync:
            self.accumulated = True
            return
        if self.probe:
            self._probe(out)
        self.accumulated = False
        if self.seen is not None:
            self.seen.clear()
        # DDP's bucket all-reduces bypass the comm layer (its C++ hook): a rank blocked in the backward that
        # follows is shown as inside them on this group
        rollcall.current().begin_region("all_reduce", self.key, "DataParallel gradients")
        if not self.find:
            _check_after_backward(self.ddp, out, self.module, self.group, self.seen)

    def _probe(self, out) -> None:
        """The first synced forward: where ``out`` leaves a parameter DDP averages unused on some rank (one MAX
        all-reduce of flags, untraced as DDP's own search), DDP is built again to search for unused parameters,
        this backward included; not after no_sync() steps, nor where a custom autograd Function may hide some.
        While DDP searches (``find_unused_parameters``, or after that), where such a Function runs on some rank,
        at this synced forward or a later one, DDP's search, which cannot see its parameters (it would take them
        for unused, then raise when the Function's backward reaches them), is replaced by the end-of-backward zeros
        of :func:`_check_after_backward`, whose gradients are the same."""
        self.probe = False
        reached, hidden = _reached_params(out)
        flag = torch.tensor([any(i not in reached for i in self.trained), self.accumulated, hidden],
                            dtype=torch.uint8, device=self.params[0].device)
        run(Call(CollectiveOp.ALL_REDUCE, self.group,
                 lambda g: tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=g.process_group, async_op=True),
                 tensors=(flag,), traced=False, name="DataParallel.find_unused", reduce_op="max"))
        unused, accumulated, hidden = flag.tolist()
        if hidden and self.seen is None:  # the autograd graph cannot say which parameters a backward reaches:
            self.seen = set()  # their gradients can
            for p in self.params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda p, seen=self.seen: seen.add(id(p)))
        # the reducer there is stays where one built now would not know what the no_sync() backwards used, or where
        # a custom autograd Function (a reentrant checkpoint) may use parameters its inputs do not show; the end
        # of each backward then sends what a rank left unreduced (_check_after_backward)
        switch = hidden if self.find else unused and not accumulated and not hidden
        self.find = self.find != switch
        # DDP's search cannot see a custom Function that a later forward runs first: while it searches, each looks
        self.probe = self.find
        if not switch:
            return
        self.ddp.reducer._remove_autograd_hooks()
        self.retired = self.ddp  # its output's backward (DDP's _DDPSink) reads it through a weak reference
        self._install(self._build(False))
        self.ddp.require_backward_grad_sync = True
        self.ddp.reducer.prepare_for_backward(tensors_in(out))  # what DDP's forward does with them

    @contextlib.contextmanager
    def no_sync(self):
        """Inside: gradients accumulate locally. The next backward outside averages the accumulated sum."""
        before, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = before

    def train(self, mode: bool) -> None:
        if self.ddp is not None:
            self.ddp.training = mode


_ABSENT = object()


def _check_after_backward(ddp, out, module, g, seen=None) -> None:
    """At the end of a backward through ``out`` that left a bucket unreduced on this rank (a parameter DDP averages,
    used in the first synced step, took no part in the loss now, or only inside ``no_sync``), send this rank's zeros
    for it (its accumulated gradient where it has one), as DDP's ``find_unused_parameters`` does: the ranks that
    used it wait in that bucket's all-reduce, and know nothing of this rank. Then, on every rank, settle the averaged
    gradients that are exactly zero (see :func:`_drop_unused`). ``seen``: the ids of the parameters whose gradient
    this backward accumulated, where the autograd graph does not show them all (None: it does)."""

    def check():
        trained = set(_trained(module))
        try:
            ddp.reducer._check_reducer_finalized()
            left = set()  # a finalized reducer: every parameter it averages was used here
        except RuntimeError as e:
            left = _send_zeros(ddp, module, trained, seen, e)
        _drop_unused([p for n, p in module.named_parameters() if id(p) in trained
                      and n not in ddp.parameters_to_ignore], left, g)

    _after_backward(out, check)


def _send_zeros(ddp, module, trained, seen, error) -> set:
    """Send zeros (or the accumulated gradient) for the parameters this rank's backward left out; the ids of those
    that had no gradient here."""
    unused = [p for p in module.parameters() if id(p) in trained
              and (id(p) not in seen if seen is not None else not reached_in_backward(p))]
    left = {id(p) for p in unused if p.grad is None}
    if unused:
        try:
            torch.autograd.backward(unused, [torch.zeros_like(p) for p in unused])  # runs DDP's hooks on them
        except RuntimeError as e:  # DDP refuses one it has had: a custom Function's own backward used it
            raise RuntimeError(
                "DataParallel: this rank's loss left a parameter out while a custom autograd Function (such as "
                "a reentrant checkpoint: recompute(..., use_reentrant=True)) used others where the autograd graph "
                "does not show them, so the parameters to send zeros for are unknown; use use_reentrant=False. "
                f"torch DDP: {e}") from None
    try:
        ddp.reducer._check_reducer_finalized()
    except RuntimeError:
        raise RuntimeError(
            "DataParallel: the backward ended with gradients not averaged: a parameter that requires a "
            "gradient took no part in the loss on this rank (or only inside no_sync()), and torch could not say "
            "which. Pass find_unused_parameters=True to DataParallel, or freeze the parameter. "
            f"torch DDP: {error}") from None
    return left


def _drop_unused(params, left, g) -> None:
    """Drop the averaged gradient of each parameter in ``params`` that no rank used, as one process keeps none.

    Every rank holds the same averaged gradients, so every rank finds the same ones zero (:func:`_all_zero`): only
    those can be unused everywhere (a rank that left one out sent zeros), yet a rank may have used one with a
    gradient of exactly zero, and then one process keeps its zeros. One MAX all-reduce of "used here" flags
    (``left``: the ids this rank left out with no gradient) decides, on every rank alike, and only where some
    averaged gradient is zero."""
    params = [p for p in params if p.grad is not None]  # after DDP's finalize, all of them on every rank
    if not params:
        return
    grads = [p.grad for p in params]
    zero = [p for p, z in zip(params, _all_zero(grads)) if z]
    if not zero:
        return
    flag = torch.tensor([id(p) not in left for p in zero], dtype=torch.uint8, device=zero[0].device)
    run(Call(CollectiveOp.ALL_REDUCE, g,
             lambda g: tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=g.process_group, async_op=True),
             tensors=(flag,), traced=False, name="DataParallel.find_unused", reduce_op="max"))
    for p, used in zip(zero, flag.tolist()):
        if not used:
            p.grad = None


def _all_zero(grads) -> list:
    """Whether each of ``grads`` may be all zeros: a 2-norm of zero (all zeros, or values whose squares underflow,
    which costs the caller only its flags' all-reduce). Each gradient's first value is looked at first, all in one
    read back: only those whose first value is zero (rare once training runs) are passed over whole."""
    maybe = [i for i, t in enumerate(grads) if t.layout != torch.strided or not t.numel()]
    dense = [i for i, t in enumerate(grads) if t.layout == torch.strided and t.numel()]
    if dense:
        first = torch.stack([grads[i][(0,) * grads[i].dim()] for i in dense]).eq(0)
        if bool(first.any()):
            maybe += [dense[k] for k in first.nonzero().flatten().tolist()]
    flags = [False] * len(grads)
    whole = [i for i in maybe if grads[i].layout == torch.strided]
    for i, norm in zip(whole, torch._foreach_norm([grads[i] for i in whole]) if whole else ()):
        flags[i] = bool(norm == 0)
    for i in maybe:
        if grads[i].layout != torch.strided:
            flags[i] = not bool(grads[i].coalesce().values().any())
    return flags


def tensors_in(out) -> list:
    """The tensors in ``out`` (nested lists, tuples, dicts and dataclasses), in order, as DDP looks for them."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in tensors_in(v)]
    if isinstance(out, dict):
        return [t for v in out.values() for t in tensors_in(v)]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [t for f in dataclasses.fields(out) for t in tensors_in(getattr(out, f.name))]
    return []


def _after_backward(out, fn) -> None:
    """Run ``fn`` at the end of each backward through tensors in ``out`` (once, whichever of them it reaches: ranks
    whose losses use different ones run it alike), after DDP's own finalize, which is queued during the backward."""
    last = [None]  # the backward (autograd graph task) it was queued for

    def hook(grad):
        task = compat.graph_task_id()
        if task != last[0]:
            last[0] = task
            Variable._execution_engine.queue_callback(lambda: Variable._execution_engine.queue_callback(fn))

    for t in tensors_in(out):
        if t.requires_grad and t.grad_fn is not None:  # a hook on a leaf (a parameter) would outlive the step
            t.register_hook(hook)


def reached_in_backward(p) -> bool:
    """Whether the backward under way runs ``p``'s gradient accumulator (as DDP's find_unused_parameters asks; True
    where torch cannot say)."""
    return compat.will_run(get_gradient_edge(p).node)


def _reached_params(out) -> tuple:
    """The ids of the leaves (parameters) the autograd graph of the tensors in ``out`` reaches, and whether it holds a
    custom autograd Function's node, whose backward may reach parameters no edge shows (a reentrant checkpoint)."""
    leaves = {id(t) for t in tensors_in(out) if t.grad_fn is None and t.requires_grad}
    # ``seen`` keeps each node's Python object alive: one let go may come back as another object at the same id
    stack, seen, hidden = [t.grad_fn for t in tensors_in(out) if t.grad_fn is not None], {}, False
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        # DDP's own Function on the outputs (with find_unused_parameters) hides nothing
        hidden = hidden or isinstance(node, BackwardCFunction) and not compat.is_ddp_sink(node)
        var = getattr(node, "variable", None)
        if var is not None:
            leaves.add(id(var))
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return leaves, hidden


def _named_tensors(module: nn.Module) -> list:
    """``(name, tensor, is_parameter)`` of every parameter and buffer of ``module``."""
    return [(n, t, True) for n, t in module.named_parameters()] + [(n, t, False) for n, t in module.named_buffers()]


def _is_synced(module: nn.Module, name: str, t, is_param: bool, expert_too: bool = False) -> bool:
    """Whether Paddle's ``sync_params_buffers`` broadcasts ``t`` (``name`` in ``module``): not a parameter marked
    ``no_sync`` (an expert one too with ``expert_too``), nor a buffer registered non-persistent."""
    if is_param:
        return not getattr(t, "no_sync", False) or (expert_too and getattr(t, "expert", False))
    owner, _, leaf = name.rpartition(".")
    return leaf not in module.get_submodule(owner)._non_persistent_buffers_set


def _synced(module: nn.Module, expert_too: bool = False) -> list:
    return [t for n, t, is_param in _named_tensors(module) if _is_synced(module, n, t, is_param, expert_too)]


def _trained(module: nn.Module) -> tuple:
    """The ids of the parameters DDP averages: those that require a gradient, but for ones marked ``no_sync``."""
    return tuple(id(p) for p in module.parameters() if p.requires_grad and not getattr(p, "no_sync", False))


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


def broadcast_params_buffers(model: nn.Module, g: Group, src: int | None = None, skip_distributed=False,
                             expert_too=False) -> None:
    """Broadcast ``model``'s parameters and persistent buffers from global rank ``src`` (default: the group's first
    rank), one flat buffer per dtype, as Paddle's ``sync_params_buffers``: a parameter marked ``no_sync`` is left
    alone (but with ``expert_too`` one also marked ``expert``). ``skip_distributed``: leave the tensors marked
    ``is_distributed`` alone."""
    if not g.is_member():
        return
    src = g.ranks[0] if src is None else src
    # ``is True``: a torch tensor's own ``is_distributed`` is a method, truthy on every tensor not marked
    tensors = [t for t in _synced(model, expert_too)
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
