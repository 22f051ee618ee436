"""Paddle's LazyGuard for torch modules: built without memory, each tensor given its eager values by initialize()."""

from __future__ import annotations

import copyreg
import sys
import threading
import types
import weakref

import torch

__all__ = ["LazyGuard"]

_tls = threading.local()  # .guards: the guards open in this thread, innermost last; .paused: rebuilding
_lock = threading.Lock()
_installed = False
_UNPICKLING = {copyreg.__newobj__.__code__, copyreg.__newobj_ex__.__code__}  # type: ignore[attr-defined]


class LazyGuard:
    """Modules built inside hold no memory (the meta device) and draw nothing from the RNG; then
    ``for p in model.parameters(): p.initialize()`` gives every parameter, in any order and keeping the object,
    exactly the values an eager build under the same seed gives (buffers come with the first one).

    Each outermost module built inside is recorded with its constructor's arguments and the RNG state it starts
    from; ``initialize()`` builds it again, eagerly, once, leaving the global RNG as it was, and takes its
    tensors' values (a later model, in this guard or a later one, starts where the earlier one's eager build leaves
    the RNG, unless the RNG drew or was seeded between them, even to the same seed). A parameter that
    ``shard_tensor``, ``shard_layer`` or ``parallelize`` made dist before ``initialize()`` gets its rank's block of
    those values, as its placements say. A tensor created in the guard outside a module's constructor is on the
    meta device too (in Paddle it holds values), so a model made from one has no eager values to take.

    Where Paddle differs: its ``initialize()`` draws from the global RNG when called (so only build order under
    the build's seed gives the eager values), and a dist parameter's block is drawn on its own, from a stream
    per rank and placements. At the first ``initialize()``, if the global RNG is still where the guard left it,
    it is moved to where the eager build leaves it, as Paddle's ``initialize()`` calls in build order move it.
    """

    def __enter__(self) -> None:
        _install()
        rec = _Guard()
        _guards().append(rec)
        rec.meta.__enter__()

    def __exit__(self, *exc) -> None:
        rec = _guards().pop()
        rec.meta.__exit__(*exc)
        rec.close(exc[0] is None)


# -- recording what the guard builds ------------------------------------------------------------------------


def _guards() -> list:
    st = getattr(_tls, "guards", None)
    if st is None:
        st = _tls.guards = []
    return st


def _active() -> _Guard | None:
    if getattr(_tls, "paused", 0):
        return None
    st = _guards()
    return st[-1] if st else None


def _install() -> None:
    """Once per process, for good: torch.nn.Module's ``__new__`` becomes one that sees a module's constructor
    arguments (the only place they can be seen; a class's ``__new__`` once set cannot be taken back, as CPython
    keeps the subclasses' slot, so it stays and passes through outside a guard), and module registration hooks
    that see which tensors a constructor makes and carry a lazy parameter's record onto its dist replacement."""
    global _installed
    with _lock:
        if _installed:
            return
        mod = torch.nn.modules.module
        prev = torch.nn.Module.__dict__.get("__new__")
        base = prev.__func__ if isinstance(prev, staticmethod) else None

        def __new__(cls, *args, **kwargs):  # noqa: N807
            if base is not None:
                obj = base(cls, *args, **kwargs)
            else:
                nxt = super(torch.nn.Module, cls).__new__
                obj = nxt(cls) if nxt is object.__new__ else nxt(cls, *args, **kwargs)
            guard = _active()
            if guard is not None:
                caller = sys._getframe(1)
                if caller.f_code not in _UNPICKLING:
                    guard.constructing(obj, cls, args, kwargs, caller)
            return obj

        torch.nn.Module.__new__ = staticmethod(__new__)  # type: ignore[method-assign,assignment]
        mod.register_module_parameter_registration_hook(lambda m, n, t: _registered(m, n, t, "parameter"))
        mod.register_module_buffer_registration_hook(lambda m, n, t: _registered(m, n, t, "buffer"))
        for name in ("manual_seed", "seed"):
            seeding = _seeding(getattr(torch.random, name))
            setattr(torch.random, name, seeding)
            setattr(torch, name, seeding)
        _installed = True


