"""The ZeRO step every layout shares: reduce gradients to their owners, clip, step the owned part, gather."""

from __future__ import annotations

import weakref

import torch

__all__ = ["Zero", "check_elementwise", "clear_grads", "create_states", "is_fresh_state", "settle_states",
           "watch_zero_grad", "watch_grad_assign", "set_grad_quietly", "ModelHook", "STEP_OBSERVERS"]

# called with the optimizer as each sharded step begins (what_if's ledger counts the full gradients there)
STEP_OBSERVERS: list = []


# torch's optimizers whose update of a parameter reads all of it (a factored or orthogonalised update, a line
# search): stepped on a rank's part they give other values than the dense step
WHOLE_TENSOR_UPDATES = ("LBFGS", "Adafactor", "Muon")


def check_elementwise(optimizer, who: str) -> None:
    """Refuse an optimizer whose update is not elementwise where each rank steps only its part of a parameter."""
    hit = [c.__name__ for c in type(optimizer).__mro__ if c.__name__ in WHOLE_TENSOR_UPDATES]
    if hit:
        raise ValueError(f"{who}: torch.optim.{hit[0]} updates each parameter from all of it, but here each rank "
                         f"steps only its part of the parameters, which would give other values than the dense step "
                         f"(Paddle's shard_optimizer takes SGD and AdamW only); use an elementwise optimizer (SGD, "
                         f"Adam, AdamW, ...) or keep the parameters whole (Replicate, no sharding stage)")


def clear_grads(tensors, set_to_none: bool = True) -> None:
    """torch's ``zero_grad`` over ``tensors``: each gradient dropped, or (``set_to_none=False``) zeroed in place."""
    for t in tensors:
        if t.grad is None:
            continue
        if set_to_none:
            t.grad = None
            continue
        if t.grad.grad_fn is not None:
            t.grad.detach_()
        else:
            t.grad.requires_grad_(False)
        t.grad.zero_()


class _ZeroGradWatch:
    """A module's ``zero_grad`` that, after the module's own, calls each listener with the module and
    ``set_to_none``; a copy or pickle of the module gets it without listeners (a plain ``zero_grad`` again)."""

    def __init__(self, module, listeners=()):
        self.module = weakref.ref(module)
        self.listeners = list(listeners)

    def __call__(self, set_to_none: bool = True) -> None:
        module = self.module()
        type(module).zero_grad(module, set_to_none)
        for listen in self.listeners:
            listen(module, set_to_none)

    def __deepcopy__(self, memo):
        module = self.module()
        return _ZeroGradWatch(memo.get(id(module), module))

    def __reduce__(self):
        return _ZeroGradWatch, (self.module(),)


class ModelHook:
    """A hook on the model that calls ``fn``; in a copy or pickle of the model it does nothing (the copy is not
    sharded, and ``copy.deepcopy`` would otherwise copy the sharded optimizer and its process groups)."""

    def __init__(self, fn=None):
        self.fn = fn

    def __call__(self, *args):
        return None if self.fn is None else self.fn(*args)

    def __deepcopy__(self, memo):
        return ModelHook()

    def __reduce__(self):
        return ModelHook, ()


def watch_zero_grad(model, listen) -> None:
    """Call ``listen(module, set_to_none)`` after ``zero_grad`` of ``model`` or of any module in it: gradients a
    sharded optimizer keeps apart from the parameters' (freed after backward) are cleared with them."""
    for m in model.modules():
        watch = m.__dict__.get("zero_grad")
        if not isinstance(watch, _ZeroGradWatch):
            watch = _ZeroGradWatch(m)
            m.zero_grad = watch
        watch.listeners.append(listen)


_GRAD_LISTENERS: dict = {}  # id(parameter) -> (a weak reference to it, a weak reference to what to call)
_WATCHED: dict = {}  # a parameter class -> its subclass whose ``.grad`` assignments are seen


def set_grad_quietly(p, value) -> None:
    """``p.grad = value`` without telling the listener :func:`watch_grad_assign` gave ``p``."""
    torch.Tensor.grad.__set__(p, value)


def _set_grad(p, value) -> None:
    set_grad_quietly(p, value)
    hit = _GRAD_LISTENERS.get(id(p))
    listen = hit[1]() if hit is not None and hit[0]() is p else None
    if listen is not None:
        listen(p)


