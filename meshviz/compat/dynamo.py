"""What torch.compile must leave to eager Python (Dynamo, torch 2.11-2.15)."""

from __future__ import annotations

import inspect

import torch

__all__ = ["eager", "eager_methods"]


def eager(fn):
    """``fn`` run eagerly under torch.compile, as ``torch.compiler.disable(fn)``, with Dynamo imported at its first
    call rather than now: importing Dynamo costs about a second of CPU, which a process that never compiles (a
    worker that only runs collectives, an engine) need not pay at ``import meshviz.distributed``. torch's own
    lazy form (``torch._compile`` is a module Dynamo skips: the call runs eagerly from a compiled frame too)."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if lazy is not None else torch.compiler.disable(fn)


def eager_methods(cls: type) -> type:
    """Class decorator: the public methods ``cls`` defines or inherits from a Python base, and those overriding a
    torch base's (``_get_backend``), run eagerly under torch.compile. c10d calls a Python process group's methods
    from C++, in the eager part of a compiled function too, where each is a frame of its own to Dynamo, which
    cannot trace a process group (an opaque object from torch 2.13 on: "UnsafeScriptObjectError"; on 2.11 its
    guards fail on what the method reads)."""
    python = [k for k in cls.__mro__ if not k.__module__.startswith(("torch", "builtins"))]
    native = {n for k in cls.__mro__ if k not in python for n in vars(k)}  # a C++ method one may override
    for name in sorted({n for k in python for n in vars(k)}):
        fn = inspect.getattr_static(cls, name)
        if (not name.startswith("_") or name in native and not name.startswith("__")) and inspect.isfunction(fn):
            setattr(cls, name, eager(fn))
    return cls
