"""Paddle's collective API (groups, all_reduce, send/recv, ...) on torch.distributed, emitting events."""

from __future__ import annotations

import datetime
import itertools

import torch
import torch.distributed as tdist

from .. import trace
from .env import barrier as _env_barrier
from .env import init_parallel_env
from .groups import group_for_ranks

__all__ = [
    "ReduceOp", "Group", "new_group", "get_group", "get_backend",
    "all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "reduce",
    "scatter", "gather", "reduce_scatter", "alltoall", "alltoall_single",
    "send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv", "barrier", "wait",
]


class ReduceOp:
    """Paddle's reduce operations (same integer values as Paddle)."""

    SUM = 0
    MAX = 1
    MIN = 2
    PROD = 3
    AVG = 4

    _names = {0: "sum", 1: "max", 2: "min", 3: "prod", 4: "avg"}


_TORCH_OPS = {
    ReduceOp.SUM: tdist.ReduceOp.SUM,
    ReduceOp.MAX: tdist.ReduceOp.MAX,
    ReduceOp.MIN: tdist.ReduceOp.MIN,
    ReduceOp.PROD: tdist.ReduceOp.PRODUCT,
}


def _check_op(op) -> int:
    if isinstance(op, bool) or not isinstance(op, int) or op not in ReduceOp._names:
        raise ValueError(
            f"unknown reduce op {op!r}; use dist.ReduceOp.SUM, MAX, MIN, PROD or AVG")
    return int(op)


# -- groups -------------------------------------------------------------------------------------

class Group:
    """A communication group: ``ranks`` (global, sorted), ``rank`` (this process's index, -1 if absent)."""

    def __init__(self, rank: int, id: int, ranks, pg=None, name: str | None = None):
        self.rank = rank
        self.id = id
        self.ranks = list(ranks)
        self.nranks = len(self.ranks)
        self.process_group = pg
        self.name = name or f"_default_pg{id}"

    @property
    def world_size(self) -> int:
        return self.nranks

    @property
    def backend(self) -> str:
        return tdist.get_backend(self.process_group) if self.process_group is not None else "undefined"

    def is_member(self) -> bool:
        return self.rank >= 0

    def get_group_rank(self, rank: int) -> int:
        """Index of global ``rank`` in this group, -1 when it is not a member."""
        return self.ranks.index(rank) if rank in self.ranks else -1

    def get_global_rank(self, group_rank: int) -> int:
        if not 0 <= group_rank < self.nranks:
            raise ValueError(f"group rank {group_rank} outside 0..{self.nranks - 1} of {self}")
        return self.ranks[group_rank]

    def __repr__(self) -> str:
        return f"Group(id={self.id}, ranks={self.ranks}, rank={self.rank})"


_group_map: dict[int, Group] = {}
_ids = itertools.count(1)


def _world_group() -> Group:
    init_parallel_env()
    g = _group_map.get(0)
    world = tdist.get_world_size()
    if g is None or g.nranks != world or g.process_group is not tdist.group.WORLD:
        g = Group(tdist.get_rank(), 0, range(world), tdist.group.WORLD, name="_default_pg0")
        _group_map[0] = g
    return g


def new_group(ranks=None, backend=None, timeout=None) -> Group:
    """A group over ``ranks`` (sorted, like Paddle); every rank of the world must call it, in the same order."""
    init_parallel_env()
    world = tdist.get_world_size()
    ranks = list(range(world)) if ranks is None else [int(r) for r in ranks]
    if not ranks:
        raise ValueError("new_group: ranks must not be empty")
    dup = sorted({r for r in ranks if ranks.count(r) > 1})
    if dup:
        raise ValueError(f"new_group: duplicate ranks {dup} in {ranks}")
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ValueError(f"new_group: ranks {bad} are outside the world 0..{world - 1}")
    if backend not in (None, "gloo", "nccl", "bkcl", "xccl"):
        raise ValueError(f"new_group: unknown backend {backend!r}")
    ranks = sorted(ranks)
    if backend is None and timeout is None:
        pg = group_for_ranks(ranks)
    else:
        be = backend if backend in ("gloo", "nccl") else None
        to = None if timeout is None else (
            timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout))
        pg = tdist.new_group(ranks, timeout=to, backend=be)
        if pg is tdist.GroupMember.NON_GROUP_MEMBER:
            pg = None
    me = tdist.get_rank()
    gid = next(_ids)
    g = Group(ranks.index(me) if me in ranks else -1, gid, ranks, pg)
    _group_map[gid] = g
    return g


