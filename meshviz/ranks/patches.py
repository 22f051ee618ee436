"""Every process-wide patch ranks need (c10d worlds, DTensor decisions, time.sleep, RNGs, stdout, threads, tdist)."""

from __future__ import annotations

import functools
import inspect
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import rank_context
from ..rank_context import current

__all__ = ["CaptureState", "Generators", "capture", "follow_threads", "install", "joined", "record_torch_calls",
           "record_torch_calls_when_watched", "route_streams", "unfollow_threads", "uninstall", "unrecord_torch_calls",
           "unroute_streams"]

# torch is imported when the patches go in, not here: the cluster's notebook side imports the stream routing
_installed = 0
_install_lock = threading.Lock()
_real_sleep = time.sleep
_here = None  # meshviz.ranks.baton.here, once installed
_compiling = None  # meshviz.compat.compiling, once installed
_excepthook = sys.excepthook  # the process's, kept from rank threads' init_process_group


def _sleep(seconds) -> None:
    b = _here()
    if b is None or _compiling():  # a rank holding torch.compile's lock keeps the baton: the others would block on it
        return _real_sleep(seconds)
    b.nap(current().rank, seconds, _real_sleep)


def install() -> None:
    """Patch the process for rank threads (counted: the patches stay until the last :func:`uninstall`)."""
    global _installed, _here, _excepthook, _compiling
    from .. import compat
    from ..backends import threads as thread_backend
    from .baton import here

    with _install_lock:
        if _installed == 0:
            # its collectives take the world's group as a default bound at import: imported in a rank thread,
            # every rank would use that rank's group (and keep its world alive); here it binds None, the caller's
            import torch.distributed.nn.functional  # noqa: F401

            compat.install_thread_worlds()
            compat.share_dtensor_decisions(rank_context.in_rank_thread)
            thread_backend.register()
            _here, _compiling = here, compat.compiling
            _excepthook = sys.excepthook
            time.sleep = _sleep
        _installed += 1


def uninstall() -> None:
    global _installed
    from .. import compat

    with _install_lock:
        _installed -= 1
        if _installed == 0:
            time.sleep = _real_sleep
            sys.excepthook = _excepthook
            compat.share_dtensor_decisions(None)
            compat.uninstall_thread_worlds()


def joined() -> None:
    """After a rank thread's ``init_process_group``: torch made the process's excepthook prefix every traceback with
    that one rank's number (``[rank1]: [rank0]: ...`` once each rank has joined); the process's own hook is back."""
    sys.excepthook = _excepthook


# -- sys.stdout and sys.stderr ------------------------------------------------------------------------------------

@dataclass
class CaptureState:
    out: Any = None  # where this rank thread's output goes now: an object with ``stdout`` and ``stderr`` lists


CAPTURE = rank_context.slot("capture", CaptureState)


def capture() -> CaptureState:
    """The calling rank thread's capture (``out`` None: its writes go where everyone else's go)."""
    return CAPTURE.get()


class _Router:
    """Stands in for ``sys.stdout`` / ``sys.stderr``: a rank thread's writes go to its capture's output, all
    others to the stream it replaced."""

    def __init__(self, name: str, fallback):
        self._name = name
        self._fallback = fallback

    def write(self, text) -> int:
        out = capture().out
        if out is None:
            return self._fallback.write(text)
        getattr(out, self._name).append(str(text))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if capture().out is None:
            self._fallback.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._fallback, name)


def route_streams() -> None:
    """Make sure ``sys.stdout`` and ``sys.stderr`` route rank threads' writes (whatever replaced them since)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, _Router):
            setattr(sys, name, _Router(name, stream))


def unroute_streams() -> None:
    """``sys.stdout`` and ``sys.stderr`` as they were before :func:`route_streams`."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, _Router):
            setattr(sys, name, stream._fallback)


# -- the RNGs -----------------------------------------------------------------------------------------------------


class Generators:
    """torch's CPU generator, numpy's and Python's global ones are process-wide; each rank (and the process itself,
    outside rank code) gets its own, switched in when the baton reaches it. A rank starts where a fresh process
    starts (torch's default seed; numpy and Python seeded from the OS).

    torch's state is saved and restored (a 5 KB copy, under a microsecond). numpy's and Python's module functions
    (``np.random.rand``, ``random.random``, ...) are bound methods of one global instance, whose state is slow to
    copy (about 30 µs); each rank gets an instance of its own and the module names are rebound to it instead
    (``from numpy.random import rand`` taken earlier keeps the process's instance).
    """

    def __init__(self):
        import numpy as np
        import torch
        from numpy.random import mtrand

        self._np, self._torch = np, torch
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
        torch = self._torch
        self.saved[self.owner] = torch.get_rng_state()
        st = self.saved.pop(to, None)
        torch.set_rng_state(st if st is not None else torch.Generator().get_state())
        mods = self._mods.get(to)
        if mods is None:
            mods = self._mods[to] = self._bindings(self._np.random.RandomState(), random.Random())
        np_rs, np_funcs, py_funcs = mods
        self._np.random.__dict__.update(np_funcs)
        self._mtrand.__dict__.update(np_funcs)
        self._mtrand._rand = np_rs  # what np.random.seed, ranf and sample call
        random.__dict__.update(py_funcs)
        self.owner = to


# -- threads a rank's code starts ---------------------------------------------------------------------------------

_real_start = threading.Thread.start
_follow: Callable | None = None  # follow(out): where a thread started under a rank's capture ``out`` writes, or None


