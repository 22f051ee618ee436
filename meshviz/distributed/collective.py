"""Paddle's collective API (groups, all_reduce, send/recv, ...) on torch.distributed, emitting events."""

from __future__ import annotations

import torch
import torch.distributed as tdist

from .. import trace
from ..core.placements import Partial, ReduceType
from ..runtime import comm, groups
from ..runtime.comm import Call, CollectiveOp, Task, check_peer, local, peer_names, reduction, run, tensor_bytes
from ..runtime.devices import staged_recv, staged_send
from ..runtime.dtensor import DistTensor
from ..runtime.groups import Group
from ..runtime.world import get_rank
from .group_api import destroy_process_group, get_backend, get_group, is_available, needs_init, new_group
from .object_collective import all_gather_object, broadcast_object_list, scatter_object_list

__all__ = [
    "ReduceOp", "Group", "new_group", "get_group", "get_backend", "is_available", "destroy_process_group",
    "all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "reduce",
    "scatter", "scatter_object_list", "gather", "reduce_scatter", "alltoall", "alltoall_single",
    "send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv", "barrier", "wait",
]


class ReduceOp:
    """Paddle's reduce operations: names for :class:`ReduceType`'s members (``ReduceOp.SUM is ReduceType.kRedSum``,
    equal to Paddle's integers 0-4)."""

    SUM = ReduceType.kRedSum
    MAX = ReduceType.kRedMax
    MIN = ReduceType.kRedMin
    PROD = ReduceType.kRedProd
    AVG = ReduceType.kRedAvg


def _check_op(op) -> ReduceType:
    try:
        return ReduceType(None if isinstance(op, bool) or not isinstance(op, int) else op)
    except ValueError:
        raise ValueError(f"unknown reduce op {op!r}; use dist.ReduceOp.SUM, MAX, MIN, PROD or AVG") from None


def _check_like(what: str, tensors, t: torch.Tensor) -> None:
    """Every tensor of ``tensors`` has ``t``'s shape and dtype (ValueError on every rank, before communicating)."""
    for i, x in enumerate(tensors):
        x = local(x)
        if x.shape != t.shape or x.dtype != t.dtype:
            raise ValueError(f"{what}[{i}] is {_dtype_name(x)}{list(x.shape)}, but the tensor is {_dtype_name(t)}"
                             f"{list(t.shape)}; give tensors of its shape and dtype")


def _no_partial(what: str, *tensors) -> None:
    """A collective works on each rank's block; a Partial dist tensor's blocks are summands, which it would leave
    still read as Partial (summed again by whatever reads them): refused on every rank, before communicating."""
    for t in tensors:
        for x in t if isinstance(t, (list, tuple)) else (t,):
            if isinstance(x, DistTensor) and any(isinstance(p, Partial) for p in x._mpl):
                raise ValueError(
                    f"{what} got a dist tensor with placements {x.placements}: its blocks are summands, which a "
                    f"collective would leave read as Partial. Use dist.reshard(t, t.process_mesh, [dist.Replicate()"
                    f", ...]) for their sum on every rank, or dist.dtensor_to_local(t) for this rank's summand")


def _dense(t: torch.Tensor):
    """(the tensor the backend reads and writes, the copy that finishes the call or None): gloo takes a tensor's
    memory as contiguous, so a strided view (``x[:, 0]``) goes through a contiguous copy written back at the end."""
    if t.is_contiguous():
        return t, None
    buf = t.contiguous()
    return buf, lambda: t.detach().copy_(buf)


def _pieces(what: str, whole, t: torch.Tensor, n: int) -> list:
    """Paddle's tensor form of a list argument: ``whole`` holds ``n`` tensors like ``t`` one after another."""
    whole = local(whole)
    if whole.dtype != t.dtype or whole.numel() != t.numel() * n:
        raise ValueError(f"{what}: the tensor is {_dtype_name(whole)}{list(whole.shape)}, but a group of {n} with "
                         f"{_dtype_name(t)}{list(t.shape)} pieces needs {n} times its elements of its dtype")
    return list(whole.contiguous().view(n, *t.shape).unbind(0))


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _then(*steps):
    """One ``then`` running ``steps`` (falsy ones left out) in order; None when none is left."""
    steps = [f for f in steps if f]
    return None if not steps else steps[0] if len(steps) == 1 else (lambda: [f() for f in steps])


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except Exception:  # a tensor without storage
        return a is b


