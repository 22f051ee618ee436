"""The ``"threads"`` c10d backend: process groups whose ranks are threads of one process, meeting in memory."""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as tdist

from .. import compat, rank_context
from ..compat.dynamo import eager_methods
from .meetings import _InProcessGroup, _Meeting, _pieces, _put, _Recv, _reduce, _splits, _Work

__all__ = ["BACKEND", "Scheduler", "ThreadComms", "ThreadGroup", "RankStopped", "observers", "watch_calls", "join",
           "register"]

BACKEND = "threads"  # the c10d backend name: tdist.get_backend() on a rank thread


@dataclass
class ThreadsState:
    comms: ThreadComms | None = None  # where this rank thread's groups are made
    observers: list = field(default_factory=list)  # callbacks(c10d op, tensors) that see this rank's calls
    calls: Callable | None = None  # calls(op, ranks, tensors): a context manager around each call's wait


THREADS = rank_context.slot("threads", ThreadsState)


def _state() -> ThreadsState:
    return THREADS.get()

# the c10d op a gloo group dispatches for each call (Python dispatch modes see those; a thread group's calls do
# not pass the dispatcher, so they are shown to the observers under the same op)
_C10D_OPS = {
    "all_reduce": "allreduce_", "all_reduce_coalesced": "allreduce_coalesced_", "broadcast": "broadcast_",
    "reduce": "reduce_", "all_gather": "allgather_", "all_gather_coalesced": "allgather_coalesced_",
    "all_gather_single": "_allgather_base_", "all_gather_single_coalesced": "allgather_into_tensor_coalesced_",
    "gather": "gather_", "scatter": "scatter_", "reduce_scatter": "reduce_scatter_",
    "reduce_scatter_single": "_reduce_scatter_base_",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced_", "all_to_all": "alltoall_",
    "all_to_all_single": "alltoall_base_", "barrier": "barrier", "send": "send", "recv": "recv_",
    "recv_any": "recv_any_source_",
}
_SHAPED = frozenset({"all_reduce", "all_reduce_coalesced", "broadcast", "reduce"})  # members' shapes must match too


def observers() -> list:
    """This rank's observers: ``callback(op, tensors)`` is called for each of its calls on a thread group, with
    the c10d op a gloo group would have dispatched (``torch.ops.c10d.allreduce_.default``, ...)."""
    return _state().observers


def watch_calls(calls: Callable | None) -> None:
    """The calling rank's collectives and receives run inside ``calls(op, ranks, tensors)`` (a context manager;
    ``op`` as torch.distributed names it, ``ranks`` the global ranks it waits on): what the rank waits in is known
    while it waits, whoever called it. None: no longer."""
    _state().calls = calls


def _show(op: str, tensors) -> None:
    obs = _state().observers
    if obs:
        func = getattr(torch.ops.c10d, _C10D_OPS[op]).default
        for cb in list(obs):
            cb(func, list(tensors))


class RankStopped(RuntimeError):
    """A rank thread was stopped while it waited: a peer failed, the group was aborted or interrupted, the wait
    timed out, or every rank was waiting for another (a deadlock, named at once). ``own``: the rank's own wait
    failed (a timeout or a deadlock), as a collective that times out fails on a rank process."""

    def __init__(self, message: str, own: bool = False):
        super().__init__(message)
        self.own = own


class Scheduler(Protocol):
    """What the thread groups need from whatever runs the rank threads. ``lock`` guards the scheduler's state
    and the comms' alike; the groups call ``check``, ``block`` and ``wake`` holding it."""

    lock: threading.Lock

    def check(self, rank: int) -> None:
        """Raise if ``rank`` may not start a call now (it was interrupted)."""

    def block(self, rank: int, what: str) -> None:
        """``rank`` waits for ``what``: other ranks run until :meth:`wake` is called for it. Raises what stopped
        the wait instead (:class:`RankStopped` for a timeout, a deadlock or an abort; KeyboardInterrupt)."""

    def wake(self, rank: int) -> None:
        """``rank``'s wait is over (a peer arrived, filled its receive, or failed): it may run again."""