def _start(self: threading.Thread) -> None:
    """``Thread.start`` while :func:`follow_threads` holds: a thread a rank thread starts writes where the hook says
    (the rank's output, as on an engine). Not a pool's worker (concurrent.futures): it runs whoever's tasks."""
    follow, to = _follow, None
    if follow is not None and rank_context.in_rank_thread() and capture().out is not None \
            and getattr(getattr(self, "_target", None), "__module__", "") != "concurrent.futures.thread":
        to = follow(capture().out)
    if to is not None:
        ctx = rank_context.RankContext(env=current().env)
        with rank_context.bound(ctx):
            capture().out = to
        run = self.run

        def run_as_started():
            with rank_context.bound(ctx):
                try:
                    run()
                except SystemExit:
                    pass
                except BaseException:  # reported here, so that the report goes where the thread's output goes
                    threading.excepthook(threading.ExceptHookArgs((*sys.exc_info(), self)))  # type: ignore
                finally:
                    getattr(to, "flush", lambda: None)()

        self.run = run_as_started  # type: ignore[method-assign]
    _real_start(self)


def follow_threads(follow: Callable) -> None:
    """Threads that rank threads start write where ``follow(out)`` says (``out``: the starting rank's capture; it
    returns the thread's capture ``out``, with an optional ``flush()`` called when the thread ends, or None to leave
    the thread alone). Until :func:`unfollow_threads`."""
    global _follow
    _follow = follow
    threading.Thread.start = _start  # type: ignore[method-assign]


def unfollow_threads() -> None:
    """``Thread.start`` as it was (unless something patched it since)."""
    global _follow
    _follow = None
    if threading.Thread.start is _start:
        threading.Thread.start = _real_start  # type: ignore[method-assign]


# -- torch.distributed called directly on a rank process ----------------------------------------------------------

# the torch.distributed functions that block until their peers come, and the argument holding the tensor they pass
_TORCH_CALLS = {
    "all_reduce": "tensor", "all_gather": "tensor", "all_gather_into_tensor": "input_tensor", "broadcast": "tensor",
    "reduce": "tensor", "reduce_scatter": "output", "reduce_scatter_tensor": "input", "all_to_all": None,
    "all_to_all_single": "input", "gather": "tensor", "scatter": "tensor", "barrier": None, "send": "tensor",
    "recv": "tensor", "all_gather_object": None, "broadcast_object_list": None, "gather_object": None,
    "scatter_object_list": None, "monitored_barrier": None,
}
_torch_real: dict[str, Callable] = {}  # name -> torch's function, while recorded


def _peer(name: str, args: dict, ranks: list[int]) -> int | None:
    """The global rank a send or recv pairs with (None: any)."""
    key = "dst" if name == "send" else "src"
    peer = args.get(key)
    if peer is None and args.get(f"group_{key}") is not None:
        peer = ranks[int(args[f"group_{key}"])]
    return None if peer is None else int(peer)


def _call_of(name: str, params: tuple, args, kwargs):
    """(group ranks, tensors) of a blocking call ``name(*args, **kwargs)`` (``params``: its parameters' names), or
    None: an async call, or one not understood."""
    import torch
    import torch.distributed as tdist

    try:
        bound = dict(zip(params, args), **kwargs)  # a missing one is at its default: None (async_op: False)
        if bound.get("async_op"):
            return None
        group = bound.get("group")
        ranks = list(tdist.get_process_group_ranks(group if group is not None else tdist.group.WORLD))
        if name in ("send", "recv"):
            peer = _peer(name, bound, ranks)
            if peer is not None:
                ranks = sorted({tdist.get_rank(), peer})
        arg = _TORCH_CALLS[name]
        tensor = bound.get(arg) if arg else None
        return tuple(ranks), [tensor] if isinstance(tensor, torch.Tensor) else []
    except Exception:
        return None


def _recorded(name: str, fn):
    from ..runtime import rollcall

    params = tuple(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        rec = rollcall.current()
        if rec.op is not None or threading.get_ident() != (rec.thread or threading.main_thread().ident):
            return fn(*args, **kwargs)  # inside meshviz's own collective (recorded), or not the rank's thread
        what = _call_of(name, params, args, kwargs)
        if what is None:
            return fn(*args, **kwargs)
        prev = rec.enter(name, what[0], what[1], counted=False)
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            rec.fail(e)
            raise
        finally:
            rec.leave(prev)

    return call


def record_torch_calls() -> None:
    """On a rank process (an engine): a collective or receive called on ``torch.distributed`` directly enters the
    rank's roll-call record while it waits, as meshviz's own do (with no number: the comm layer numbers its own
    calls), so the roll-call shows it and a failure out of it names it. Until :func:`unrecord_torch_calls`."""
    import torch.distributed as tdist
    from torch.distributed import distributed_c10d

    with _install_lock:
        if _torch_real:
            return
        for name in _TORCH_CALLS:
            fn = getattr(distributed_c10d, name, None)
            if fn is None:
                continue
            _torch_real[name] = fn
            wrapped = _recorded(name, fn)
            for module in (tdist, distributed_c10d):
                if getattr(module, name, None) is fn:
                    setattr(module, name, wrapped)


def record_torch_calls_when_watched(env) -> None:
    """:func:`record_torch_calls` on a rank process whose roll-call is watched (``MESHVIZ_HANG_AFTER`` set in
    ``env``: spawn, launch and run_ranks' processes set it)."""
    if env.get("MESHVIZ_HANG_AFTER"):
        record_torch_calls()


def unrecord_torch_calls() -> None:
    """``torch.distributed``'s functions as they were."""
    import torch.distributed as tdist
    from torch.distributed import distributed_c10d

    with _install_lock:
        for name, fn in _torch_real.items():
            for module in (tdist, distributed_c10d):
                if getattr(getattr(module, name, None), "__wrapped__", None) is fn:
                    setattr(module, name, fn)
        _torch_real.clear()
