"""Which nn.Module is running: global module hooks that keep each rank's module stack, so that a traced collective
names the module whose forward or backward issued it (installed only while tracing is on)."""

from __future__ import annotations

import weakref

import torch
from torch.nn.modules import module as _nn

from .. import compat, trace
from . import rollcall

__all__ = ["module_name", "installed"]

_WRAPPERS = {"DataParallel", "DistributedDataParallel", "OptimizedModule", "FullyShardedDataParallel"}
_SKIP = {"module", "_layers", "_orig_mod", "_fsdp_wrapped_module", "_ddp"}  # wrappers' own attribute names
_names: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_handles: list = []


def module_name(module, parent: str | None = None, parent_module=None) -> str:
    """A module's name: its class at the top (``"MLP"``), else its parent's name and its path below it
    (``"MLP.fc1"``), wrappers' own attributes left out (``DataParallel(net).fc1`` is ``"DataParallel.fc1"``)."""
    name = _names.get(module)
    if name is not None:
        return name
    if parent is None:
        name = type(module).__name__
    else:
        path = None
        if parent_module is not None:
            for p, m in parent_module.named_modules():
                if m is module:
                    path = p
                    break
        if path is None:  # not below the running module (a wrapper's inner copy): it stands for the parent
            name = parent
        else:
            parts = [x for x in path.split(".") if x not in _SKIP or type(parent_module).__name__ not in _WRAPPERS]
            name = ".".join([parent] + parts) if parts else parent
    try:
        _names[module] = name
    except TypeError:
        pass
    return name


def _pre(module, args):
    rec = rollcall.current()
    stack = rec.modules
    top = stack[-1] if stack else None
    name = _names.get(module) or module_name(module, top[0] if top else None, top[1]() if top else None)
    stack.append((name, weakref.ref(module)))


def _post(module, args, output):
    rec = rollcall.current()
    if rec.modules:
        name = rec.modules.pop()[0]
    else:
        return
    if torch.is_grad_enabled():
        outs = output if isinstance(output, (tuple, list)) else (output,)
        for t in outs:
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                try:
                    t.register_hook(_backward_of(name, rec))
                except Exception:
                    pass
                break


def _backward_of(name: str, rec):
    def hook(grad):
        if rec.backward_module is None:  # the first module's backward: forget it when the whole backward ends
            try:
                compat.queue_backward_callback(lambda: setattr(rec, "backward_module", None))
            except Exception:
                pass
        rec.backward_module = name
    return hook


def installed() -> bool:
    return bool(_handles)


def _switch(on: bool) -> None:
    if on and not _handles:
        _handles.append(_nn.register_module_forward_pre_hook(_pre))
        _handles.append(_nn.register_module_forward_hook(_post, always_call=True))
    elif not on and _handles:
        for h in _handles:
            h.remove()
        _handles.clear()


trace.on_active(_switch)
