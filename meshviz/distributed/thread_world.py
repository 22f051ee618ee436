"""Ranks as threads of one process: their process group (every collective, send/recv) and the baton that lets
one rank run at a time."""

from __future__ import annotations

import collections
import ctypes
import datetime
import random
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist

from .. import compat
from ..errors import RankError, RankOutcome
from ..rank_context import RankContext, bound, current, per_rank

__all__ = ["BACKEND", "ThreadWorld", "ThreadGroup", "RankStopped", "run", "world", "observers"]

BACKEND = "threads"  # the c10d backend name: tdist.get_backend() on a rank thread

_world = per_rank(lambda: [None])  # [the ThreadWorld of this rank thread]
_observers = per_rank(list)  # callbacks(c10d op, tensors) that see this rank's calls

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


def observers() -> list:
    """This rank's observers: ``callback(op, tensors)`` is called for each of its calls on a thread group, with
    the c10d op a gloo group would have dispatched (``torch.ops.c10d.allreduce_.default``, ...)."""
    return _observers.here()


def _show(op: str, tensors) -> None:
    obs = _observers.here()
    if obs:
        func = getattr(torch.ops.c10d, _C10D_OPS[op]).default
        for cb in list(obs):
            cb(func, list(tensors))


def world() -> "ThreadWorld | None":
    """The ThreadWorld the calling thread is a rank of (None outside rank threads)."""
    return _world[0]


class RankStopped(RuntimeError):
    """A rank thread was stopped while it waited: a peer failed, the group was aborted or interrupted, the wait
    timed out, or every rank was waiting for another (a deadlock, named at once). ``own``: the rank's own wait
    failed (a timeout or a deadlock), as a collective that times out fails on a rank process."""

    def __init__(self, message: str, own: bool = False):
        super().__init__(message)
        self.own = own


# -- the process-wide generators, one state per rank -------------------------------------------------------------

class _Generators:
    """torch's CPU generator, numpy's and Python's global ones are process-wide; each rank (and the process itself,
    outside rank code) gets its own, switched in when the baton reaches it. A rank starts where a fresh process
    starts (torch's default seed; numpy and Python seeded from the OS).

    torch's state is saved and restored (a 5 KB copy, under a microsecond). numpy's and Python's module functions
    (``np.random.rand``, ``random.random``, ...) are bound methods of one global instance, whose state is slow to
    copy (about 30 µs); each rank gets an instance of its own and the module names are rebound to it instead
    (``from numpy.random import rand`` taken earlier keeps the process's instance).
    """

    def __init__(self):
        from numpy.random import mtrand

        self.owner = None  # None: the process
        self.saved: dict = {}
        self._mtrand = mtrand
        self._np_names = [n for n in dir(mtrand) if getattr(getattr(mtrand, n), "__self__", None) is mtrand._rand]
        self._py_names = [n for n in dir(random) if getattr(getattr(random, n), "__self__", None) is random._inst]
        self._mods: dict = {None: self._bindings(mtrand._rand, random._inst)}

    def _bindings(self, np_rs, py_inst) -> tuple:
        return (np_rs, {n: getattr(np_rs, n) for n in self._np_names},
                {n: getattr(py_inst, n) for n in self._py_names} | {"_inst": py_inst})

    def switch(self, to) -> None:
        if to == self.owner:
            return
        self.saved[self.owner] = torch.get_rng_state()
        st = self.saved.pop(to, None)
        torch.set_rng_state(st if st is not None else torch.Generator().get_state())
        mods = self._mods.get(to)
        if mods is None:
            mods = self._mods[to] = self._bindings(np.random.RandomState(), random.Random())
        np_rs, np_funcs, py_funcs = mods
        np.random.__dict__.update(np_funcs)
        self._mtrand.__dict__.update(np_funcs)
        self._mtrand._rand = np_rs  # what np.random.seed, ranf and sample call
        random.__dict__.update(py_funcs)
        self.owner = to


# -- meetings, receives and works ------------------------------------------------------------------------------

class _Meeting:
    """One collective call of one group: what each member brought; the last to arrive does the work."""

    __slots__ = ("op", "ranks", "data", "here", "arrived", "done", "error", "what")

    def __init__(self, op: str, ranks: list[int], what: str):
        self.op = op
        self.ranks = ranks  # global ranks, in group order
        self.data: list = [None] * len(ranks)
        self.here = [False] * len(ranks)
        self.arrived = 0
        self.done = False
        self.error: BaseException | None = None
        self.what = what


