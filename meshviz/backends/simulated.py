"""The ``"simulated"`` c10d backend: process groups whose calls finish at once and move nothing."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from .. import compat, rank_context
from .meetings import _InProcessGroup, _Work

__all__ = ["BACKEND", "SimulatedGroup", "register", "watch_reads"]

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