def watch_grad_assign(p, listen) -> None:
    """Call ``listen(p)`` after each assignment to (or deletion of) ``p.grad`` in Python (``p.grad = None`` by
    hand, ``zero_grad``), not after backward's accumulation: a sharded optimizer that keeps reduced gradients apart
    from the parameters' drops them with it. ``p`` becomes an instance of a subclass of its class (the same class
    name) that sees them; a copy or pickle of ``p`` tells no one."""
    cls = type(p)
    if cls not in _WATCHED.values():
        sub = _WATCHED.get(cls)
        if sub is None:
            grad = property(torch.Tensor.grad.__get__, _set_grad, lambda t: _set_grad(t, None),
                            doc=torch.Tensor.grad.__doc__)
            sub = _WATCHED[cls] = type(cls.__name__, (cls,), {"grad": grad, "__module__": cls.__module__})
        p.__class__ = sub
    for key in [k for k, (ref, _) in _GRAD_LISTENERS.items() if ref() is None]:
        del _GRAD_LISTENERS[key]
    _GRAD_LISTENERS[id(p)] = (weakref.ref(p), weakref.WeakMethod(listen))


@torch.no_grad()
def create_states(optimizer, params) -> None:
    """Make ``optimizer``'s states as its first step would, leaving the parameters as they are: one step on zero
    gradients of ``params`` at learning rate 0 (as Paddle's ``state_dict`` does before training, so that a
    checkpoint can be loaded into them). Nothing happens once the states exist or a gradient does.

    The step is taken without weight decay and its count is set back to 0, so the states read as before any step
    (zero moments for SGD and the Adam family). Unless something is loaded into them (in place, or by
    ``load_state_dict``) before the next step, that step drops them and starts afresh, as the same training without
    ``state_dict()`` would (a product such as NAdam's ``mu_product`` has moved)."""
    params = [p for p in params if p.requires_grad]
    if optimizer.state or any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    kept = [{k: g[k] for k in ("lr", "weight_decay") if g.get(k) is not None} for g in optimizer.param_groups]
    for g, was in zip(optimizer.param_groups, kept):  # zero gradients then leave zero moments (no L2 decay)
        g.update({k: torch.zeros_like(v) if torch.is_tensor(v) else 0.0 for k, v in was.items()})
    try:
        optimizer.step()
    finally:
        for g, was in zip(optimizer.param_groups, kept):
            g.update(was)
        optimizer.zero_grad(set_to_none=True)
    for st in _torch_optimizer(optimizer).state.values():  # as no step was taken (a checkpoint of them says so)
        step = st.get("step")
        if torch.is_tensor(step):
            step.zero_()
        elif isinstance(step, (int, float)):
            st["step"] = type(step)(0)
    _forget_unless_loaded(optimizer)


def _torch_optimizer(optimizer):
    while "_inner_opt" in getattr(optimizer, "__dict__", {}):
        optimizer = optimizer._inner_opt
    return optimizer


def _version(v) -> int:
    """A state tensor's version, its block's for a dist tensor (a load in place writes the block)."""
    block = getattr(v, "_local", None)
    if block is None:
        block = getattr(v, "_local_tensor", None)
    return (v if block is None else block)._version


def _fingerprint(state) -> list:
    return [(id(p), k, id(v), _version(v) if torch.is_tensor(v) else repr(v))
            for p, st in state.items() for k, v in st.items()]


_FRESH: dict = {}  # id(state tensor) -> (a weak reference to it, its version when create_states made it)


def is_fresh_state(t) -> bool:
    """Whether ``t`` is a state :func:`create_states` made that nothing was written into since."""
    hit = _FRESH.get(id(t))
    return hit is not None and hit[0]() is t and _version(t) == hit[1]


def _forget_unless_loaded(optimizer) -> None:
    inner = _torch_optimizer(optimizer)
    for key in [k for k, (ref, _) in _FRESH.items() if ref() is None]:
        del _FRESH[key]
    for st in inner.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                _FRESH[id(v)] = (weakref.ref(v), _version(v))
    if isinstance(inner, torch.optim.Optimizer):
        inner._meshviz_made = (inner.state, _fingerprint(inner.state),
                               inner.register_step_pre_hook(lambda opt, args, kwargs: settle_states(opt)))


def settle_states(optimizer) -> None:
    """Before the first step after :func:`create_states`: drop the states it made unless something was loaded into
    them (called by the step itself, and first by a step that stands blocks in for the states)."""
    made = optimizer.__dict__.pop("_meshviz_made", None)
    if made is None:
        return
    state, fingerprint, handle = made
    handle.remove()
    if optimizer.state is state and _fingerprint(state) == fingerprint:
        state.clear()