def _seeding(fn):
    """``torch.manual_seed`` (or ``torch.seed``) that also counts, per thread, the seedings outside a lazy build:
    a model built after one starts from the seed, not where the model before it leaves the RNG, even if the state
    is the same. (A state set with ``set_rng_state`` is not counted: one saved after a lazy build stands for where
    the eager build leaves the RNG, and the model after it follows.)"""
    def seeding(*args, **kwargs):
        guard = None if getattr(_tls, "paused", 0) else _active()
        root = guard.roots[-1] if guard is not None and guard.roots else None
        if root is None or root.module is None or not _within(root, sys._getframe(1), False):
            _tls.epoch = _epoch() + 1
        return fn(*args, **kwargs)

    seeding.__wrapped__ = fn  # type: ignore[attr-defined]
    seeding.__name__, seeding.__qualname__, seeding.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    return seeding


def _epoch() -> int:
    return getattr(_tls, "epoch", 0)


def _within(root: _Root, frame, new_call: bool) -> bool:
    """Whether ``frame`` runs inside the call that builds ``root``: the frame that called its constructor is on the
    stack, still at that call (a new call from that frame itself is not inside it)."""
    if root.caller is None or new_call and frame is root.caller:
        return False
    while frame is not None:
        if frame is root.caller:
            return frame.f_lasti == root.lasti
        frame = frame.f_back
    return False


def _registered(module, name, t, kind):
    if t is None:
        return None
    guard = _active()
    if guard is not None and guard.roots:
        root = guard.roots[-1]
        if _within(root, sys._getframe(1), False):
            root.regs.append((module, name, kind, t))
            return None
        root.finish()  # the model is done: its tensors become lazy before anything replaces them
    follow((module._parameters if kind == "parameter" else module._buffers).get(name), t)
    return None


def follow(old, new) -> None:
    """``new``, made from ``old`` without values (``shard_tensor`` of a lazy parameter, which ``shard_layer`` and
    ``parallelize`` put in its place), waits for ``old``'s eager values instead; nothing when ``old`` is not lazy.
    Module registration calls it for every tensor that replaces another."""
    lazy = old.__dict__.get("_mv_lazy") if isinstance(old, torch.Tensor) and old is not new else None
    if lazy is not None and "_mv_lazy" not in new.__dict__ and _is_meta(new) and tuple(new.shape) == tuple(old.shape):
        lazy.carry(old, new)


def _is_meta(t) -> bool:
    """No values yet: on the meta device, or a dist tensor whose block is."""
    if t.device.type == "meta":
        return True
    local = getattr(t, "_local", None)
    return isinstance(local, torch.Tensor) and local.device.type == "meta"


