"""Every process-wide patch rank threads need (c10d worlds, shared DTensor decisions, time.sleep, RNGs, stdout)."""

from __future__ import annotations

import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from .. import rank_context
from ..rank_context import current

__all__ = ["CaptureState", "Generators", "capture", "install", "joined", "route_streams", "uninstall",
           "unroute_streams"]

# torch is imported when the patches go in, not here: the cluster's notebook side imports the stream routing
_installed = 0
_install_lock = threading.Lock()
_real_sleep = time.sleep
_here = None  # meshviz.ranks.baton.here, once installed
_excepthook = sys.excepthook  # the process's, kept from rank threads' init_process_group


def _sleep(seconds) -> None:
    b = _here()
    if b is None:
        return _real_sleep(seconds)
    b.nap(current().rank, seconds, _real_sleep)


def install() -> None:
    """Patch the process for rank threads (counted: the patches stay until the last :func:`uninstall`)."""
    global _installed, _here, _excepthook
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
            _here = here
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