def get_group(id: int = 0) -> Group | None:
    if id == 0:
        return _world_group()
    return _group_map.get(id)


def get_backend(group=None) -> str:
    return tdist.get_backend(_resolve(group)[1]).upper()


def _resolve(group):
    """(ranks, torch process group or None for a non-member, is_member)."""
    if group is None:
        g = _world_group()
        return g.ranks, g.process_group, True
    if isinstance(group, Group):
        return group.ranks, group.process_group, group.is_member()
    if isinstance(group, tdist.ProcessGroup):
        return tdist.get_process_group_ranks(group), group, True
    raise TypeError(f"group must be a meshviz Group, a torch ProcessGroup or None, got {type(group).__name__}")


def _check_peer(what: str, rank, ranks) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ValueError(f"{what} must be an int global rank, got {rank!r}")
    if rank not in ranks:
        raise ValueError(f"{what}={rank} is not in the group {ranks} ({what} is a global rank, as in Paddle)")
    return rank


def _local(t):
    """The local torch tensor behind a tensor (a dist tensor's local block)."""
    if hasattr(t, "_local_value") and not type(t) is torch.Tensor:
        return t._local_value()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    return t


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _is_nccl(pg) -> bool:
    try:
        return tdist.get_backend(pg) == "nccl"
    except Exception:
        return False


def _divide_(t: torch.Tensor, n: int) -> None:
    if t.is_floating_point() or t.is_complex():
        t.div_(n)
    else:
        t.floor_divide_(n)


# -- tasks --------------------------------------------------------------------------------------

class Task:
    """What an ``sync_op=False`` call returns: ``wait()`` blocks until the result is in place."""

    def __init__(self, works=(), then=None):
        self._works = [w for w in works if w is not None]
        self._then = then
        self._done = False

    def wait(self, timeout=None) -> bool:
        if not self._done:
            for w in self._works:
                w.wait()
            if self._then is not None:
                self._then()
            self._done = True
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        if all(w.is_completed() for w in self._works):
            self.wait()
        return self._done

    def __repr__(self) -> str:
        return f"Task(done={self._done})"


def _finish(works, sync_op: bool, then=None) -> Task:
    if not isinstance(works, (list, tuple)):
        works = [works]
    task = Task(works, then)
    if sync_op:
        task.wait()
    return task


def _done() -> Task:
    t = Task()
    t._done = True
    return t


def _span(op, ranks, nbytes, **extra):
    return trace.span("collective", op=op, group=list(ranks), bytes=int(nbytes), extra=extra)


# -- collectives --------------------------------------------------------------------------------

def all_reduce(tensor, op=ReduceOp.SUM, group=None, sync_op=True):
    """Reduce ``tensor`` over the group in place; every member ends with the result."""
    op = _check_op(op)
    t = _local(tensor)
    ranks, pg, member = _resolve(group)
    if not member:
        return _done()
    with _span("all_reduce", ranks, _nbytes(t), reduce_op=ReduceOp._names[op]):
        if op == ReduceOp.AVG and not _is_nccl(pg):
            w = tdist.all_reduce(t, op=tdist.ReduceOp.SUM, group=pg, async_op=True)
            return _finish(w, sync_op, lambda: _divide_(t, len(ranks)))
        top = tdist.ReduceOp.AVG if op == ReduceOp.AVG else _TORCH_OPS[op]
        return _finish(tdist.all_reduce(t, op=top, group=pg, async_op=True), sync_op)