def _check_not_self(what: str, peer, sync_op: bool) -> None:
    if sync_op and isinstance(peer, int) and peer == get_rank():
        raise ValueError(f"{what}={peer} is this rank itself; a blocking send or recv needs another rank")


# -- collectives --------------------------------------------------------------------------------

@needs_init
def all_reduce(tensor, op=ReduceOp.SUM, group=None, sync_op=True):
    """Reduce ``tensor`` over the group in place; every member ends with the result."""
    _no_partial("all_reduce", tensor)
    rt = _check_op(op)
    t = local(tensor)
    comm.check_reduce("all_reduce", rt, t)
    g = groups.resolve(group)
    top, finish = reduction(rt, g)
    buf, back = _dense(t)
    return run(Call(CollectiveOp.ALL_REDUCE, g,
                    lambda g: tdist.all_reduce(buf, op=top, group=g.process_group, async_op=True),
                    tensors=(t,), sync_op=sync_op, then=_then(finish and (lambda: finish(buf)), back),
                    reduce_op=rt.short))


@needs_init
def reduce(tensor, dst=0, op=ReduceOp.SUM, group=None, sync_op=True):
    """Reduce ``tensor`` onto global rank ``dst`` (in place there; others' tensors are left as they are)."""
    _no_partial("reduce", tensor)
    rt = _check_op(op)
    t = local(tensor)
    comm.check_reduce("reduce", rt, t)
    g = groups.resolve(group)
    top, finish = reduction(rt, g)
    mine = tdist.get_rank() == dst
    buf, back = _dense(t) if mine else (t, None)

    def start(g):  # gloo's reduce scribbles on non-destination inputs: they reduce a copy
        return tdist.reduce(buf if mine else t.clone(), dst, op=top, group=g.process_group, async_op=True)

    return run(Call(CollectiveOp.REDUCE, g, start, tensors=(t,), peers={"dst": dst}, sync_op=sync_op,
                    then=_then(finish and mine and (lambda: finish(buf)), back), reduce_op=rt.short, dst=dst))


@needs_init
def broadcast(tensor, src, group=None, sync_op=True):
    """Copy global rank ``src``'s ``tensor`` into every member's ``tensor``."""
    _no_partial("broadcast", tensor)
    t = local(tensor)
    buf, back = _dense(t)
    return run(Call(CollectiveOp.BROADCAST, group,
                    lambda g: tdist.broadcast(buf, src, group=g.process_group, async_op=True),
                    tensors=(t,), peers={"src": src}, sync_op=sync_op, then=back, src=src))


@needs_init
def all_gather(tensor_list, tensor, group=None, sync_op=True):
    """Gather every member's ``tensor`` into ``tensor_list`` (filled in when empty, as in Paddle), or into one tensor
    holding them one after another (Paddle's tensor form: ``tensor_list`` a tensor of ``nranks`` times the elements)."""
    _no_partial("all_gather", tensor, tensor_list)
    t = local(tensor)
    g = groups.resolve(group)
    if isinstance(tensor_list, torch.Tensor):
        return _all_gather_into(local(tensor_list), t, g, sync_op)
    if not isinstance(tensor_list, list):
        raise TypeError(f"all_gather: tensor_list must be a list or a tensor, got {type(tensor_list).__name__}")
    if tensor_list and len(tensor_list) != g.nranks:
        raise ValueError(f"all_gather: tensor_list has {len(tensor_list)} tensors for a group of {g.nranks}")
    _check_like("all_gather: tensor_list", tensor_list, t)

    def start(g):
        if not tensor_list:
            tensor_list.extend(torch.empty_like(t) for _ in g.ranks)
        outs = [local(o) for o in tensor_list]
        # an output that is the input itself (or shares its memory) must not change it before it is sent
        src = t.clone() if any(_shares_memory(o, t) for o in outs) else t.contiguous()
        return tdist.all_gather(outs, src, group=g.process_group, async_op=True)

    return run(Call(CollectiveOp.ALL_GATHER, g, start, tensors=(t,), nbytes=tensor_bytes(t) * g.nranks,
                    sync_op=sync_op))


