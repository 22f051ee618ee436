"""The roll-call: what this rank is doing right now (idle, running, inside a collective), kept cheaply by the comm
layer and read by another thread while the rank is blocked."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
import sysconfig
import threading
import time
import traceback
import weakref

from .. import rank_context
from ..trace.status import RankStatus

__all__ = ["Record", "current", "records", "snapshot", "where", "issuer", "reset", "internal", "place", "refusing",
           "refused", "refusal"]

_monotonic = time.monotonic


class Record:
    """One rank's roll-call record. The comm layer writes it on every collective (a few attribute stores); a side
    thread reads it with :func:`snapshot`. Get it with :func:`current`, never keep it elsewhere.

    ``op``/``group``/``seq``: the collective the rank is inside (None outside), ``seq`` counting the collectives
    this rank entered on ``group`` (1, 2, ...); ``entered``: group -> that count. ``running``: a cell (or the
    rank's function) runs; ``idle_note`` says why the rank is idle ("its cell finished"). ``region``: a stretch in
    which torch issues collectives that do not pass the comm layer (DataParallel's gradient buckets during
    backward). ``failed``: the collective the last error came out of. ``refused``: the last call this rank refused
    (raised on it alone, communicating nothing), which the roll-call names where the others wait for it.
    """

    __slots__ = ("rank", "thread", "running", "cell", "idle_note", "op", "group", "seq", "tensors", "nbytes",
                 "since", "entered", "region", "works", "failed", "failed_id", "refused", "modules", "spans",
                 "__weakref__")

    def __init__(self, rank: int | None = None, thread: int | None = None):
        self.rank = rank
        self.thread = thread  # the ident of the thread that runs this rank's code (None: the main thread)
        self.running = False
        self.cell = 0
        self.idle_note: str | None = None
        self.op: str | None = None
        self.group: tuple | None = None
        self.seq: int | None = None
        self.tensors = ()
        self.nbytes: int | None = None
        self.since = 0.0
        self.entered: dict[tuple, int] = {}
        self.region: tuple | None = None  # (op, group, note, since)
        self.works = None  # (op, group, seq, since, works) of the last collective whose works were still running
        self.failed: dict | None = None
        self.failed_id: tuple | None = None  # (id, text) of the error in ``failed``: it is no refusal
        self.refused: tuple | None = None  # (call, error, where, cell, entered then)
        self.modules: list = []  # (name, weakref, first node number) of the modules whose forward runs, outermost first
        self.spans: list = []  # the autograd nodes of the latest outermost module calls, by module (runtime.modules)

    # -- the comm layer's side: keep it cheap -------------------------------------------------------------------
    def enter(self, op: str, group: tuple, tensors=(), nbytes: int | None = None, counted: bool = True):
        """This rank enters collective ``op`` on ``group`` (a tuple of global ranks); returns what to restore.
        ``counted``: the call uses up the group's next number (a point-to-point call has none)."""
        seq = None
        if counted:
            seq = self.entered[group] = self.entered.get(group, 0) + 1
        prev = None if self.op is None else (self.op, self.group, self.seq, self.tensors, self.nbytes, self.since)
        self.group, self.seq, self.tensors, self.nbytes = group, seq, tensors, nbytes
        self.since = _monotonic()
        self.op = op
        return prev

    def resume(self, op: str, group: tuple, seq: int, tensors=()):
        """Waiting again for a collective entered earlier (an async call's ``wait()``); returns what to restore."""
        prev = None if self.op is None else (self.op, self.group, self.seq, self.tensors, self.nbytes, self.since)
        self.group, self.seq, self.tensors, self.nbytes = group, seq, tensors, None
        self.since = _monotonic()
        self.op = op
        return prev

    def leave(self, prev, works=None) -> None:
        """The collective returned (``works``: its handles, kept while they still run on the device, as under
        NCCL; finished ones are dropped at once, they hold the collective's buffers)."""
        if works and not works[-1].is_completed():
            self.works = (self.op, self.group, self.seq, self.since, works)
        elif self.works is not None:
            self.works = None
        if prev is None:
            self.op = None
            self.tensors = ()
        else:
            self.op, self.group, self.seq, self.tensors, self.nbytes, self.since = prev

    def fail(self, error: BaseException) -> dict | None:
        """The collective the rank is inside raised ``error``: remember it (and tell the watchers)."""
        if self.op is None:
            return None
        text = f"{type(error).__name__}: {error}"[:300]
        self.failed_id = (id(error), text)
        self.failed = {
            "op": self.op, "group": list(self.group), "seq": self.seq, "waited_s": round(_monotonic() - self.since, 3),
            "where": where(sys._getframe(1)), "error": text,
            "time": time.time(), "cell": self.cell,
        }
        for hook in list(_state().fail_hooks):
            try:
                hook(self)
            except Exception:
                pass
        return self.failed

    def begin_region(self, op: str, group: tuple, note: str) -> None:
        """From now until :meth:`end_region`, a blocked rank counts as inside ``op`` on ``group`` (``note`` says
        whose collectives they are) when its stack shows autograd's backward running."""
        self.region = (op, group, note, _monotonic())

    def end_region(self) -> None:
        self.region = None

    # -- the rank's life ----------------------------------------------------------------------------------------
    def start(self, cell: int | None = None) -> None:
        """A cell (or the rank's function) starts."""
        self.cell = self.cell + 1 if cell is None else cell
        self.running = True
        self.region = None

    def finish(self, note: str = "its cell finished") -> None:
        """It ended: the rank is idle, ``note`` says why."""
        self.running = False
        self.idle_note = note
        self.region = None
        self.modules.clear()

    def reset(self) -> None:
        """A new world: collectives are counted from 1 again on every group."""
        self.entered = {}
        self.works = None
        self.failed = None
        self.refused = None


@dataclasses.dataclass
class RollcallState:
    record: Record | None = None  # this rank's record (ranks may be threads of one process)
    # called with the record when a collective raises (the scripts' watchdog publishes it)
    fail_hooks: list = dataclasses.field(default_factory=list)
    # called with the record when the rank refuses a call (the scripts' watchdog publishes it: the rank may return)
    refuse_hooks: list = dataclasses.field(default_factory=list)


ROLLCALL = rank_context.slot("rollcall", RollcallState)


def _state() -> RollcallState:
    return ROLLCALL.get()


_all: "weakref.WeakSet" = weakref.WeakSet()  # every rank record of this process
_lock = threading.Lock()


def current() -> Record:
    """This rank's record (made on first use)."""
    st = _state()
    rec = st.record
    if rec is None:
        rec = st.record = Record()
        with _lock:
            _all.add(rec)
    return rec


def records() -> list[Record]:
    """Every rank record of this process (one per rank it runs), in rank order where known."""
    with _lock:
        recs = list(_all)
    return sorted(recs, key=lambda r: (r.rank is None, r.rank if r.rank is not None else 0))


def refusing(fn=None, *, name: str | None = None):
    """``fn``, a public call (``name``: as the user calls it, default its own), with its refusals kept in the
    roll-call: an error it raises that no collective raised (bad input refused before communicating) is this rank's
    ``refused``, so where the others wait in the call the rank refused and went on, their error says why. A call
    that returns pays nothing."""
    if fn is None:
        return functools.partial(refusing, name=name)
    name = name or fn.__name__

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            refused(name, e, sys._getframe(1))
            raise

    return call


def refused(call: str, error: BaseException, frame=None) -> None:
    """Keep ``error``, raised by public call ``call`` (called from ``frame``), as this rank's last refusal, unless
    it came out of a collective."""
    rec = current()
    e, seen = error, 0
    while e is not None and seen < 8 and rec.failed_id is not None:  # it, or an error it wraps, left a collective
        if rec.failed_id == (id(e), f"{type(e).__name__}: {e}"[:300]):
            return
        e, seen = e.__cause__ or e.__context__, seen + 1
    text = f"{type(error).__name__}: {str(error).removeprefix(call + ': ')}"
    rec.refused = (call, text if len(text) <= 240 else text[:237] + "...", where(frame), rec.cell,
                   tuple(sorted(rec.entered.items())))
    for hook in list(_state().refuse_hooks):
        try:
            hook(rec)
        except Exception:
            pass


def refusal(rec: Record) -> dict:
    """The roll-call fields of ``rec``'s last refusal (``refused``, ``refused_entered``), ``{}`` when none."""
    if rec.refused is None:
        return {}
    call, error, at, cell, then = rec.refused
    return {"refused": f"{call} ({error})" + (f" at {at}" if at else "") + (
        f" in cell {cell}" if cell != rec.cell else ""), "refused_entered": then}


def reset() -> None:
    """Count collectives from 1 again (every rank of a new world calls it)."""
    current().reset()


def _no_backward(rec: Record) -> tuple[str | None, bool]:
    return None, False


backward_issuer = _no_backward  # (module, in a backward) outside any forward: runtime.modules reads autograd's


def issuer(rec: Record | None = None) -> tuple[str | None, bool]:
    """(the nn.Module whose forward or backward runs now, whether it is the backward), from the module hooks
    that keep ``rec.modules`` and ``rec.spans`` while tracing (:mod:`~meshviz.runtime.modules`)."""
    rec = current() if rec is None else rec
    if rec.modules:
        return rec.modules[-1][0], False
    return backward_issuer(rec)


# -- where the user's code is -----------------------------------------------------------------------------------

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # meshviz/
_STDLIB = sysconfig.get_paths().get("stdlib", "") + os.sep
_SITE = (sysconfig.get_paths().get("purelib", ""), sysconfig.get_paths().get("platlib", ""))
_CELL = re.compile(r"(ipykernel_\d+[/\\]\d+\.py$|^<ipython-input-|^<rank cell \d+>$)")  # a notebook cell's code
_INTERNAL: set = set()


@functools.lru_cache(maxsize=4096)
def internal(filename: str) -> bool:
    """Whether code in ``filename`` is meshviz's, torch's or the standard library's (not the user's)."""
    if filename.startswith(_PKG) or filename.startswith("<frozen"):
        return True
    if filename.startswith(_STDLIB) and not filename.startswith(_SITE):
        return True
    if not _INTERNAL:
        import torch

        _INTERNAL.add(os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    return any(filename.startswith(p) for p in _INTERNAL)


def _format(frame) -> str:
    code = frame.f_code  # keyed by its names: a code object hashes its constants, nested code included
    return place(code.co_filename, code.co_name, frame.f_lineno)


@functools.lru_cache(maxsize=4096)
def place(fn: str, name: str, line: int) -> str:
    """How a user reads a place in their code: a notebook cell's line, else file:line, and the function."""
    at = f"line {line} of the cell" if _CELL.search(fn) else f"{os.path.basename(fn)}:{line}"
    return at if name == "<module>" else f"{at} in {name}()"


def where(frame=None) -> str | None:
    """The user's code ``frame`` (default: the caller's) is in: the innermost frame outside meshviz, torch and the
    standard library, as ``"line 3 of the cell"`` or ``"train.py:12 in step()"``."""
    f = sys._getframe(1) if frame is None else frame
    while f is not None:
        if not internal(f.f_code.co_filename):
            return _format(f)
        f = f.f_back
    return None


# -- reading a record from another thread ------------------------------------------------------------------------

_C10D_OPS = {  # torch.distributed functions a blocked rank can be inside without the comm layer knowing
    "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier", "send", "recv",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "monitored_barrier",
}


def _frame_of(rec: Record):
    ident = rec.thread if rec.thread is not None else threading.main_thread().ident
    return sys._current_frames().get(ident)


def _in_backward(frame) -> bool:
    f = frame
    while f is not None:
        if f.f_code.co_name in ("_engine_run_backward", "run_backward") and "autograd" in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


def _in_cell(frame) -> bool:
    """Is a notebook cell running (one executed silently fires no cell hooks)?"""
    f = frame
    while f is not None:
        if _CELL.search(f.f_code.co_filename):
            return True
        f = f.f_back
    return False


def _torch_collective(frame):
    """(op, group ranks) of a torch.distributed collective the stack is inside, else None."""
    f = frame
    while f is not None:
        if f.f_code.co_name in _C10D_OPS and f.f_code.co_filename.endswith("distributed_c10d.py"):
            group = None
            try:
                import torch.distributed as tdist

                pg = f.f_locals.get("group")
                group = tuple(tdist.get_process_group_ranks(pg if pg is not None else tdist.group.WORLD))
            except Exception:
                pass
            return f.f_code.co_name, group
        f = f.f_back
    return None


def _signature(tensors):
    shapes, dtypes = [], []
    for t in tensors or ():
        try:
            shapes.append(tuple(t.shape))
            dtypes.append(str(t.dtype).replace("torch.", ""))
        except Exception:
            pass
    return (tuple(shapes), tuple(dtypes)) if shapes else (None, None)


def _works_pending(works) -> bool:
    try:
        return not all(w.is_completed() for w in works)
    except Exception:
        return False


def snapshot(rec: Record | None = None, stacks: bool = False) -> RankStatus:
    """The roll-call answer of ``rec`` (default: this rank's), safe to take from any thread while the rank is
    blocked; ``stacks`` adds the rank's Python stack."""
    rec = current() if rec is None else rec
    now = _monotonic()
    frame = _frame_of(rec)
    op = rec.op
    fields = {}
    if op is not None:
        group, seq, since, tensors, nbytes = rec.group, rec.seq, rec.since, rec.tensors, rec.nbytes
        shapes, dtypes = _signature(tensors)
        if nbytes is None and tensors:
            try:
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
            except Exception:
                nbytes = None
        fields = dict(state="in_collective", op=op, group=tuple(group), seq=seq, waiting_s=round(now - since, 3),
                      bytes=nbytes, shapes=shapes, dtypes=dtypes)
    elif rec.region is not None and frame is not None and _in_backward(frame):
        rop, group, note, since = rec.region
        fields = dict(state="in_collective", op=rop, group=tuple(group), waiting_s=round(now - since, 3), note=note)
    elif rec.works is not None and _works_pending(rec.works[4]):
        wop, group, seq, since, _ = rec.works
        fields = dict(state="in_collective", op=wop, group=tuple(group), seq=seq, waiting_s=round(now - since, 3),
                      note="issued, not finished on the device")
    else:
        found = _torch_collective(frame) if frame is not None else None
        running = rec.running or (frame is not None and _in_cell(frame))
        if found is not None and running:
            fields = dict(state="in_collective", op=found[0], group=found[1], note="called through torch")
        elif running:
            fields = dict(state="running")
        else:
            fields = dict(state="idle", note=rec.idle_note)
    if fields["state"] in ("in_collective", "running") and frame is not None:
        fields["where"] = where(frame)
    if stacks and frame is not None:
        fields["stack"] = "".join(traceback.format_stack(frame)[-40:])
    fields.update(refusal(rec))
    rank = rec.rank if rec.rank is not None else _env_rank()
    entered = tuple(sorted(dict(rec.entered).items()))  # a copy first: the rank may enter a group meanwhile
    return RankStatus(rank=rank, cell=rec.cell or None, entered=entered, **fields)


def _env_rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