def reduce(tensor, dst=0, op=ReduceOp.SUM, group=None, sync_op=True):
    """Reduce ``tensor`` onto global rank ``dst`` (in place there; others' tensors are left as they are)."""
    op = _check_op(op)
    t = _local(tensor)
    ranks, pg, member = _resolve(group)
    _check_peer("dst", dst, ranks)
    if not member:
        return _done()
    with _span("reduce", ranks, _nbytes(t), reduce_op=ReduceOp._names[op], dst=dst):
        if op == ReduceOp.AVG:
            me = tdist.get_rank()
            if _is_nccl(pg):
                w = tdist.reduce(t, dst, op=tdist.ReduceOp.AVG, group=pg, async_op=True)
                return _finish(w, sync_op)
            # gloo's reduce scribbles on non-destination inputs; work on a copy there
            buf = t if me == dst else t.clone()
            w = tdist.reduce(buf, dst, op=tdist.ReduceOp.SUM, group=pg, async_op=True)
            return _finish(w, sync_op, (lambda: _divide_(t, len(ranks))) if me == dst else None)
        buf = t if tdist.get_rank() == dst else t.clone()
        return _finish(tdist.reduce(buf, dst, op=_TORCH_OPS[op], group=pg, async_op=True), sync_op)


def broadcast(tensor, src, group=None, sync_op=True):
    """Copy global rank ``src``'s ``tensor`` into every member's ``tensor``."""
    t = _local(tensor)
    ranks, pg, member = _resolve(group)
    _check_peer("src", src, ranks)
    if not member:
        return _done()
    with _span("broadcast", ranks, _nbytes(t), src=src):
        return _finish(tdist.broadcast(t, src, group=pg, async_op=True), sync_op)


def all_gather(tensor_list, tensor, group=None, sync_op=True):
    """Gather every member's ``tensor`` into ``tensor_list`` (filled in when empty, as in Paddle)."""
    t = _local(tensor)
    ranks, pg, member = _resolve(group)
    if not isinstance(tensor_list, list):
        raise TypeError("all_gather: tensor_list must be a list")
    if tensor_list and len(tensor_list) != len(ranks):
        raise ValueError(f"all_gather: tensor_list has {len(tensor_list)} tensors for a group of {len(ranks)}")
    if not member:
        return _done()
    if not tensor_list:
        tensor_list.extend(torch.empty_like(t) for _ in ranks)
    outs = [_local(o) for o in tensor_list]
    with _span("all_gather", ranks, _nbytes(t) * len(ranks)):
        return _finish(tdist.all_gather(outs, t.contiguous(), group=pg, async_op=True), sync_op)


def all_gather_object(object_list, obj, group=None):
    """Append every member's picklable ``obj`` to ``object_list``, in group order."""
    ranks, pg, member = _resolve(group)
    if not isinstance(object_list, list):
        raise TypeError("all_gather_object: object_list must be a list")
    if not member:
        return None
    out = [None] * len(ranks)
    with _span("all_gather_object", ranks, 0):
        tdist.all_gather_object(out, obj, group=pg)
    object_list.extend(out)
    return None


def broadcast_object_list(object_list, src=0, group=None):
    """Replace ``object_list``'s items with global rank ``src``'s."""
    ranks, pg, member = _resolve(group)
    _check_peer("src", src, ranks)
    if not member:
        return None
    with _span("broadcast_object_list", ranks, 0, src=src):
        tdist.broadcast_object_list(object_list, src=src, group=pg)
    return None