class _Recv:
    __slots__ = ("rank", "tensor", "src", "filled", "error", "what", "source")

    def __init__(self, rank: int, tensor, src: int | None, what: str):
        self.rank = rank  # global rank of the receiver
        self.tensor = tensor
        self.src = src  # group rank, None for any
        self.filled = False
        self.error: BaseException | None = None
        self.what = what
        self.source = src

    def fill(self, data, source: int) -> None:
        with torch.no_grad():
            self.tensor.detach().copy_(data)
        self.filled = True
        self.source = source


class _Work(tdist.Work):
    """What a thread group's call returns: done at once (collectives finish when the last member arrives), or a
    receive whose ``wait`` hands the baton on until a sender fills it."""

    def __init__(self, result=(), recv: _Recv | None = None, group: "ThreadGroup | None" = None):
        super().__init__()
        self._result = list(result)
        self._recv = recv
        self._group = group
        self._fut = torch.futures.Future()
        if recv is None:
            self._fut.set_result(self._result)

    def wait(self, timeout=None) -> bool:
        if self._recv is not None and not self._fut.done():
            self._group._wait_recv(self._recv)
            self._fut.set_result([self._recv.tensor])
        return True

    def is_completed(self) -> bool:
        return self._recv is None or self._recv.filled

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self):
        return None

    def get_future(self):
        return self._fut

    def result(self):
        return self._result if self._recv is None else [self._recv.tensor]

    def source_rank(self) -> int:
        return self._recv.source if self._recv is not None else -1

    _source_rank = source_rank


# -- reductions (in group-rank order, so every run sums alike) --------------------------------------------------

def _reducer(rop) -> Callable:
    op = getattr(rop, "op", rop)
    R = tdist.ReduceOp
    if op == R.SUM or op == R.AVG:
        return lambda a, b: a.add_(b)
    if op == R.PRODUCT:
        return lambda a, b: a.mul_(b)
    if op == R.MIN:
        return lambda a, b: torch.minimum(a, b, out=a)
    if op == R.MAX:
        return lambda a, b: torch.maximum(a, b, out=a)
    if op == R.BAND:
        return lambda a, b: a.bitwise_and_(b)
    if op == R.BOR:
        return lambda a, b: a.bitwise_or_(b)
    if op == R.BXOR:
        return lambda a, b: a.bitwise_xor_(b)
    raise NotImplementedError(f"the threads backend has no reduction {op}")


def _is_avg(rop) -> bool:
    return getattr(rop, "op", rop) == tdist.ReduceOp.AVG


@torch.no_grad()
def _reduce(tensors: list, rop):
    combine = _reducer(rop)
    acc = tensors[0].detach().clone()
    for t in tensors[1:]:
        combine(acc, t)
    if _is_avg(rop):
        if acc.is_floating_point() or acc.is_complex():
            acc.div_(len(tensors))
        else:
            acc.floor_divide_(len(tensors))
    return acc