def _all_gather_into(out: torch.Tensor, t: torch.Tensor, g: Group, sync_op: bool):
    buf, back = _dense(out)
    outs = _pieces("all_gather", buf, t, g.nranks)  # views of the output, written in place
    src = t.clone() if _shares_memory(buf, t) else t.contiguous()
    return run(Call(CollectiveOp.ALL_GATHER, g, lambda g: tdist.all_gather(outs, src, group=g.process_group,
                                                                           async_op=True),
                    tensors=(t,), nbytes=tensor_bytes(t) * g.nranks, sync_op=sync_op, then=back))


@needs_init
def scatter(tensor, tensor_list=None, src=0, group=None, sync_op=True):
    """Global rank ``src`` sends ``tensor_list[i]`` to the group's i-th member, received into ``tensor`` (a tensor for
    ``tensor_list``, Paddle's tensor form, holds the pieces one after another)."""
    _no_partial("scatter", tensor, [] if tensor_list is None else tensor_list)
    t = local(tensor)
    g = groups.resolve(group)
    mine = tdist.get_rank() == src
    lst = None
    if mine and g.is_member():
        if isinstance(tensor_list, torch.Tensor):
            tensor_list = _pieces("scatter", tensor_list, t, g.nranks)
        if tensor_list is None or len(tensor_list) != g.nranks:
            n = None if tensor_list is None else len(tensor_list)
            raise ValueError(f"scatter: src rank needs a tensor_list of {g.nranks} tensors, got {n}")
        _check_like("scatter: tensor_list", tensor_list, t)
        lst = [local(x).contiguous() for x in tensor_list]
        # Paddle's own example passes the output tensor in the list: a piece must not change while it is sent
        lst = [x.clone() if _shares_memory(x, t) else x for x in lst]
    buf, back = _dense(t)
    return run(Call(CollectiveOp.SCATTER, g,
                    lambda g: tdist.scatter(buf, lst, src=src, group=g.process_group, async_op=True),
                    tensors=(t,), nbytes=tensor_bytes(t) * (g.nranks if mine else 1), peers={"src": src},
                    sync_op=sync_op, then=back, src=src))


@needs_init
def gather(tensor, gather_list=None, dst=0, group=None, sync_op=True):
    """Collect every member's ``tensor`` into ``gather_list`` on global rank ``dst`` (filled in when empty)."""
    _no_partial("gather", tensor, gather_list or [])
    t = local(tensor)
    g = groups.resolve(group)
    lst = None
    if tdist.get_rank() == dst and g.is_member():
        if gather_list is None:
            raise ValueError("gather: the dst rank needs a gather_list (a list, may be empty)")
        if not gather_list:
            gather_list.extend(torch.empty_like(t) for _ in g.ranks)
        if len(gather_list) != g.nranks:
            raise ValueError(f"gather: gather_list has {len(gather_list)} tensors for a group of {g.nranks}")
        _check_like("gather: gather_list", gather_list, t)
        lst = [local(x) for x in gather_list]
    src = t.contiguous()
    if src.is_complex():  # gloo's gather has no complex dtypes: their real views
        src, lst = torch.view_as_real(src), lst and [torch.view_as_real(x) for x in lst]
    return run(Call(CollectiveOp.GATHER, g,
                    lambda g: tdist.gather(src, lst, dst=dst, group=g.process_group, async_op=True),
                    tensors=(t,), peers={"dst": dst}, sync_op=sync_op, dst=dst))