def scatter(tensor, tensor_list=None, src=0, group=None, sync_op=True):
    """Global rank ``src`` sends ``tensor_list[i]`` to the group's i-th member, received into ``tensor``."""
    t = _local(tensor)
    ranks, pg, member = _resolve(group)
    _check_peer("src", src, ranks)
    if not member:
        return _done()
    me = tdist.get_rank()
    lst = None
    if me == src:
        if tensor_list is None or len(tensor_list) != len(ranks):
            n = None if tensor_list is None else len(tensor_list)
            raise ValueError(f"scatter: src rank needs a tensor_list of {len(ranks)} tensors, got {n}")
        lst = [_local(x).contiguous() for x in tensor_list]
    with _span("scatter", ranks, _nbytes(t) * (len(ranks) if me == src else 1), src=src):
        return _finish(tdist.scatter(t, lst, src=src, group=pg, async_op=True), sync_op)


def gather(tensor, gather_list=None, dst=0, group=None, sync_op=True):
    """Collect every member's ``tensor`` into ``gather_list`` on global rank ``dst`` (filled in when empty)."""
    t = _local(tensor)
    ranks, pg, member = _resolve(group)
    _check_peer("dst", dst, ranks)
    if not member:
        return _done()
    me = tdist.get_rank()
    lst = None
    if me == dst:
        if gather_list is None:
            raise ValueError("gather: the dst rank needs a gather_list (a list, may be empty)")
        if not gather_list:
            gather_list.extend(torch.empty_like(t) for _ in ranks)
        if len(gather_list) != len(ranks):
            raise ValueError(f"gather: gather_list has {len(gather_list)} tensors for a group of {len(ranks)}")
        lst = [_local(x) for x in gather_list]
    with _span("gather", ranks, _nbytes(t), dst=dst):
        return _finish(tdist.gather(t.contiguous(), lst, dst=dst, group=pg, async_op=True), sync_op)


def reduce_scatter(tensor, tensor_list, op=ReduceOp.SUM, group=None, sync_op=True):
    """Reduce ``tensor_list`` elementwise over the group; the i-th member gets the i-th reduced tensor."""
    op = _check_op(op)
    t = _local(tensor)
    ranks, pg, member = _resolve(group)
    if tensor_list is None or len(tensor_list) != len(ranks):
        n = None if tensor_list is None else len(tensor_list)
        raise ValueError(f"reduce_scatter: tensor_list needs {len(ranks)} tensors, got {n}")
    if not member:
        return _done()
    ins = [_local(x).contiguous() for x in tensor_list]
    with _span("reduce_scatter", ranks, _nbytes(*ins), reduce_op=ReduceOp._names[op]):
        if op == ReduceOp.AVG and not _is_nccl(pg):
            w = tdist.reduce_scatter(t, ins, op=tdist.ReduceOp.SUM, group=pg, async_op=True)
            return _finish(w, sync_op, lambda: _divide_(t, len(ranks)))
        top = tdist.ReduceOp.AVG if op == ReduceOp.AVG else _TORCH_OPS[op]
        return _finish(tdist.reduce_scatter(t, ins, op=top, group=pg, async_op=True), sync_op)


def alltoall(in_tensor_list, out_tensor_list, group=None, sync_op=True):
    """Member i sends ``in_tensor_list[j]`` to member j, which receives it as ``out_tensor_list[i]``."""
    ranks, pg, member = _resolve(group)
    if in_tensor_list is None or len(in_tensor_list) != len(ranks):
        n = None if in_tensor_list is None else len(in_tensor_list)
        raise ValueError(f"alltoall: in_tensor_list needs {len(ranks)} tensors, got {n}")
    if not isinstance(out_tensor_list, list):
        raise TypeError("alltoall: out_tensor_list must be a list")
    if out_tensor_list and len(out_tensor_list) != len(ranks):
        raise ValueError(f"alltoall: out_tensor_list has {len(out_tensor_list)} tensors, need {len(ranks)}")
    if not member:
        return _done()
    ins = [_local(x).contiguous() for x in in_tensor_list]
    if not out_tensor_list:
        out_tensor_list.extend(torch.empty_like(x) for x in ins)
    outs = [_local(x) for x in out_tensor_list]
    with _span("alltoall", ranks, _nbytes(*ins)):
        return _finish(tdist.all_to_all(outs, ins, group=pg, async_op=True), sync_op)


