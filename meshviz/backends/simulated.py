"""The ``"simulated"`` c10d backend: process groups whose calls finish at once and move nothing."""

from __future__ import annotations

import inspect
import io
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from .. import compat, rank_context
from .meetings import _InProcessGroup, _Work

__all__ = ["BACKEND", "SimulatedGroup", "register", "watch_reads", "install_object_collectives",
           "uninstall_object_collectives"]

BACKEND = "simulated"  # the c10d backend name: tdist.get_backend() on a simulated rank


@dataclass
class SimulatedState:
    on_read: Callable | None = None  # called with the caller's frame whenever this rank's groups are asked its rank


SIMULATED = rank_context.slot("simulated_backend", SimulatedState)


def watch_reads(callback: Callable | None) -> None:
    """From now on (None: no longer), ``callback(frame)`` runs whenever code on the calling rank asks one of its
    groups for its rank (``torch.distributed.get_rank()`` and everything built on it); ``frame`` is the caller's."""
    SIMULATED.get().on_read = callback


def _values(t):
    """The values ``t`` holds, where it holds any (a real tensor, or a storage-less one that carries small known
    values); None for a tensor of shapes only."""
    return compat.known_values(t) if isinstance(t, torch.Tensor) else None


def _mirror(t, k: int, rop) -> None:
    """``t`` after a reduction over ``k`` ranks that all held what this rank holds."""
    v = _values(t)
    if v is None:
        return
    op = getattr(rop, "op", rop)
    R = tdist.ReduceOp
    with torch.no_grad(), compat.no_dispatch_modes():
        if op == R.SUM:
            v.mul_(k)
        elif op == R.PRODUCT:
            v.pow_(k)
        elif op == R.BXOR:
            v.zero_() if k % 2 == 0 else None


def _put(dst, src) -> None:
    d, s = _values(dst), _values(src)
    if d is not None and s is not None:
        with torch.no_grad(), compat.no_dispatch_modes():
            d.copy_(s.reshape(d.shape) if s.numel() == d.numel() else s.reshape(-1)[: d.numel()].reshape(d.shape))