@needs_init
def reduce_scatter(tensor, tensor_list, op=ReduceOp.SUM, group=None, sync_op=True):
    """Reduce ``tensor_list`` elementwise over the group; the i-th member gets the i-th reduced tensor. A tensor
    for ``tensor_list`` (Paddle's tensor form) holds the ``nranks`` pieces one after another."""
    _no_partial("reduce_scatter", tensor, tensor_list)
    rt = _check_op(op)
    t = local(tensor)
    comm.check_reduce("reduce_scatter", rt, t)
    g = groups.resolve(group)
    if isinstance(tensor_list, torch.Tensor):
        tensor_list = _pieces("reduce_scatter", tensor_list, t, g.nranks)
    if tensor_list is None or len(tensor_list) != g.nranks:
        n = None if tensor_list is None else len(tensor_list)
        raise ValueError(f"reduce_scatter: tensor_list needs {g.nranks} tensors, got {n}")
    _check_like("reduce_scatter: tensor_list", tensor_list, t)
    ins = [local(x).contiguous() for x in tensor_list]
    ins = [x.clone() if _shares_memory(x, t) else x for x in ins]  # the output inside the input: read it first
    top, finish = reduction(rt, g)
    buf, back = _dense(t)
    return run(Call(CollectiveOp.REDUCE_SCATTER, g,
                    lambda g: tdist.reduce_scatter(buf, ins, op=top, group=g.process_group, async_op=True),
                    tensors=ins, sync_op=sync_op, then=_then(finish and (lambda: finish(buf)), back),
                    reduce_op=rt.short))


@needs_init
def alltoall(out_tensor_list, in_tensor_list, group=None, sync_op=True):
    """Member i sends ``in_tensor_list[j]`` to member j, which receives it as ``out_tensor_list[i]`` (the output
    first, as in Paddle 3; an empty ``out_tensor_list`` is filled in). Two tensors: :func:`alltoall_single`."""
    if isinstance(out_tensor_list, torch.Tensor) and isinstance(in_tensor_list, torch.Tensor):
        return alltoall_single(out_tensor_list, in_tensor_list, group=group, sync_op=sync_op)
    if not isinstance(out_tensor_list, list) or isinstance(in_tensor_list, torch.Tensor):
        raise TypeError(f"alltoall: give two lists (out_tensor_list first, as in Paddle 3) or two tensors, got "
                        f"{type(out_tensor_list).__name__} and {type(in_tensor_list).__name__}")
    _no_partial("alltoall", in_tensor_list or [], out_tensor_list)
    g = groups.resolve(group)
    if not isinstance(in_tensor_list, (list, tuple)) or len(in_tensor_list) != g.nranks:
        n = len(in_tensor_list) if isinstance(in_tensor_list, (list, tuple)) else type(in_tensor_list).__name__
        raise ValueError(f"alltoall: in_tensor_list (the second argument) needs {g.nranks} tensors, got {n}; "
                         f"the output comes first, as in Paddle 3: dist.alltoall(out_tensor_list, in_tensor_list)")
    if out_tensor_list and len(out_tensor_list) != g.nranks:
        raise ValueError(f"alltoall: out_tensor_list has {len(out_tensor_list)} tensors, need {g.nranks}")
    ins = [local(x) for x in in_tensor_list]
    for what, lst in (("in_tensor_list", ins), ("out_tensor_list", [local(o) for o in out_tensor_list])):
        for i, x in enumerate(lst):  # one packed buffer carries them: another dtype would be converted
            if x.dtype != ins[0].dtype:
                raise ValueError(f"alltoall: {what}[{i}] is {_dtype_name(x)}, in_tensor_list[0] {_dtype_name(ins[0])}; "
                                 f"every tensor sent and received must have one dtype")
    done = []

    def start(g):
        if not out_tensor_list:
            out_tensor_list.extend(torch.empty_like(x) for x in ins)
        work, unpack = comm.all_to_all_flat([local(x) for x in out_tensor_list], ins, g.process_group)
        done.append(unpack)
        return work

    got = sum(tensor_bytes(x) for i, x in enumerate(local(o) for o in out_tensor_list or ins) if i != g.rank)
    agree = comm.counts_agree("alltoall", [x.numel() for x in ins], [local(o).numel() for o in out_tensor_list or ins],
                         "elements")
    return run(Call(CollectiveOp.ALLTOALL, g, start, tensors=ins, sync_op=sync_op, then=lambda: done[0](),
                    recv_bytes=got), (*comm.CHECKS, agree))