class Zero(torch.optim.Optimizer):
    """A torch optimizer (``inner``) whose ``param_groups`` hold only what this rank owns at ``level``.

    ``level``: ``"os"`` (optimizer states sharded), ``"os_g"`` (and gradients), ``"p_g_os"`` (and parameters),
    or None (nothing sharded). A layout says who owns what and how the shards move: ``_prepare`` (before the
    gradients are read), ``_sync_grads`` (every gradient reduced to the rank that steps it), ``_clip``,
    ``_inner_step`` and ``_gather`` (the stepped shards back into the parameters the model uses).

    It is a ``torch.optim.Optimizer`` so that torch's LR schedulers take it (they set the inner optimizer's
    ``param_groups``' learning rates); what torch's base class would do on its own state goes to the inner one.
    """

    def __init__(self, inner, level):  # torch's __init__ is not called: the inner optimizer holds the state
        self._inner_opt = inner
        self.level = level

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state):
        self.__dict__.update(state)

    def state_dict(self):
        return self._inner_opt.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._inner_opt.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        raise NotImplementedError(f"{type(self).__name__}: parameters cannot be added once the optimizer is "
                                  f"sharded; build the torch optimizer with every parameter group first")

    def register_step_pre_hook(self, hook):
        return self._inner_opt.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):
        return self._inner_opt.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook, prepend: bool = False):
        return self._inner_opt.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook, prepend: bool = False):
        return self._inner_opt.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook, prepend: bool = False):
        return self._inner_opt.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook, prepend: bool = False):
        return self._inner_opt.register_load_state_dict_post_hook(hook, prepend)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._inner_opt!r}, level={self.level!r})"

    @property
    def param_groups(self):
        return self._inner_opt.param_groups

    def grad_params(self) -> list:
        """The parameters whose gradients backward fills: what a loss scaler unscales before ``step`` (the inner
        optimizer may step stand-ins, whose gradients are made from these inside ``step``)."""
        return [p for g in self._inner_opt.param_groups for p in g["params"]]

    def step(self, closure=None):
        for observe in STEP_OBSERVERS:  # before any gradient is reduced or sharded: what the rank holds now
            observe(self)
        self._prepare()
        loss = self._before_sync(closure)
        self._sync_grads()
        self._clip()
        out = self._inner_step(closure)
        self._gather()
        return loss if out is None else out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner_opt.zero_grad(set_to_none=set_to_none)

    # Paddle's optimizer methods, over the torch optimizer's param_groups
    def clear_grad(self, set_to_zero: bool = True) -> None:
        """Paddle's ``clear_grad``: every gradient zeroed in place (``set_to_zero=False``: dropped, as torch's
        ``zero_grad()``)."""
        self.zero_grad(set_to_none=not set_to_zero)

    def get_lr(self) -> float:
        """The learning rate (of the first parameter group), as Paddle's ``get_lr``."""
        return float(self._inner_opt.param_groups[0]["lr"])

    def set_lr(self, value: float) -> None:
        """Set every parameter group's learning rate, as Paddle's ``set_lr``."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"set_lr: the learning rate must be a number, got {type(value).__name__}")
        for g in self._inner_opt.param_groups:
            if torch.is_tensor(g["lr"]):  # a tensor learning rate (capturable, fused) stays one, as step() above
                g["lr"].fill_(float(value))
            else:
                g["lr"] = float(value)

    def minimize(self, loss, startup_program=None, parameters=None, no_grad_set=None):
        """Paddle's dygraph ``minimize``: one ``step()`` on the gradients ``loss.backward()`` left (call it first);
        returns ``(None, [(parameter, gradient), ...])``."""
        if parameters is not None or no_grad_set:
            raise ValueError("minimize: parameters and no_grad_set are not supported; every parameter the "
                             "optimizer holds is stepped (build the optimizer over the ones to update)")
        params_grads = [(p, p.grad) for p in self.grad_params() if p.grad is not None]
        self.step()
        return None, params_grads

    # the layout's parts; the defaults shard nothing
    def _prepare(self) -> None:
        pass

    def _before_sync(self, closure):
        return None

    def _sync_grads(self) -> None:
        pass

    def _clip(self):
        return None

    def _inner_step(self, closure):
        return self._inner_opt.step(closure) if closure is not None else self._inner_opt.step()

    def _gather(self) -> None:
        pass
