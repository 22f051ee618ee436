"""What one simulated rank holds: every storage its tensors allocate, and which are parameters, gradients, state."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import compat, rank_context
from ..runtime.zero.engine import STEP_OBSERVERS

__all__ = ["Held", "Ledger", "ledger", "install_hooks", "remove_hooks"]


# -- what one rank holds ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Held:
    """One simulated rank's memory, in bytes: ``params``, ``grads`` and ``optimizer`` state as its modules and
    optimizers hold them, ``activations`` (the most of everything else alive at once from the first forward on)
    and ``peak`` (the most alive at any moment)."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    peak: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "peak": self.peak}


_PARAM, _GRAD, _OPT = 1, 2, 3  # a storage's kind; a parameter's storage stays one whatever else holds it


class Ledger:
    """Every storage one rank's tensors allocate, while it lives: the total, its peak, and which storages hold
    parameters, gradients and optimizer state (the rank's modules and optimizers say so at their hooks)."""

    def __init__(self) -> None:
        self.live: dict[int, list] = {}  # id(storage) -> [bytes, kind or 0]
        self.total = 0
        self.kept = 0  # live bytes of parameters, gradients and optimizer state
        self.peak = 0
        self.other_peak = 0
        self.stepping = False  # the first forward has begun: the rest is the step's
        self.modules: weakref.WeakSet = weakref.WeakSet()
        self.optimizers: weakref.WeakSet = weakref.WeakSet()
        self.n_params = 0
        self.grads = 0
        self.optimizer = 0

    # -- storages --------------------------------------------------------------------------------------------
    def _storage(self, t) -> tuple[int, Any] | None:
        local = _local(t)
        if local is None or local.device.type == "meta":
            return None
        st = local.untyped_storage()
        return id(st), st

    def saw(self, out) -> None:
        """An op returned ``out``: count the storages it made."""
        if isinstance(out, torch.Tensor):
            self._add(out)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    self._add(t)

    def _add(self, t, kind: int = 0) -> int:
        got = self._storage(t)
        if got is None:
            return 0
        key, st = got
        entry = self.live.get(key)
        if entry is None:
            n = st.nbytes()
            entry = self.live[key] = [n, 0]
            weakref.finalize(st, self._freed, key)
            self.total += n
            if self.total > self.peak:
                self.peak = self.total
            self._other()
        if kind and (entry[1] == 0 or kind < entry[1]):
            if entry[1] == 0:
                self.kept += entry[0]
            entry[1] = kind
            self._other()
        return key

    def _freed(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.total -= entry[0]
            if entry[1]:
                self.kept -= entry[0]

    def _other(self) -> None:
        if self.stepping:
            other = self.total - self.kept
            if other > self.other_peak:
                self.other_peak = other

    # -- what the rank's modules and optimizers hold -------------------------------------------------------------
    def params(self) -> list:
        out, seen = [], set()
        for m in list(self.modules):
            for p in m._parameters.values():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        for opt in list(self.optimizers):
            for g in opt.param_groups:
                for p in g["params"]:
                    if id(p) not in seen:
                        seen.add(id(p))
                        out.append(p)
        return out

    def _sum(self, tensors, kind: int, skip: set) -> tuple[int, set]:
        keys = set()
        for t in tensors:
            key = self._add(t, kind)
            if key and key not in skip:
                keys.add(key)
        return sum(self.live[k][0] for k in keys if k in self.live), keys

    def _state_tensors(self):
        for opt in list(self.optimizers):
            for st in opt.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        yield v

    def tag_params(self, params) -> set:
        return self._sum(params, _PARAM, set())[1]

    def sample(self, grads: bool = True, state: bool = True) -> None:
        """Count what the rank's parameters, their gradients and (``state``) its optimizers' state hold now;
        each keeps the most it reached."""
        params = self.params()
        n, keys = self._sum(params, _PARAM, set())
        self.n_params = max(self.n_params, n)
        if grads:
            n, more = self._sum([p.grad for p in params if p.grad is not None], _GRAD, keys)
            self.grads = max(self.grads, n)
            keys |= more
        if state:
            n, _ = self._sum(list(self._state_tensors()), _OPT, keys)
            self.optimizer = max(self.optimizer, n)

    def begin_step(self) -> None:
        if not self.stepping:
            self.sample(grads=False, state=False)
            self.stepping = True
            self._other()

    def held(self) -> Held:
        """The rank's numbers once its function returned: each of params, grads and optimizer the most it held
        when an optimizer step began or ended, when the first forward began, and at the end."""
        self.sample()
        return Held(params=self.n_params, grads=self.grads, optimizer=self.optimizer, activations=self.other_peak,
                    peak=self.peak)


def _local(t):
    """The plain tensor that owns ``t``'s storage (a dist tensor's block, a DTensor's local tensor)."""
    if t is None:
        return None
    local = getattr(t, "_local", None)  # a dist tensor's block (asking for its DTensor would build one)
    if isinstance(local, torch.Tensor):
        return local
    return compat.dtensor_local(t) if isinstance(t, DTensor) else t


@dataclass
class SimState:
    ledger: Ledger | None = None  # set on a simulated rank while its function runs


SIM = rank_context.slot("simulated", SimState)


def ledger() -> Ledger | None:
    """The calling simulated rank's ledger (None elsewhere)."""
    return SIM.get().ledger


# -- the hooks that tell a rank's ledger what its modules and optimizers hold (process-wide; no-ops elsewhere) ----

def _on_param(module, name, param):
    led = ledger()
    if led is not None:
        led.modules.add(module)
        if param is not None:
            led._add(param, _PARAM)


def _on_forward(module, args):
    led = ledger()
    if led is not None:
        led.modules.add(module)
        if not led.stepping:
            led.begin_step()
        else:
            led.tag_params(p for p in module._parameters.values() if p is not None)


def _on_step_pre(opt, args, kwargs):
    led = ledger()
    if led is not None:
        led.optimizers.add(opt)
        led.begin_step()
        led.sample(state=False)


def _on_sharded_step(opt):
    """A sharded optimizer's step begins: the gradients are still whole (its torch optimizer's own step, whose
    pre-hook samples too, sees them sharded)."""
    led = ledger()
    if led is not None:
        led.begin_step()
        led.sample(state=False)


def _on_step_post(opt, args, kwargs):
    led = ledger()
    if led is not None:
        led.optimizers.add(opt)
        led.sample()


_hooks: list = []
_hooks_lock = threading.Lock()
_users = [0]


def install_hooks() -> None:
    """Put the module and optimizer hooks in (counted: they stay until the last :func:`remove_hooks`)."""
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim

    with _hooks_lock:
        if _users[0] == 0:
            STEP_OBSERVERS.append(_on_sharded_step)
            _hooks.extend([nn_module.register_module_parameter_registration_hook(_on_param),
                           nn_module.register_module_forward_pre_hook(_on_forward),
                           optim.register_optimizer_step_pre_hook(_on_step_pre),
                           optim.register_optimizer_step_post_hook(_on_step_post)])
        _users[0] += 1


def remove_hooks() -> bool:
    """Take one user's hooks out; True when it was the last (the hooks are gone)."""
    with _hooks_lock:
        _users[0] -= 1
        if _users[0] == 0:
            for h in _hooks:
                h.remove()
            _hooks.clear()
            STEP_OBSERVERS.remove(_on_sharded_step)
            return True
        return False