@needs_init
def alltoall_single(out_tensor, in_tensor, in_split_sizes=None, out_split_sizes=None, group=None,
                    sync_op=True):
    """All-to-all on dim 0 of one tensor, evenly or by the given split sizes (the output first, as in Paddle 3)."""
    _no_partial("alltoall_single", in_tensor, out_tensor)
    g = groups.resolve(group)
    t_in, t_out = local(in_tensor), local(out_tensor)
    if t_in.dtype != t_out.dtype:
        raise ValueError(f"alltoall_single: out_tensor is {_dtype_name(t_out)}, in_tensor {_dtype_name(t_in)}; give "
                         f"both one dtype")
    for name, sizes, t in (("in_split_sizes", in_split_sizes, t_in), ("out_split_sizes", out_split_sizes, t_out)):
        if t.dim() == 0:
            raise ValueError("alltoall_single: a 0-d tensor has no dim 0 to split; give tensors of at least 1 dim")
        if sizes is not None:
            sizes = list(sizes)
            if len(sizes) != g.nranks or any(s < 0 for s in sizes) or sum(sizes) != t.shape[0]:
                raise ValueError(f"alltoall_single: {name}={sizes} must be {g.nranks} non-negative sizes "
                                 f"summing to dim 0 ({t.shape[0]})")
        elif t.shape[0] % g.nranks:
            raise ValueError(f"alltoall_single: dim 0 ({t.shape[0]}) is not divisible by the group size "
                             f"{g.nranks}; pass {name}")
    buf, back = _dense(t_out)
    src = t_in.clone() if _shares_memory(buf, t_in) else t_in.contiguous()  # in place: read before overwritten
    rows = t_out.shape[0]  # what this rank receives: the rows the others send it (their pieces may differ)
    if out_split_sizes is None:
        own = rows // g.nranks
    else:
        own = list(out_split_sizes)[g.rank] if g.rank >= 0 else 0
    got = (rows - own) * (tensor_bytes(t_out) // rows if rows else 0)
    sizes = [[t.shape[0] // g.nranks] * g.nranks if s is None else list(s) for s, t in
             ((in_split_sizes, t_in), (out_split_sizes, t_out))]
    agree = comm.counts_agree("alltoall_single", [k * (t_in[0].numel() if len(t_in) else 0) for k in sizes[0]],
                         [k * (t_out[0].numel() if len(t_out) else 0) for k in sizes[1]], "elements")
    return run(Call(CollectiveOp.ALLTOALL_SINGLE, g, lambda g: tdist.all_to_all_single(
        buf, src, None if out_split_sizes is None else list(out_split_sizes),
        None if in_split_sizes is None else list(in_split_sizes), group=g.process_group, async_op=True),
        tensors=(t_in,), sync_op=sync_op, then=back, recv_bytes=got), (*comm.CHECKS, agree))


# -- point to point -----------------------------------------------------------------------------

@needs_init
def send(tensor, dst=0, group=None, sync_op=True):
    """Send ``tensor`` to global rank ``dst`` (a CUDA tensor over gloo goes through a CPU copy)."""
    _no_partial("send", tensor)
    t = local(tensor)
    _check_not_self("send: dst", dst, sync_op)
    return run(Call(CollectiveOp.SEND, group, lambda g: tdist.isend(staged_send(t.contiguous(), g.process_group), dst,
                                                    group=g.process_group),
                    tensors=(t,), peers={"dst": dst}, sync_op=sync_op, peer=dst))


@needs_init
def recv(tensor, src=0, group=None, sync_op=True):
    """Receive into ``tensor`` from global rank ``src`` (over gloo, a CUDA tensor through a CPU buffer)."""
    _no_partial("recv", tensor)
    t = local(tensor)
    _check_not_self("recv: src", src, sync_op)
    copy_back = []
    dense, back = _dense(t)

    def start(g):
        buf, fin = staged_recv(dense, g.process_group)
        if fin is not None:
            copy_back.append(fin)
        return tdist.irecv(buf, src, group=g.process_group)

    return run(Call(CollectiveOp.RECV, group, start, tensors=(t,), peers={"src": src}, sync_op=sync_op, peer=src,
                    then=_then(lambda: [fin() for fin in copy_back], back)))


@needs_init
def isend(tensor, dst, group=None):
    return send(tensor, dst, group, sync_op=False)


@needs_init
def irecv(tensor, src=None, group=None):
    return recv(tensor, src, group, sync_op=False)


class P2POp:
    """One send or receive for ``batch_isend_irecv``: ``op`` is ``isend`` or ``irecv``, ``peer`` a global rank."""

    def __init__(self, op, tensor, peer, group=None):
        if op not in (isend, irecv, tdist.isend, tdist.irecv):
            raise ValueError("P2POp: op must be meshviz.distributed.isend or irecv")
        self.op = op
        self.tensor = tensor
        self.peer = peer
        self.group = group

    @property
    def is_send(self) -> bool:
        return self.op in (isend, tdist.isend)

    def __repr__(self) -> str:
        return f"P2POp({'isend' if self.is_send else 'irecv'}, peer={self.peer})"


@needs_init
def batch_isend_irecv(p2p_op_list):
    """Start a batch of sends/receives; returns their tasks (call ``wait()`` on each)."""
    if not p2p_op_list or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError("batch_isend_irecv: need a non-empty list of P2POp")
    _no_partial("batch_isend_irecv", [p.tensor for p in p2p_op_list])
    ops = []
    for p in p2p_op_list:
        g = groups.resolve(p.group)
        check_peer("peer", p.peer, g.ranks)
        t = local(p.tensor)
        ops.append((p, t if not p.is_send else t.contiguous(), g))
    if trace.active():
        for p, t, g in ops:
            kind = "send" if p.is_send else "recv"
            trace.emit(trace.Event(kind=kind, op=kind, group=list(g.ranks), peer=p.peer,
                                   bytes=0 if p.is_send else tensor_bytes(t),  # what this rank receives
                                   payload=(trace.Send if kind == "send" else trace.Recv)(batched=True)))
    works, staged = [], []
    for p, t, g in ops:  # over gloo, CUDA tensors go through CPU copies
        if p.is_send:
            staged.append((tdist.isend, staged_send(t, g.process_group), None))
        else:
            dense, back = _dense(t)
            buf, fin = staged_recv(dense, g.process_group)
            staged.append((tdist.irecv, buf, _then(fin, back)))
    run(Call(CollectiveOp.BATCH_ISEND_IRECV, groups.world_group(), lambda _: works.extend(tdist.batch_isend_irecv(
             [tdist.P2POp(fn, buf, p.peer, group=g.process_group) for (fn, buf, _), (p, _, g) in zip(staged, ops)])),
             tensors=[t for _, t, _ in ops], traced=False,
             peers=peer_names(p.peer for p, _, _ in ops)))
    return [Task([w], then=fin) for w, (_, _, fin) in zip(works, staged)]


@needs_init
def barrier(group=None):
    """Block until every member of ``group`` (default: the world) gets here; a non-member returns at once."""
    run(Call(CollectiveOp.BARRIER, group, lambda g: tdist.barrier(group=g.process_group), nbytes=0))
    return None


def wait(tensor, group=None, use_calc_stream=True):
    """Paddle's stream wait: make ``tensor`` safe to use; on CPU results are ready when a task's wait returns."""
    if torch.cuda.is_available() and isinstance(tensor, torch.Tensor) and tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()
