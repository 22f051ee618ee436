"""The process-wide patches ranks as threads need (per-thread c10d worlds, time.sleep, RNG switching)."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import torch

from .. import compat
from ..backends import threads as thread_backend
from ..rank_context import current
from . import baton

__all__ = ["Generators", "install", "uninstall"]

_installed = 0
_install_lock = threading.Lock()
_real_sleep = time.sleep


def _sleep(seconds) -> None:
    b = baton.here()
    if b is None:
        return _real_sleep(seconds)
    b.nap(current().rank, seconds, _real_sleep)


def install() -> None:
    """Patch the process for rank threads (counted: the patches stay until the last :func:`uninstall`)."""
    global _installed
    with _install_lock:
        if _installed == 0:
            compat.install_thread_worlds()
            thread_backend.register()
            time.sleep = _sleep
        _installed += 1


def uninstall() -> None:
    global _installed
    with _install_lock:
        _installed -= 1
        if _installed == 0:
            time.sleep = _real_sleep
            compat.uninstall_thread_worlds()


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