def _put(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.detach().copy_(src)  # detach: c10d's signatures do not tell autograd about the write


def _splits(buf: torch.Tensor, sizes, n: int) -> list[int]:
    if sizes is None or len(sizes) == 0:
        return [buf.shape[0] // n] * n
    return [int(s) for s in sizes]


def _pieces(buf: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(buf, sizes, dim=0)) if buf.dim() else [buf]


# -- the process group -------------------------------------------------------------------------------------------

class ThreadGroup(tdist.ProcessGroup):
    """One rank's handle on one group of a :class:`ThreadWorld` (torch creates one per rank per group, as for
    gloo). Collectives meet by (group name, call number): every member must make the same calls in the same
    order, as with any backend; a mismatch is an error on every member. Sends are buffered and never block;
    receives wait (handing the baton on) until a matching send."""

    def __init__(self, tworld: "ThreadWorld", group_rank: int, size: int, name: str, ranks: list[int]):
        super().__init__(group_rank, size)
        self.world = tworld
        self._group_rank = group_rank
        self._size = size
        self._name = name
        self.ranks = ranks  # global ranks in group order
        self.me = ranks[group_rank]
        self.seq = 0
        tworld._groups.add(self)

    # -- identity --------------------------------------------------------------------------------------------
    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._group_rank

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        return self._name

    @property
    def pg_name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"ThreadGroup({self._name!r}, ranks={self.ranks}, rank={self.me})"

    # -- the meeting -----------------------------------------------------------------------------------------
    def _meet(self, op: str, data, work: Callable[[list], None], result=()) -> _Work:
        w = self.world
        with w.lock:
            w._check(self.me)
            seq = self.seq
            self.seq += 1
            key = (self._name, seq)
            what = f"{op} #{seq + 1} on ranks {self.ranks}"
            m = w._meetings.get(key)
            if m is None:
                m = w._meetings[key] = _Meeting(op, self.ranks, what)
            elif m.op != op:
                other = m.ranks[m.here.index(True)]
                err = RankStopped(f"collective mismatch on ranks {self.ranks} (call #{seq + 1}): rank {self.me} called "
                                  f"{op}, rank {other} called {m.op}")
                w._fail_meeting(key, m, err)
                raise err
            m.data[self._group_rank] = data
            m.here[self._group_rank] = True
            m.arrived += 1
            gone = w._gone(m.ranks)
            if gone is not None:
                err = RankStopped(f"{gone}; it will not join {what}")
                w._fail_meeting(key, m, err)
                raise err
            if m.arrived == len(m.ranks):
                del w._meetings[key]
                try:
                    with torch.no_grad(), compat.no_dispatch_modes():
                        work(m.data)
                except Exception as e:
                    m.error = e
                m.done = True
                for r in m.ranks:
                    if r != self.me:
                        w._wake(r)
                if m.error is not None:
                    raise RuntimeError(f"{what} failed: {m.error}") from m.error
                _show(op, result)
                return _Work(result)
            w._block(self.me, f"{what} (waiting for rank{'s' if len(m.ranks) - m.arrived > 1 else ''} "
                              f"{', '.join(str(r) for r, h in zip(m.ranks, m.here) if not h)})")
            if m.error is not None:
                raise m.error if isinstance(m.error, RankStopped) else RuntimeError(f"{what} failed: {m.error}")
        _show(op, result)
        return _Work(result)

    # -- collectives -----------------------------------------------------------------------------------------
    def _all_reduce(self, op: str, tensors, opts) -> _Work:
        rop = opts.reduceOp if opts is not None else tdist.ReduceOp.SUM

        def work(data):
            for i in range(len(data[0])):
                acc = _reduce([d[i] for d in data], rop)
                for d in data:
                    _put(d[i], acc)

        return self._meet(op, list(tensors), work, tensors)

    def allreduce(self, tensors, opts=None):
        return self._all_reduce("all_reduce", tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        return self._all_reduce("all_reduce_coalesced", tensors, opts)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0

        def work(data):
            for i, src in enumerate(data[root]):
                for r, d in enumerate(data):
                    if r != root:
                        _put(d[i], src)

        return self._meet("broadcast", list(tensors), work, tensors)

    def reduce(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        rop = opts.reduceOp if opts is not None else tdist.ReduceOp.SUM

        def work(data):
            for i in range(len(data[0])):
                _put(data[root][i], _reduce([d[i] for d in data], rop))

        return self._meet("reduce", list(tensors), work, tensors)

    def allgather(self, outputs, inputs, opts=None):
        def work(data):
            for outs, _ in data:
                for j in range(len(outs)):
                    for src, (_, ins) in enumerate(data):
                        _put(outs[j][src], ins[j])

        return self._meet("all_gather", (outputs, inputs), work, [t for o in outputs for t in o])

    def allgather_coalesced(self, outputs, inputs, opts=None):
        def work(data):
            for outs, _ in data:
                for j in range(len(outs)):
                    for src, (_, ins) in enumerate(data):
                        _put(outs[j][src], ins[j])

        return self._meet("all_gather_coalesced", (outputs, inputs), work, [t for o in outputs for t in o])

    def all_gather_single(self, output, input, opts=None):
        def work(data):
            ins = [i for _, i in data]
            for out, _ in data:
                _put(out, torch.cat([i.reshape(-1) for i in ins]).reshape(out.shape))

        return self._meet("all_gather_single", (output, input), work, [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        def work(data):
            for j in range(len(data[0][0])):
                cat = torch.cat([ins[j].reshape(-1) for _, ins in data])
                for outs, _ in data:
                    _put(outs[j], cat.reshape(outs[j].shape))

        return self._meet("all_gather_single_coalesced", (outputs, inputs), work, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, outputs, inputs, opts=None):
        root = opts.rootRank if opts is not None else 0

        def work(data):
            outs = data[root][0][0]
            for src, (_, ins) in enumerate(data):
                _put(outs[src], ins[0])

        return self._meet("gather", (outputs, inputs), work, [t for o in outputs for t in o])

    def scatter(self, outputs, inputs, opts=None):
        root = opts.rootRank if opts is not None else 0

        def work(data):
            pieces = data[root][1][0]
            for r, (outs, _) in enumerate(data):
                _put(outs[0], pieces[r])

        return self._meet("scatter", (outputs, inputs), work, outputs)

    def reduce_scatter(self, outputs, inputs, opts=None):
        rop = opts.reduceOp if opts is not None else tdist.ReduceOp.SUM

        def work(data):
            for j in range(len(data[0][0])):
                for r, (outs, _) in enumerate(data):
                    _put(outs[j], _reduce([ins[j][r] for _, ins in data], rop))

        return self._meet("reduce_scatter", (outputs, inputs), work, outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        rop = opts.reduceOp if opts is not None else tdist.ReduceOp.SUM
        n = self._size

        def work(data):
            total = _reduce([i.reshape(n, -1) for _, i in data], rop)
            for r, (out, _) in enumerate(data):
                _put(out, total[r].reshape(out.shape))

        return self._meet("reduce_scatter_single", (output, input), work, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        rop = opts.reduceOp if opts is not None else tdist.ReduceOp.SUM
        n = self._size

        def work(data):
            for j in range(len(data[0][0])):
                total = _reduce([ins[j].reshape(n, -1) for _, ins in data], rop)
                for r, (outs, _) in enumerate(data):
                    _put(outs[j], total[r].reshape(outs[j].shape))

        return self._meet("reduce_scatter_single_coalesced", (outputs, inputs), work, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, outputs, inputs, opts=None):
        def work(data):
            for dst, (outs, _) in enumerate(data):
                for src, (_, ins) in enumerate(data):
                    _put(outs[src], ins[dst])

        return self._meet("all_to_all", (outputs, inputs), work, outputs)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, opts=None):
        n = self._size

        def work(data):
            ins = [_pieces(i, _splits(i, isz, n)) for _, i, _, isz in data]
            for dst, (out, _, osz, _) in enumerate(data):
                outs = _pieces(out, _splits(out, osz, n))
                for src in range(n):
                    _put(outs[src], ins[src][dst])

        return self._meet("all_to_all_single", (output, input, output_split_sizes, input_split_sizes), work, [output])

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        return self._meet("barrier", True, lambda data: None)

    # -- point to point --------------------------------------------------------------------------------------
    def send(self, tensors, dst: int, tag: int = 0):
        w = self.world
        with compat.no_dispatch_modes():
            data = tensors[0].detach().clone()
        with w.lock:
            w._check(self.me)
            if not 0 <= dst < self._size:
                raise ValueError(f"send: group rank {dst} outside 0..{self._size - 1} of ranks {self.ranks}")
            for key in ((self._name, self._group_rank, dst, tag), (self._name, None, dst, tag)):
                posted = w._posted.get(key)
                if posted:
                    rv = posted.popleft()
                    with compat.no_dispatch_modes():
                        rv.fill(data, self._group_rank)
                    w._wake(rv.rank)
                    break
            else:
                w._mail[(self._name, self._group_rank, dst, tag)].append(data)
        _show("send", tensors)
        return _Work(tensors)

    def recv(self, tensors, src: int, tag: int = 0):
        return self._post(tensors[0], src, tag)

    def recv_anysource(self, tensors, tag: int = 0):
        return self._post(tensors[0], None, tag)

    def _post(self, tensor, src, tag) -> _Work:
        w = self.world
        frm = "any rank" if src is None else f"rank {self.ranks[src]}"
        rv = _Recv(self.me, tensor, src, f"recv from {frm} (tag {tag}) on ranks {self.ranks}")
        with w.lock:
            w._check(self.me)
            sources = range(self._size) if src is None else [src]
            for s in sources:
                box = w._mail.get((self._name, s, self._group_rank, tag))
                if box:
                    with compat.no_dispatch_modes():
                        rv.fill(box.popleft(), s)
                    break
            else:
                w._posted[(self._name, src, self._group_rank, tag)].append(rv)
        _show("recv" if src is not None else "recv_any", [tensor])
        return _Work(recv=rv, group=self)

    def _wait_recv(self, rv: _Recv) -> None:
        w = self.world
        with w.lock:
            while not rv.filled:
                if rv.error is not None:
                    raise rv.error
                if rv.src is not None:
                    gone = w._gone([self.ranks[rv.src]])
                    if gone is not None:
                        raise RankStopped(f"{gone}; {rv.what} will never be filled")
                w._check(self.me)
                w._block(self.me, rv.what)
            if rv.error is not None:
                raise rv.error


# -- the world -------------------------------------------------------------------------------------------------

class _Job:
    """One function run on some ranks; ``outcomes`` as the ranks finish it."""

    def __init__(self, fn: Callable[[int], Any], ranks: list[int], world: "ThreadWorld | None" = None):
        self.fn = fn
        self.ranks = list(ranks)
        self.results: dict[int, RankOutcome] = {}
        self.finished = threading.Event()
        self.lock = threading.Lock()
        self.world = world
        self.awaited = False  # someone waits for it: no other job can come to unblock its ranks

    def _finish(self, rank: int, outcome: RankOutcome) -> None:
        with self.lock:
            self.results[rank] = outcome
            if len(self.results) == len(self.ranks):
                self.finished.set()

    def done(self) -> bool:
        return self.finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        if not self.awaited and self.world is not None:
            self.awaited = True
            self.world._recheck()
        return self.finished.wait(timeout)

    def pending(self) -> list[int]:
        return [r for r in self.ranks if r not in self.results]

    def outcomes(self) -> list[RankOutcome]:
        return [self.results.get(r) or RankOutcome(r, None, "running", "no result before the deadline")
                for r in self.ranks]


_installed = 0
_install_lock = threading.Lock()
_real_sleep = time.sleep


def _sleep(seconds) -> None:
    tw = _world[0]
    if tw is None:
        return _real_sleep(seconds)
    tw._sleep(current().rank, seconds)


def _install() -> None:
    global _installed
    with _install_lock:
        if _installed == 0:
            compat.install_thread_worlds()
            if BACKEND.upper() not in compat.backend_plugins():
                tdist.Backend.register_backend(BACKEND, _create_group, extended_api=True, devices=["cpu"])
            time.sleep = _sleep
        _installed += 1


def _uninstall() -> None:
    global _installed
    with _install_lock:
        _installed -= 1
        if _installed == 0:
            time.sleep = _real_sleep
            compat.uninstall_thread_worlds()


def _create_group(opts, backend_options=None) -> ThreadGroup:
    tw = _world[0]
    if tw is None:
        raise RuntimeError("the 'threads' backend runs only on rank threads of a ThreadWorld "
                           "(meshviz.Cluster(ranks='threads'))")
    ranks = [int(r) for r in (opts.global_ranks_in_group or range(opts.group_size))]
    return ThreadGroup(tw, opts.group_rank, opts.group_size, opts.group_id, ranks)


class ThreadWorld:
    """``n`` ranks as threads of this process, each with its own process group (backend ``"threads"``), its own
    :class:`~meshviz.rank_context.RankContext` and its own RNG states.

    The baton: one rank runs at a time. A rank hands it on only while it waits — in a collective, a receive,
    ``time.sleep`` — so the code between two waits runs without interleaving, and process-wide state (torch's,
    numpy's and Python's RNGs; ``sys.stdout``) behaves per rank as it does in rank processes. The next rank to
    run is the next ready one in rank order after the last, so a run is repeatable.

    A wait ends when its peers arrive, or with :class:`RankStopped`: a peer failed (at once), the world was
    aborted or interrupted, ``timeout`` seconds passed, or every rank with work is waiting for another (a
    deadlock is named at once, with what each rank waits for).
    """

    def __init__(self, n: int, timeout: float = 60.0, env: dict | None = None, name: str = "meshviz-rank"):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"ThreadWorld: n must be a positive int, got {n!r}")
        self.n = n
        self.timeout = float(timeout)
        self.name = name
        self.lock = threading.Lock()
        self._turn = [threading.Condition(self.lock) for _ in range(n)]
        self.holder: int | None = None
        self._last = n - 1
        self._runnable: set[int] = set()
        self._blocked: dict[int, str] = {}  # rank -> what it waits for
        self._away: set[int] = set()  # sleeping, baton handed on
        self._naps = [threading.Event() for _ in range(n)]
        self._verdict: dict[int, BaseException] = {}
        self._pending = [0] * n  # jobs given to each rank and not finished
        self._jobs: set = set()  # jobs not finished on every rank
        self._meetings: dict = {}
        self._mail: dict = collections.defaultdict(collections.deque)
        self._posted: dict = collections.defaultdict(collections.deque)
        self._groups: "weakref.WeakSet[ThreadGroup]" = weakref.WeakSet()
        self._failed: dict[int, str] = {}  # rank -> what it raised, this round, in the order they failed
        self.first_failed: list[int] = []  # ranks that raised on their own (not stopped for a peer), in order
        self._aborted: str | None = None
        self._interrupted = False
        self.dirty = False  # meetings were left half done: reset() before the next job
        self._gens = _Generators()
        self._queues = [collections.deque() for _ in range(n)]
        self._work = [threading.Condition(threading.Lock()) for _ in range(n)]
        self._threads: list[threading.Thread] = []
        self._idents: dict[int, int] = {}
        self._stopping = False
        self.store = tdist.HashStore()
        base = dict(env or {})
        self.contexts = [RankContext(r, env={**base, **_rank_env(r, n, self.timeout)}, init=self._joiner(r))
                         for r in range(n)]
        self.started = False

    # -- life cycle ------------------------------------------------------------------------------------------
    def start(self, join: bool = True) -> "ThreadWorld":
        """Start the rank threads; with ``join``, every rank joins its process group before this returns."""
        if self.started:
            return self
        _install()
        self.started = True
        for r in range(self.n):
            t = threading.Thread(target=self._serve, args=(r,), name=f"{self.name}-{r}", daemon=True)
            self._threads.append(t)
            t.start()
        if join:
            from .env import init_parallel_env

            job = self.submit(lambda r: init_parallel_env() and tdist.get_rank())
            if not job.wait(self.timeout + 30) or any(o.status != "ok" for o in job.outcomes()):
                outcomes = job.outcomes()
                self.stop()
                bad = [o.rank for o in outcomes if o.status != "ok"]
                raise RankError(outcomes, bad[:1], "the rank threads did not join their process group")
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Tear the process groups down and end the rank threads (a rank still running is interrupted)."""
        if not self.started:
            return
        if any(self._pending):
            self.interrupt()
        self.submit(lambda r: _leave_world(), wait=False)
        self._stopping = True
        for cv in self._work:
            with cv:
                cv.notify()
        for t in self._threads:
            t.join(timeout)
        self.started = False
        _uninstall()
        with self.lock:
            self._gens.switch(None)

    def _joiner(self, rank: int) -> Callable[[], None]:
        def join():
            tdist.init_process_group(BACKEND, rank=rank, world_size=self.n, store=self.store,
                                     timeout=datetime.timedelta(seconds=self.timeout))
        return join

    # -- jobs ------------------------------------------------------------------------------------------------
    def submit(self, fn: Callable[[int], Any], ranks=None, wait: bool = False) -> _Job:
        """Run ``fn(rank)`` on each of ``ranks`` (all by default), each on its own thread with the baton; returns
        the job (``wait``: after it finished)."""
        ranks = list(range(self.n)) if ranks is None else [int(r) for r in ranks]
        job = _Job(fn, ranks, self)
        with self.lock:
            if not any(self._pending):
                self._begin()
            self._jobs.add(job)
            for r in ranks:
                self._pending[r] += 1
        for r in ranks:
            with self._work[r]:
                self._queues[r].append(job)
                self._work[r].notify()
        if wait:
            job.wait()
        return job

    def _begin(self) -> None:
        """A new round of jobs (nothing is running): forget last round's failures; reset if it left a mess."""
        self._failed.clear()
        self.first_failed = []
        self._interrupted = False
        self._verdict.clear()
        if self.dirty or self._aborted is not None:
            self._reset_comms()

    def reset(self) -> None:
        """Fresh meetings, mailboxes and call numbers on every group (after a failure or an abort)."""
        with self.lock:
            self._reset_comms()

    def _reset_comms(self) -> None:
        from . import rollcall

        self._meetings.clear()
        self._mail.clear()
        self._posted.clear()
        for g in list(self._groups):
            g.seq = 0
        for ctx in self.contexts:  # the roll-call counts from 1 again too, as in a new world of rank processes
            with bound(ctx):
                rollcall.reset()
        self._aborted = None
        self.dirty = False

    def _serve(self, rank: int) -> None:
        ctx = self.contexts[rank]
        self._idents[rank] = threading.get_ident()
        with bound(ctx):
            _world[0] = self
            while True:
                with self._work[rank]:
                    while not self._queues[rank] and not self._stopping:
                        self._work[rank].wait()
                    if not self._queues[rank]:
                        return
                    job = self._queues[rank].popleft()
                outcome = self._run(job, rank)
                job._finish(rank, outcome)
                if job.done():
                    with self.lock:
                        self._jobs.discard(job)

    def _run(self, job: _Job, rank: int) -> RankOutcome:
        try:
            self._enter(rank)
        except BaseException as e:  # interrupted before it ran
            self._leave(rank)
            return RankOutcome(rank, None, "error", _summary(e), traceback.format_exc())
        try:
            value = job.fn(rank)
        except BaseException as e:
            tb = _format_exception(e)
            self.rank_failed(rank, e)
            out = RankOutcome(rank, None, "error", _summary(e), tb)
        else:
            out = RankOutcome(rank, None, "ok", value=value)
        finally:
            self._leave(rank)
        return out

    # -- the baton -------------------------------------------------------------------------------------------
    def _enter(self, rank: int) -> None:
        with self.lock:
            self._runnable.add(rank)
            self._grant()
            self._await_turn(rank)

    def _leave(self, rank: int) -> None:
        with self.lock:
            self._pending[rank] -= 1
            self._runnable.discard(rank)
            if self.holder == rank:
                self.holder = None
                self._grant()
            self._check_deadlock()
            if not any(self._pending) and self.holder is None:
                self._gens.switch(None)  # the process gets its own RNG states back

    def _grant(self) -> None:
        """Give the baton to the next ready rank after the last holder (call with the lock)."""
        if self.holder is not None or not self._runnable:
            return
        nxt = min(self._runnable, key=lambda r: (r - self._last - 1) % self.n)
        self._runnable.discard(nxt)
        self.holder = self._last = nxt
        self._gens.switch(nxt)
        self._turn[nxt].notify()

    def _await_turn(self, rank: int) -> None:
        while self.holder != rank:
            self._turn[rank].wait(1.0)
        verdict = self._verdict.pop(rank, None)
        if verdict is not None:
            raise verdict

    def _block(self, rank: int, what: str) -> None:
        """The holder waits (call with the lock): the baton moves on until a peer wakes it (or a verdict does)."""
        self._blocked[rank] = what
        self.holder = None
        self._grant()
        self._check_deadlock()
        deadline = time.monotonic() + self.timeout
        while self.holder != rank:
            if rank in self._blocked:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._stop_rank(rank, RankStopped(f"rank {rank} timed out after {self.timeout:g} s in {what}",
                                                      own=True))
                    self.dirty = True
                    continue
                self._turn[rank].wait(min(left, 1.0))
            else:
                self._turn[rank].wait(1.0)
        verdict = self._verdict.pop(rank, None)
        if verdict is not None:
            raise verdict

    def _wake(self, rank: int) -> None:
        """A blocked rank may go on: it is ready for the baton (call with the lock)."""
        if self._blocked.pop(rank, None) is not None:
            self._runnable.add(rank)
            self._grant()

    def _stop_rank(self, rank: int, err: BaseException) -> None:
        self._verdict.setdefault(rank, err)
        self._wake(rank)

    def _sleep(self, rank: int, seconds) -> None:
        """``time.sleep`` on a rank thread: the baton moves on while it sleeps (so timelines overlap as they do
        with rank processes)."""
        with self.lock:
            if self.holder != rank:
                return _real_sleep(seconds)
            self._away.add(rank)
            self.holder = None
            self._naps[rank].clear()
            self._grant()
        try:
            self._naps[rank].wait(seconds)
        finally:
            with self.lock:
                self._away.discard(rank)
                self._runnable.add(rank)
                self._grant()
                self._await_turn(rank)

    def _recheck(self) -> None:
        with self.lock:
            self._check_deadlock()

    def _check_deadlock(self) -> None:
        """A deadlock: every rank with work waits for another, and no other job can come to unblock them (every
        job in flight is waited for; a notebook's non-blocking cell leaves room for a later cell to join it)."""
        if self.holder is not None or self._runnable or self._away or not self._blocked:
            return
        if not all(j.awaited for j in self._jobs):
            return
        working = [r for r in range(self.n) if self._pending[r] > 0]
        if not all(r in self._blocked for r in working):
            return
        lines = "; ".join(f"rank {r} waits in {self._blocked[r]}" for r in sorted(self._blocked))
        idle = [r for r in range(self.n) if r not in self._blocked]
        if idle:
            lines += f"; rank{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))} finished"
        self.dirty = True
        for r in list(self._blocked):
            self._stop_rank(r, RankStopped(f"deadlock: every rank waits for another: {lines}", own=True))

    # -- failures --------------------------------------------------------------------------------------------
    def _gone(self, ranks) -> str | None:
        """Why one of ``ranks`` will never come (it failed this round, or the world was aborted), or None."""
        if self._aborted is not None:
            return self._aborted
        for r in ranks:
            if r in self._failed:
                return f"rank {r} failed ({self._failed[r]})"
        return None

    def _check(self, rank: int) -> None:
        if self._interrupted:
            raise KeyboardInterrupt(f"rank {rank} interrupted")
        if self._aborted is not None:
            raise RankStopped(self._aborted)

    def _fail_meeting(self, key, m: _Meeting, err: BaseException) -> None:
        self._meetings.pop(key, None)
        m.error = err
        self.dirty = True
        for r, h in zip(m.ranks, m.here):
            if h:
                self._wake(r)

    def rank_failed(self, rank: int, error: BaseException) -> None:
        """``rank`` raised: every rank waiting for it (in a collective or a receive) is stopped at once."""
        with self.lock:
            self._failed[rank] = _summary(error)
            if not isinstance(error, (RankStopped, KeyboardInterrupt)):
                self.first_failed.append(rank)
            why = f"rank {rank} failed ({self._failed[rank]})"
            for key, m in list(self._meetings.items()):
                if rank in m.ranks and not m.here[m.ranks.index(rank)]:
                    self._fail_meeting(key, m, RankStopped(f"{why}; it will not join {m.what}"))
            for key, posted in self._posted.items():
                name, src, dst, tag = key
                for rv in list(posted):
                    g = next((g for g in self._groups if g._name == name and g.me == rv.rank), None)
                    if g is not None and src is not None and g.ranks[src] == rank:
                        rv.error = RankStopped(f"{why}; {rv.what} will never be filled")
                        posted.remove(rv)
                        self.dirty = True
                        self._wake(rv.rank)

    def abort(self, origin=None) -> None:
        """Stop every waiting rank now, and every collective until :meth:`reset` (a rank's failure report, or
        an interrupt that found ranks still busy)."""
        with self.lock:
            self._aborted = (f"the process group was torn down (rank {origin} failed)" if origin is not None
                             else "the process group was torn down")
            self.dirty = True
            for r in list(self._blocked):
                self._stop_rank(r, RankStopped(self._aborted))

    def interrupt(self) -> None:
        """KeyboardInterrupt on every rank with work: at once in a wait or a sleep, at the next Python line in
        code that runs (as SIGINT does)."""
        with self.lock:
            self._interrupted = True
            self.dirty = True
            for r in list(self._blocked):
                self._stop_rank(r, KeyboardInterrupt(f"rank {r} interrupted"))
            for r in range(self.n):
                if self._pending[r] and r not in self._blocked:
                    self._verdict.setdefault(r, KeyboardInterrupt(f"rank {r} interrupted"))
                self._naps[r].set()
            holder = self.holder
        if holder is not None and holder not in self._away:
            ident = self._idents.get(holder)
            if ident is not None:
                self._verdict.pop(holder, None)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(KeyboardInterrupt))

    def busy(self) -> bool:
        return any(self._pending)

    def waiting(self) -> dict[int, str]:
        """rank -> what it waits for, now."""
        with self.lock:
            return dict(self._blocked)

    def __repr__(self) -> str:
        return f"ThreadWorld({self.n} ranks, {'started' if self.started else 'stopped'}, holder={self.holder})"


def _leave_world() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()
    from . import groups

    groups.reset()
    _world[0] = None


def _rank_env(rank: int, n: int, timeout: float) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n),
            "MESHVIZ_TIMEOUT": str(timeout)}


_INTERNAL: set[str] = {__file__}


def internal_frames(filename: str) -> None:
    """Leave frames of ``filename`` (a module that runs rank jobs) out of the tracebacks rank failures show."""
    _INTERNAL.add(filename)


def _format_exception(e: BaseException) -> str:
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in _INTERNAL:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb))


def _summary(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 500 else text[:497] + "..."


def run(fn: Callable, nprocs: int, *args, timeout: float = 120.0, collective_timeout: float = 30.0,
        env: dict | None = None) -> list:
    """Run ``fn(*args)`` on ranks 0..nprocs-1 as threads of this process (process group ready; ``env``: variables
    every rank reads as its own); return the per-rank values, or raise :class:`~meshviz.errors.RankError` naming
    the rank that failed first."""
    tw = ThreadWorld(nprocs, timeout=collective_timeout, env=env).start(join=False)  # as a process: init on demand
    try:
        job = tw.submit(lambda r: fn(*args))
        if not job.wait(timeout):
            tw.interrupt()
            job.wait(10)
        outcomes = job.outcomes()
        bad = [o.rank for o in outcomes if o.status != "ok"]
        if bad:
            raise RankError(outcomes, (tw.first_failed or bad)[:1])
        return [o.value for o in outcomes]
    finally:
        tw.stop()