class ThreadComms:
    """What every thread group of one world shares: meetings in progress, mailboxes of sends nobody received yet,
    receives posted before their send, the ranks failed this round; the scheduler calls :meth:`reset` between rounds."""

    def __init__(self, scheduler: Scheduler, mismatch: Callable):
        self.sched = scheduler
        # (group, op, calls) -> what each member raises where they called one collective differently (the
        # runtime's CollectiveMismatch; ``calls``: rank -> (reduce op, root, shapes, dtypes, what must agree))
        self.mismatch = mismatch
        self.meetings: dict = {}
        self.mail: dict = collections.defaultdict(collections.deque)
        self.posted: dict = collections.defaultdict(collections.deque)
        self.groups: "weakref.WeakSet[ThreadGroup]" = weakref.WeakSet()
        self.failed: dict[int, str] = {}  # rank -> what it raised, this round, in the order they failed
        self.aborted: str | None = None
        self.dirty = False  # meetings were left half done: reset() before the next job

    def reset(self) -> None:
        """Fresh meetings, mailboxes and call numbers on every group (call with the scheduler's lock)."""
        self.meetings.clear()
        self.mail.clear()
        self.posted.clear()
        for g in list(self.groups):
            g.seq = 0
        self.aborted = None
        self.dirty = False

    def gone(self, ranks) -> str | None:
        """Why one of ``ranks`` will never come (it failed this round, or the world was aborted), or None."""
        if self.aborted is not None:
            return self.aborted
        for r in ranks:
            if r in self.failed:
                return f"rank {r} failed ({self.failed[r]})"
        return None

    def check(self, rank: int) -> None:
        caller = rank_context.current().rank
        if caller != rank:  # the scheduler would take the caller for ``rank``: a wait it never ends
            raise RuntimeError(f"rank {caller} called a collective on rank {rank}'s process group: a group belongs "
                               "to the rank thread that made it (was it kept where every rank reads it, such as a "
                               "module-level name?)")
        self.sched.check(rank)
        if self.aborted is not None:
            raise RankStopped(self.aborted)

    def fail_meeting(self, key, m: _Meeting, err: BaseException) -> None:
        self.meetings.pop(key, None)
        m.error = err
        self.dirty = True
        for r, h in zip(m.ranks, m.here):
            if h:
                self.sched.wake(r)

    def rank_failed(self, rank: int, summary: str) -> None:
        """``rank`` raised ``summary``: every meeting and receive waiting for it fails at once (call with the
        scheduler's lock)."""
        self.failed[rank] = summary
        why = f"rank {rank} failed ({summary})"
        for key, m in list(self.meetings.items()):
            if rank in m.ranks and not m.here[m.ranks.index(rank)]:
                self.fail_meeting(key, m, RankStopped(f"{why}; it will not join {m.what}"))
        for key, posted in self.posted.items():
            name, src, dst, tag = key
            for rv in list(posted):
                g = next((g for g in self.groups if g._name == name and g.me == rv.rank), None)
                if g is not None and src is not None and g.ranks[src] == rank:
                    rv.error = RankStopped(f"{why}; {rv.what} will never be filled")
                    posted.remove(rv)
                    self.dirty = True
                    self.sched.wake(rv.rank)

    def tear_down(self, why: str) -> None:
        """Every call fails with ``why`` until :meth:`reset` (call with the scheduler's lock)."""
        self.aborted = why
        self.dirty = True


def _mismatch(m: _Meeting, group: list[int], make: Callable) -> BaseException:
    """The error a member of meeting ``m`` raises: its members called the same collective differently."""
    calls = {r: (str(getattr(getattr(rop, "op", rop), "name", rop)).lower(), None if root is None else group[root],
                 [tuple(t.shape) for t in ts], [str(t.dtype).removeprefix("torch.") for t in ts], (key, rop, root))
             for r, (_, (key, rop, root), ts, _) in zip(m.ranks, m.data)}
    return make(group, m.data[0][3], calls)


# -- the process group -------------------------------------------------------------------------------------------