def _rng_get(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _rng_set(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _same(a: tuple, b: tuple) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


class _Guard:
    """One ``with LazyGuard()``: the outermost modules built in it, in order."""

    def __init__(self):
        self.device = torch.get_default_device()  # where an eager build would have put them
        self.meta = torch.device("meta")
        self.roots: list[_Root] = []
        self.left: tuple | None = None  # the RNG state at the guard's end
        self.moved = False

    def constructing(self, obj, cls, args, kwargs, caller) -> None:
        last = self.roots[-1] if self.roots else None
        if last is not None:
            if _within(last, caller, True):
                return  # a part of the module being built
            last.finish()
        else:  # the last model of an earlier guard: one built in this guard may follow it as eagerly
            last = getattr(_tls, "last", lambda: None)()
        root = _Root(self, obj, cls, args, kwargs, caller, last)
        self.roots.append(root)
        _tls.last = weakref.ref(root)

    def close(self, ok: bool) -> None:
        if ok and self.roots:
            self.roots[-1].finish()
        self.left = _rng_get(self.device)

    def move_rng(self) -> None:
        """Once: the global RNG, if still where the guard left it, goes where the eager builds leave it."""
        if self.moved or self.left is None or not self.roots:
            return
        tail = self.roots[-1]
        while tail.next is not None:  # models of later guards that follow this one's
            tail = tail.next
            tail.guard.moved = True
        self.moved = True
        if _same(_rng_get(self.device), self.left):
            _rng_set(self.device, tail.end_state())


class _Root:
    """An outermost module built in a guard: how to build it again, and its tensors waiting for values."""

    def __init__(self, guard: _Guard, obj, cls, args, kwargs, caller, prev: _Root | None):
        self.guard, self.cls, self.args, self.kwargs = guard, cls, args, kwargs
        self.module = obj  # held until it is finished, then only its lazy tensors' modules, weakly
        self.caller, self.lasti = caller, caller.f_lasti
        self.dtype = torch.get_default_dtype()
        self.start = _rng_get(guard.device)
        self.prev = prev
        self.epoch = _epoch()
        # nothing seeded or drew from the RNG between (a seed set again to the same state breaks the chain too)
        self.chained = prev is not None and prev.epoch == self.epoch and _same(prev.start, self.start)
        self.next: _Root | None = None  # the model of a later guard that follows this one
        if self.chained and prev is not None and prev.guard is not guard:
            prev.next = self
        self.regs: list = []  # (module, name, kind, tensor) registered while it was built
        self.slots: list = []  # (module weakref, name, kind, path) holding its lazy tensors
        self.waiting: dict = {}  # path -> how many parameters still wait for that value
        self.values: dict | None = None  # path -> eager value, from the first initialize() until taken
        self.end: tuple | None = None  # the RNG state its eager build leaves

    @property
    def what(self) -> str:
        return self.cls.__name__

    def finish(self) -> None:
        """Its construction is over: each meta tensor it made, where its modules still hold it, becomes lazy."""
        model, self.module, self.caller = self.module, None, None
        if model is None:
            return
        where: dict = {}
        for prefix, m in model.named_modules(remove_duplicate=False):
            where.setdefault(id(m), prefix)
        checks: dict = {}
        for m, name, kind, t in self.regs:
            table = m._parameters if kind == "parameter" else m._buffers
            if table.get(name) is not t or id(m) not in where:
                continue
            if not _is_meta(t):  # made from values the build was given: it holds its eager values already
                if kind == "parameter" and "initialize" not in t.__dict__:
                    t.initialize = _held  # type: ignore[attr-defined]
                continue
            path = f"{where[id(m)]}.{name}" if where[id(m)] else name
            if "_mv_lazy" not in t.__dict__:
                _Lazy(self, path, kind).attach(t)
            self.slots.append((weakref.ref(m), name, kind, t.__dict__["_mv_lazy"].path))
            checks.setdefault(id(m), (m, []))[1].append((kind, name, path))
        self.regs = []
        for m, names in checks.values():
            check = _Unready(self.what, names)
            check.handle = m.register_forward_pre_hook(check)

    def begin_state(self) -> tuple:
        return self.prev.end_state() if self.chained and self.prev is not None else self.start

    def end_state(self) -> tuple:
        if self.end is None:
            self.end = self.rebuild()[1]
        return self.end

    def rebuild(self):
        """The module built again, eagerly, from the RNG state its eager build starts from (the global RNG is
        left as it was)."""
        dev = self.guard.device
        cuda = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
        start = self.begin_state()
        _tls.paused = getattr(_tls, "paused", 0) + 1
        was = torch.get_default_dtype()
        try:
            with torch.random.fork_rng(devices=cuda), torch.device(dev):
                torch.set_default_dtype(self.dtype)
                _rng_set(dev, start)
                model = self.cls(*self.args, **self.kwargs)
                end = _rng_get(dev)
        except Exception as e:
            raise RuntimeError(f"initialize(): building {self.what} again, to take the values its eager build "
                               f"gives, failed: {type(e).__name__}: {e}") from e
        finally:
            torch.set_default_dtype(was)
            _tls.paused -= 1
        return model, end

    def value(self, path: str, kind: str, counted: bool) -> torch.Tensor:
        """The eager value at ``path``; the first call builds the module again and fills its lazy buffers."""
        fresh = None
        if self.values is None:
            model, self.end = self.rebuild()
            fresh = _tables(model)
            params = fresh["parameter"]
            self.values = {p: params[p] for p, n in self.waiting.items() if n > 0 and p in params}
            self._fill_buffers(fresh["buffer"])
        self.guard.move_rng()
        if kind == "parameter" and path in self.values:
            v = self.values[path]
            if counted:
                self.waiting[path] -= 1
                if self.waiting[path] <= 0:
                    del self.values[path]
                    return v
            return v.clone()
        fresh = fresh or _tables(self.rebuild()[0])  # taken already, by another tensor of the same path
        if path not in fresh[kind]:
            raise RuntimeError(f"initialize(): {self.what} built again has no {kind} {path!r}; the lazy model's "
                               f"structure was changed after its construction")
        return fresh[kind][path]

    def _fill_buffers(self, eager: dict) -> None:
        for ref, name, kind, path in self.slots:
            m = ref()
            t = m._buffers.get(name) if m is not None and kind == "buffer" else None
            if t is not None and _is_meta(t) and path in eager:
                _materialize(t, eager[path])


def _tables(model) -> dict:
    return {"parameter": {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)},
            "buffer": {n: b.detach() for n, b in model.named_buffers(remove_duplicate=False)}}


class _Lazy:
    """What a lazy tensor is: its root and its path there."""

    __slots__ = ("root", "path", "kind", "counted")

    def __init__(self, root: _Root, path: str, kind: str):
        self.root, self.path, self.kind = root, path, kind
        self.counted = kind == "parameter"
        if self.counted:
            root.waiting[path] = root.waiting.get(path, 0) + 1

    def attach(self, t: torch.Tensor) -> None:
        t._mv_lazy = self  # type: ignore[attr-defined]
        t.initialize = types.MethodType(_initialize, t)  # type: ignore[attr-defined]

    def carry(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """``new`` replaces ``old`` in its module: it waits for the value instead (``old`` can still take it)."""
        _Lazy(self.root, self.path, self.kind).attach(new)
        if self.counted:
            self.counted = False
            self.root.waiting[self.path] -= 1


def _initialize(t: torch.Tensor) -> None:
    """Paddle's ``param.initialize()``: the values an eager build gives (this rank's block of them for a dist
    tensor), in this same tensor object."""
    lazy = t.__dict__["_mv_lazy"]
    value = lazy.root.value(lazy.path, lazy.kind, lazy.counted)
    if value.device.type == "meta":
        raise RuntimeError(f"initialize(): {lazy.root.what} built again gives no values for {lazy.path!r}: it is "
                           f"made from a tensor created inside the LazyGuard (on the meta device); create that tensor "
                           f"before the guard")
    lazy.counted = False
    if "_mv_lazy" in t.__dict__:  # (a buffer is filled by its model's first initialize())
        _materialize(t, value)


def _held() -> None:
    """``initialize()`` of a parameter built in the guard from values it was given: nothing to do."""


def _initialized_already() -> None:
    raise RuntimeError("initialize(): this tensor is initialized already (initialize() runs once per tensor, as "
                       "Paddle's)")


def _materialize(t: torch.Tensor, value: torch.Tensor) -> None:
    """``t`` (same object) holding ``value``, in its dtype; as shard_tensor places it when ``t`` is dist."""
    from .runtime.dtensor import DistTensor

    value = value.detach().to(dtype=t.dtype)
    if isinstance(t, DistTensor):
        from .distributed.api import shard_tensor

        new = shard_tensor(value, t.process_mesh, t.placements)
    else:
        new = value if t.device.type == "meta" else value.to(t.device)
    if isinstance(t, torch.nn.Parameter):
        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
    else:
        new.requires_grad_(t.requires_grad)
    dist = isinstance(t, DistTensor)  # its own state stays that of the new block; its names and marks go over
    kept = {k: v for k, v in t.__dict__.items()
            if not dist or not k.startswith("_") or k in ("_is_param", "_mv_name", "_mv_id_")}
    kept.pop("_mv_lazy", None)
    new.__dict__.update(kept, initialize=_initialized_already)
    hooks = t._post_accumulate_grad_hooks  # held by the tensor object, not its __dict__: the swap takes them
    torch.utils.swap_tensors(t, new)
    if hooks is not None:
        t._post_accumulate_grad_hooks = hooks


class _Unready:
    """A forward pre-hook: a module whose lazy tensors are not initialized yet says so (and leaves once they
    are)."""

    def __init__(self, what: str, names: list):
        self.what, self.names = what, names
        self.handle = None

    def __call__(self, module, args) -> None:
        for kind, name, path in self.names:
            t = (module._parameters if kind == "parameter" else module._buffers).get(name)
            if t is not None and _is_meta(t):
                raise RuntimeError(
                    f"{kind} {path!r} of {self.what} is not initialized: the model was built under LazyGuard and "
                    f"holds no values until `for p in model.parameters(): p.initialize()` (its buffers come with "
                    f"the first initialize())")
        if self.handle is not None:
            self.handle.remove()