def alltoall_single(in_tensor, out_tensor, in_split_sizes=None, out_split_sizes=None, group=None,
                    sync_op=True):
    """All-to-all on dim 0 of one tensor, evenly or by the given split sizes."""
    ranks, pg, member = _resolve(group)
    t_in, t_out = _local(in_tensor), _local(out_tensor)
    for name, sizes, t in (("in_split_sizes", in_split_sizes, t_in), ("out_split_sizes", out_split_sizes, t_out)):
        if sizes is not None:
            sizes = list(sizes)
            if len(sizes) != len(ranks) or any(s < 0 for s in sizes) or sum(sizes) != t.shape[0]:
                raise ValueError(f"alltoall_single: {name}={sizes} must be {len(ranks)} non-negative sizes "
                                 f"summing to dim 0 ({t.shape[0]})")
        elif t.shape[0] % len(ranks):
            raise ValueError(f"alltoall_single: dim 0 ({t.shape[0]}) is not divisible by the group size "
                             f"{len(ranks)}; pass {name}")
    if not member:
        return _done()
    with _span("alltoall_single", ranks, _nbytes(t_in)):
        w = tdist.all_to_all_single(
            t_out, t_in.contiguous(),
            None if out_split_sizes is None else list(out_split_sizes),
            None if in_split_sizes is None else list(in_split_sizes),
            group=pg, async_op=True)
        return _finish(w, sync_op)


# -- point to point -----------------------------------------------------------------------------

def send(tensor, dst=0, group=None, sync_op=True):
    """Send ``tensor`` to global rank ``dst``."""
    t = _local(tensor)
    ranks, pg, member = _resolve(group)
    _check_peer("dst", dst, ranks)
    if not member:
        return _done()
    with trace.span("send", op="send", group=list(ranks), peer=dst, bytes=_nbytes(t)):
        return _finish(tdist.isend(t.contiguous(), dst, group=pg), sync_op)


def recv(tensor, src=0, group=None, sync_op=True):
    """Receive into ``tensor`` from global rank ``src``."""
    t = _local(tensor)
    ranks, pg, member = _resolve(group)
    _check_peer("src", src, ranks)
    if not member:
        return _done()
    with trace.span("recv", op="recv", group=list(ranks), peer=src, bytes=_nbytes(t)):
        return _finish(tdist.irecv(t, src, group=pg), sync_op)


def isend(tensor, dst, group=None):
    return send(tensor, dst, group, sync_op=False)


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


def batch_isend_irecv(p2p_op_list):
    """Start a batch of sends/receives; returns their tasks (call ``wait()`` on each)."""
    if not p2p_op_list or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError("batch_isend_irecv: need a non-empty list of P2POp")
    ops = []
    for p in p2p_op_list:
        ranks, pg, member = _resolve(p.group)
        _check_peer("peer", p.peer, ranks)
        t = _local(p.tensor)
        ops.append((p, t, ranks, pg))
    for p, t, ranks, pg in ops:
        if trace.active():
            kind = "send" if p.is_send else "recv"
            trace.emit(trace.Event(kind=kind, op=kind, group=list(ranks), peer=p.peer, bytes=_nbytes(t),
                                   extra={"batched": True}))
    works = tdist.batch_isend_irecv(
        [tdist.P2POp(tdist.isend if p.is_send else tdist.irecv, t if not p.is_send else t.contiguous(),
                     p.peer, group=pg) for p, t, ranks, pg in ops])
    return [Task([w]) for w in works]


def barrier(group=None):
    """Block until every member of ``group`` (default: the world) gets here; a non-member returns at once."""
    if isinstance(group, Group) and not group.is_member():
        return None
    return _env_barrier(group)


def wait(tensor, group=None, use_calc_stream=True):
    """Paddle's stream wait: make ``tensor`` safe to use; on CPU results are ready when a task's wait returns."""
    if torch.cuda.is_available() and isinstance(tensor, torch.Tensor) and tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()