@eager_methods  # run eagerly under torch.compile
class ThreadGroup(_InProcessGroup):
    """One rank's handle on one group of a :class:`ThreadComms` (torch creates one per rank per group, as for
    gloo). Collectives meet by (group name, call number): every member must make the same calls in the same
    order, as with any backend; a mismatch is an error on every member. Sends are buffered and never block;
    receives wait (handing the baton on) until a matching send."""

    BACKEND = BACKEND
    LABEL = "ThreadGroup"

    def __init__(self, comms: "ThreadComms", group_rank: int, size: int, name: str, ranks: list[int]):
        super().__init__(group_rank, size, name, ranks)
        self.comms = comms
        self.seq = 0
        comms.groups.add(self)

    # -- the meeting -----------------------------------------------------------------------------------------
    def _meet(self, op: str, data, work: Callable[[list], None], result=(), shown=None, rop=None, root=None) -> _Work:
        """Meet the other members in call ``op``: unless every member's ``shown`` tensors (default: ``result``) have
        the same dtypes (and shapes, where reduced or broadcast), reduce op and root, each raises CollectiveMismatch."""
        shown = result if shown is None else shown
        sig = (tuple([(t.dtype, t.shape) for t in shown] if op in _SHAPED else [t.dtype for t in shown]), rop, root)
        calls = _state().calls
        name = op.replace("gather_single", "gather_into_tensor").replace("scatter_single", "scatter_tensor")  # torch's
        with contextlib.nullcontext() if calls is None else calls(name, tuple(self.ranks), list(result)):
            return self._meet_now(op, (data, sig, shown, name), work, result)

    def _meet_now(self, op: str, brought, work: Callable[[list], None], result=()) -> _Work:
        c = self.comms
        with c.sched.lock:
            c.check(self.me)
            seq = self.seq
            self.seq += 1
            key = (self._name, seq)
            what = f"{op} #{seq + 1} on ranks {self.ranks}"
            m = c.meetings.get(key)
            if m is None:
                m = c.meetings[key] = _Meeting(op, self.ranks, what)
            elif m.op != op:
                other = m.ranks[m.here.index(True)]
                err = RankStopped(f"collective mismatch on ranks {self.ranks} (call #{seq + 1}): rank {self.me} called "
                                  f"{op}, rank {other} called {m.op}")
                c.fail_meeting(key, m, err)
                raise err
            m.data[self._group_rank] = brought  # (its data, what every member's must share, its tensors, torch's op)
            m.here[self._group_rank] = True
            m.arrived += 1
            gone = c.gone(m.ranks)
            err = RankStopped(f"{gone}; it will not join {what}") if gone is not None else None
            if err is None and m.arrived == len(m.ranks) and any(b[1] != brought[1] for b in m.data):
                m.differ = True  # the same call, made differently: before any data moves
                err = _mismatch(m, self.ranks, c.mismatch)
            if err is not None:
                c.fail_meeting(key, m, err)
                raise err
            if m.arrived == len(m.ranks):
                del c.meetings[key]
                try:
                    with torch.no_grad(), compat.no_dispatch_modes():
                        work([b[0] for b in m.data])
                except Exception as e:
                    m.error = e
                m.done = True
                for r in m.ranks:
                    if r != self.me:
                        c.sched.wake(r)
                if m.error is not None:
                    raise RuntimeError(f"{what} failed: {m.error}") from m.error
                _show(op, result)
                return _Work(result)
            c.sched.block(self.me, f"{what} (waiting for rank{'s' if len(m.ranks) - m.arrived > 1 else ''} "
                              f"{', '.join(str(r) for r, h in zip(m.ranks, m.here) if not h)})")
            if isinstance(m.error, RankStopped):  # one object per rank: its traceback is this rank's alone
                raise RankStopped(str(m.error), m.error.own)
            if m.differ:  # made on this rank: its own roll-call record numbers the collective
                raise _mismatch(m, self.ranks, c.mismatch)
            if m.error is not None:
                raise RuntimeError(f"{what} failed: {m.error}")
        _show(op, result)
        return _Work(result)

    # -- collectives -----------------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None, op: str = "all_reduce"):
        rop = opts.reduceOp if opts is not None else tdist.ReduceOp.SUM

        def work(data):
            for i in range(len(data[0])):
                acc = _reduce([d[i] for d in data], rop)
                for d in data:
                    _put(d[i], acc)

        return self._meet(op, list(tensors), work, tensors, rop=rop)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts, "all_reduce_coalesced")

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0

        def work(data):
            for i, src in enumerate(data[root]):
                for r, d in enumerate(data):
                    if r != root:
                        _put(d[i], src)

        return self._meet("broadcast", list(tensors), work, tensors, root=root)

    def reduce(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        rop = opts.reduceOp if opts is not None else tdist.ReduceOp.SUM

        def work(data):
            for i in range(len(data[0])):
                _put(data[root][i], _reduce([d[i] for d in data], rop))

        return self._meet("reduce", list(tensors), work, tensors, rop=rop, root=root)

    def allgather(self, outputs, inputs, opts=None, op: str = "all_gather"):
        def work(data):
            for outs, _ in data:
                for j in range(len(outs)):
                    for src, (_, ins) in enumerate(data):
                        _put(outs[j][src], ins[j])

        return self._meet(op, (outputs, inputs), work, [t for o in outputs for t in o], inputs)

    def allgather_coalesced(self, outputs, inputs, opts=None):
        return self.allgather(outputs, inputs, opts, "all_gather_coalesced")

    def all_gather_single_coalesced(self, outputs, inputs, opts=None, op: str = "all_gather_single_coalesced"):
        def work(data):
            for j in range(len(data[0][0])):
                cat = torch.cat([ins[j].reshape(-1) for _, ins in data])
                for outs, _ in data:
                    _put(outs[j], cat.reshape(outs[j].shape))

        return self._meet(op, (outputs, inputs), work, outputs, inputs)

    def all_gather_single(self, output, input, opts=None):
        return self.all_gather_single_coalesced([output], [input], opts, "all_gather_single")

    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, outputs, inputs, opts=None):
        root = opts.rootRank if opts is not None else 0

        def work(data):
            outs = data[root][0][0]
            for src, (_, ins) in enumerate(data):
                _put(outs[src], ins[0])

        return self._meet("gather", (outputs, inputs), work, [t for o in outputs for t in o], inputs, root=root)

    def scatter(self, outputs, inputs, opts=None):
        root = opts.rootRank if opts is not None else 0

        def work(data):
            pieces = data[root][1][0]
            for r, (outs, _) in enumerate(data):
                _put(outs[0], pieces[r])

        return self._meet("scatter", (outputs, inputs), work, outputs, root=root)

    def reduce_scatter(self, outputs, inputs, opts=None):
        rop = opts.reduceOp if opts is not None else tdist.ReduceOp.SUM

        def work(data):
            for j in range(len(data[0][0])):
                for r, (outs, _) in enumerate(data):
                    _put(outs[j], _reduce([ins[j][r] for _, ins in data], rop))

        return self._meet("reduce_scatter", (outputs, inputs), work, outputs, rop=rop)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None, op: str = "reduce_scatter_single_coalesced"):
        rop = opts.reduceOp if opts is not None else tdist.ReduceOp.SUM
        n = self._size

        def work(data):
            for j in range(len(data[0][0])):
                total = _reduce([ins[j].reshape(n, -1) for _, ins in data], rop)
                for r, (outs, _) in enumerate(data):
                    _put(outs[j], total[r].reshape(outs[j].shape))

        return self._meet(op, (outputs, inputs), work, outputs, inputs, rop=rop)

    def reduce_scatter_single(self, output, input, opts=None):
        return self.reduce_scatter_single_coalesced([output], [input], opts, "reduce_scatter_single")

    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, outputs, inputs, opts=None):
        def work(data):
            for dst, (outs, _) in enumerate(data):
                for src, (_, ins) in enumerate(data):
                    _put(outs[src], ins[dst])

        return self._meet("all_to_all", (outputs, inputs), work, outputs, inputs)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, opts=None):
        n = self._size

        def work(data):
            ins = [_pieces(i, _splits(i, isz, n)) for _, i, _, isz in data]
            for dst, (out, _, osz, _) in enumerate(data):
                outs = _pieces(out, _splits(out, osz, n))
                for src in range(n):
                    _put(outs[src], ins[src][dst])

        return self._meet("all_to_all_single", (output, input, output_split_sizes, input_split_sizes), work, [output],
                          [input])

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        return self._meet("barrier", True, lambda data: None)

    # -- point to point --------------------------------------------------------------------------------------
    def send(self, tensors, dst: int, tag: int = 0):
        c = self.comms
        with compat.no_dispatch_modes():
            data = tensors[0].detach().clone()
        with c.sched.lock:
            c.check(self.me)
            if not 0 <= dst < self._size:
                raise ValueError(f"send: group rank {dst} outside 0..{self._size - 1} of ranks {self.ranks}")
            for key in ((self._name, self._group_rank, dst, tag), (self._name, None, dst, tag)):
                posted = c.posted.get(key)
                if posted:
                    rv = posted.popleft()
                    with compat.no_dispatch_modes():
                        rv.fill(data, self._group_rank)
                    c.sched.wake(rv.rank)
                    if rv.error is not None:  # both sides hear of it
                        raise ValueError(f"send to rank {self.ranks[dst]}: {rv.error}")
                    break
            else:
                c.mail[(self._name, self._group_rank, dst, tag)].append(data)
        _show("send", tensors)
        return _Work(tensors)

    def recv(self, tensors, src: int, tag: int = 0):
        return self._post(tensors[0], src, tag)

    def recv_anysource(self, tensors, tag: int = 0):
        return self._post(tensors[0], None, tag)

    def _post(self, tensor, src, tag) -> _Work:
        c = self.comms
        frm = "any rank" if src is None else f"rank {self.ranks[src]}"
        rv = _Recv(self.me, tensor, src, f"recv from {frm} (tag {tag}) on ranks {self.ranks}")
        with c.sched.lock:
            c.check(self.me)
            sources = range(self._size) if src is None else [src]
            for s in sources:
                box = c.mail.get((self._name, s, self._group_rank, tag))
                if box:
                    with compat.no_dispatch_modes():
                        rv.fill(box.popleft(), s)
                    break
            else:
                c.posted[(self._name, src, self._group_rank, tag)].append(rv)
        _show("recv" if src is not None else "recv_any", [tensor])
        return _Work(recv=rv, group=self)

    def _wait_recv(self, rv: _Recv) -> None:
        calls = _state().calls
        peers = tuple(self.ranks) if rv.src is None else tuple(sorted({self.me, self.ranks[rv.src]}))
        with contextlib.nullcontext() if calls is None or rv.filled else calls("recv", peers, [rv.tensor]):
            self._wait_recv_now(rv)

    def _wait_recv_now(self, rv: _Recv) -> None:
        c = self.comms
        with c.sched.lock:
            while not rv.filled:
                if rv.error is not None:
                    raise rv.error
                if rv.src is not None:
                    gone = c.gone([self.ranks[rv.src]])
                    if gone is not None:
                        c.dirty = True  # the receive stays posted: the next round must not fill it
                        raise RankStopped(f"{gone}; {rv.what} will never be filled")
                c.check(self.me)
                c.sched.block(self.me, rv.what)
            if rv.error is not None:
                raise rv.error


# -- group creation ----------------------------------------------------------------------------------------------

def join(comms: ThreadComms | None) -> None:
    """The calling rank thread's groups are made in ``comms`` from now on (None: it left)."""
    _state().comms = comms


def _create_group(opts, backend_options=None) -> ThreadGroup:
    comms = _state().comms
    if comms is None:
        raise RuntimeError("the 'threads' backend runs only on rank threads of a ThreadWorld "
                           "(meshviz.Cluster(ranks='threads'))")
    ranks = [int(r) for r in (opts.global_ranks_in_group or range(opts.group_size))]
    return ThreadGroup(comms, opts.group_rank, opts.group_size, opts.group_id, ranks)


def register() -> None:
    """Make ``"threads"`` a c10d backend (once per process)."""
    if BACKEND.upper() not in compat.backend_plugins():
        tdist.Backend.register_backend(BACKEND, _create_group, extended_api=True, devices=["cpu"])