class SimulatedGroup(_InProcessGroup):
    """One simulated rank's handle on a group. Every call returns a finished work at once and sends nothing: the
    rank's peers are not running. A tensor with values (a real one, or a small one a simulated rank keeps values
    for) ends as if every peer had held what this rank holds: a SUM all-reduce multiplies it by the group size,
    an all-gather repeats this rank's block, a broadcast leaves it as it is. Tensors of shapes only are left alone."""

    BACKEND = BACKEND
    LABEL = "SimulatedGroup"

    def rank(self) -> int:
        cb = SIMULATED.get().on_read
        if cb is not None:
            cb(sys._getframe(1))
        return self._group_rank

    # -- collectives -----------------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        rop = opts.reduceOp if opts is not None else tdist.ReduceOp.SUM
        for t in tensors:
            _mirror(t, self._size, rop)
        return _Work(tensors)

    allreduce_coalesced = allreduce

    def broadcast(self, tensors, opts=None):
        return _Work(tensors)

    def reduce(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        if root == self._group_rank:
            return self.allreduce(tensors, opts)
        return _Work(tensors)

    def allgather(self, outputs, inputs, opts=None):
        for outs, t in zip(outputs, inputs):
            for o in outs:
                _put(o, t)
        return _Work([t for o in outputs for t in o])

    allgather_coalesced = allgather

    def _allgather_base(self, output, input, opts=None):
        if _values(output) is not None:
            for piece in output.reshape(self._size, -1):
                _put(piece, input)
        return _Work([output])

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self._allgather_base(o, i)
        return _Work(outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def gather(self, outputs, inputs, opts=None):
        if outputs and outputs[0]:
            for o in outputs[0]:
                _put(o, inputs[0])
        return _Work([t for o in outputs for t in o])

    def scatter(self, outputs, inputs, opts=None):
        if inputs and inputs[0]:
            _put(outputs[0], inputs[0][self._group_rank])
        return _Work(outputs)

    def reduce_scatter(self, outputs, inputs, opts=None):
        rop = opts.reduceOp if opts is not None else tdist.ReduceOp.SUM
        for o, ins in zip(outputs, inputs):
            _put(o, ins[self._group_rank])
            _mirror(o, self._size, rop)
        return _Work(outputs)

    def _reduce_scatter_base(self, output, input, opts=None):
        rop = opts.reduceOp if opts is not None else tdist.ReduceOp.SUM
        if _values(input) is not None:
            _put(output, input.reshape(self._size, -1)[self._group_rank])
            _mirror(output, self._size, rop)
        return _Work([output])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self._reduce_scatter_base(o, i, opts)
        return _Work(outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall(self, outputs, inputs, opts=None):
        for o in outputs:
            _put(o, inputs[self._group_rank])
        return _Work(outputs)

    def alltoall_base(self, output, input, output_split_sizes=None, input_split_sizes=None, opts=None):
        if _values(output) is not None and _values(input) is not None and not output_split_sizes:
            mine = input.reshape(self._size, -1)[self._group_rank]
            for piece in output.reshape(self._size, -1):
                _put(piece, mine)
        return _Work([output])

    all_to_all_single = alltoall_base

    def barrier(self, opts=None):
        return _Work()

    # -- point to point: the peer is not running, so a receive keeps what its buffer held ----------------------
    def send(self, tensors, dst: int, tag: int = 0):
        return _Work(tensors)

    def recv(self, tensors, src: int, tag: int = 0):
        return _Work(tensors)

    def recv_anysource(self, tensors, tag: int = 0):
        return _Work(tensors)


def _create_group(opts, backend_options=None) -> SimulatedGroup:
    ranks = [int(r) for r in (opts.global_ranks_in_group or range(opts.group_size))]
    return SimulatedGroup(opts.group_rank, opts.group_size, opts.group_id, ranks)


def register() -> None:
    """Make ``"simulated"`` a c10d backend (once per process)."""
    if BACKEND.upper() not in compat.backend_plugins():
        tdist.Backend.register_backend(BACKEND, _create_group, extended_api=True, devices=["cpu"])


# -- object collectives: pickled objects, which a simulated rank keeps as objects ----------------------------------
# torch pickles an object into a byte tensor through a storage made from a buffer, which a fake tensor mode makes on
# the meta device (it raises). On a simulated rank they move no tensors: a rank receives what every peer would send
# were it this rank (all_gather_object, gather_object), else what a rank simulated before it in the same run sent it
# (send_object_list, broadcast_object_list, scatter_object_list), else it keeps what its list held; a receive
# (recv_object_list) with nothing sent raises. Their events are the comm layer's, of 0 bytes on every rank, as for
# real.

_OBJECT_CALLS = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                 "send_object_list", "recv_object_list")
_real_calls: dict = {}
_mail: dict = {}  # (kind, src, dst) -> the objects src sent dst, in order
_read: dict = {}  # (kind, src, dst) -> how many of them dst received


def _own(group) -> bool:
    try:
        return tdist.is_initialized() and tdist.get_backend(group) == BACKEND
    except (RuntimeError, ValueError):
        return False


class _Pickler(pickle.Pickler):
    """Pickles everything but tensors, which it keeps (a fake tensor pickled reads storage it does not have)."""

    def __init__(self, buf, kept: list):
        super().__init__(buf)
        self.kept = kept

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            self.kept.append(obj)
            return len(self.kept) - 1
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, buf, kept: list):
        super().__init__(buf)
        self.kept = kept

    def persistent_load(self, pid):
        return self.kept[pid]


def _copy(obj):
    """``obj`` as a receiver unpickles it: a copy, its tensors the sender's own (the object itself where it does not
    pickle)."""
    kept: list = []
    buf = io.BytesIO()
    try:
        _Pickler(buf, kept).dump(obj)
        buf.seek(0)
        return _Unpickler(buf, kept).load()
    except Exception:
        return obj


def _ranks(group) -> list[int]:
    return list(range(tdist.get_world_size())) if group is None else tdist.get_process_group_ranks(group)


def _global(group, a: dict, name: str) -> int:
    """The global rank of ``a[name]``, or of its group-local twin ``a["group_" + name]``."""
    if a.get(name) is not None:
        return int(a[name])
    local = a.get("group_" + name)
    return _ranks(a.get("group"))[int(local or 0)]


def _post(kind: str, src: int, dst, objects) -> None:
    _mail.setdefault((kind, src, dst), []).append([_copy(o) for o in objects])


def _take(kind: str, src, dst):
    """The next objects ``src`` (None: any) sent ``dst`` in this run, with the sender; None where none was sent."""
    senders = [s for (k, s, d) in _mail if k == kind and d == dst] if src is None else [src]
    for s in senders:
        sent = _mail.get((kind, s, dst))
        n = _read.get((kind, s, dst), 0)
        if sent is not None and n < len(sent):
            _read[(kind, s, dst)] = n + 1
            return s, sent[n]
    return None


def _fill(object_list: list, got) -> None:
    if got is not None:
        for i, o in enumerate(got[1][: len(object_list)]):
            object_list[i] = _copy(o)


def _simulated_call(name: str, a: dict):
    me, group = tdist.get_rank(), a.get("group")
    if name == "all_gather_object":
        for i in range(len(_ranks(group))):
            a["object_list"][i] = _copy(a["obj"])
    elif name == "gather_object":
        if _global(group, a, "dst") == me:
            for i in range(len(_ranks(group))):
                a["object_gather_list"][i] = _copy(a["obj"])
    elif name == "broadcast_object_list":
        src = _global(group, a, "src")
        if src == me:
            for r in _ranks(group):
                _post("bcast", me, r, a["object_list"])
        else:
            _fill(a["object_list"], _take("bcast", src, me))
    elif name == "scatter_object_list":
        src, out = _global(group, a, "src"), a["scatter_object_output_list"]
        if src == me:
            ins = a["scatter_object_input_list"]
            for r, o in zip(_ranks(group), ins):
                _post("scatter", me, r, [o])
            out[0] = _copy(ins[_ranks(group).index(me)])
        else:
            _fill(out, _take("scatter", src, me))
    elif name == "send_object_list":
        _post("p2p", me, _global(group, a, "dst"), a["object_list"])
    elif name == "recv_object_list":
        src = None if a.get("src") is None and a.get("group_src") is None else _global(group, a, "src")
        got = _take("p2p", src, me)
        if got is None:  # a real rank would wait for it: its peers run after it here, or never send it
            raise RuntimeError(f"what_if: rank {me} receives objects (recv_object_list) from "
                               f"{'any rank' if src is None else f'rank {src}'}, which sent it none: a simulated "
                               f"rank receives objects only from the ranks simulated before it")
        _fill(a["object_list"], got)
        return got[0]
    return None


def _wrap(name: str, real: Callable) -> Callable:
    sig = inspect.signature(real)

    def call(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        if not _own(bound.arguments.get("group")):
            return real(*args, **kwargs)
        return _simulated_call(name, bound.arguments)

    call.__wrapped__ = real  # type: ignore[attr-defined]
    return call


def install_object_collectives() -> None:
    """torch's object collectives (``all_gather_object`` ...) as above on simulated ranks, unchanged on every other;
    a fresh mailbox. Undo with :func:`uninstall_object_collectives`."""
    _mail.clear()
    _read.clear()
    if _real_calls:
        return
    c10d = tdist.distributed_c10d
    for name in _OBJECT_CALLS:
        real = getattr(c10d, name)
        _real_calls[name] = (real, getattr(tdist, name, None))
        fake = _wrap(name, real)
        setattr(c10d, name, fake)
        setattr(tdist, name, fake)


def uninstall_object_collectives() -> None:
    c10d = tdist.distributed_c10d
    for name, (real, top) in _real_calls.items():
        setattr(c10d, name, real)
        if top is not None:
            setattr(tdist, name, top)
    _real_calls.clear()
    _mail.clear()
    _read.clear()
