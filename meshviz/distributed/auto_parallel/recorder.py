"""DispatchRecorder: the aten and c10d ops one real step runs on this rank, and the fx graph they make."""

from __future__ import annotations

import itertools

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ... import compat
from ...backends import threads as thread_backend
from .program import shape_str

__all__ = ["DispatchRecorder", "graph_from_records"]


class _Ref:
    """A tensor in a record, by identity and shape only. A record holding the tensor would keep every tensor the
    step made alive, and keep an optimizer from swapping a parameter for a dist one in place (a plain model fed
    dist batches, at its first step). ``token`` tells tensors apart for the step's lifetime (ids of freed
    tensors are reused); ``key`` is the id the tensor had, by which parameters are named."""

    __slots__ = ("token", "key", "shape")

    def __init__(self, token: int, t: torch.Tensor):
        self.token, self.key, self.shape = token, id(t), shape_str(t)


class DispatchRecorder(compat.TorchDispatchMode):
    """Records the aten and c10d ops one real step runs on this rank (on local blocks; subclasses desugar)."""

    def __init__(self):
        super().__init__()
        self.records = []
        self._tokens = WeakIdKeyDictionary()  # by identity: a tensor's == compares values
        # parameters by id, held (the model holds them anyway): a weak reference would keep an optimizer from
        # swapping one for a dist parameter in place (torch.utils.swap_tensors refuses a weakly referenced tensor)
        self._params: dict = {}
        self._count = itertools.count()

    def _ref(self, x):
        if not isinstance(x, torch.Tensor):
            return x
        if isinstance(x, torch.nn.Parameter):
            held = self._params.get(id(x))
            if held is None:
                held = self._params[id(x)] = (next(self._count), x)
            return _Ref(held[0], x)
        token = self._tokens.get(x)
        if token is None:
            token = self._tokens[x] = next(self._count)
        return _Ref(token, x)

    def _observe(self, func, tensors) -> None:
        tensors = [self._ref(t) for t in tensors]
        self.records.append((func, (tensors,), {}, tensors))

    # a thread group's calls (ranks as threads) do not pass the dispatcher: they are shown to this recorder
    def __enter__(self):
        thread_backend.observers().append(self._observe)
        return super().__enter__()

    def __exit__(self, *exc):
        obs = thread_backend.observers()
        if self._observe in obs:
            obs.remove(self._observe)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fake = compat.fake_tensor_type()
        if any(issubclass(t, fake) for t in types):  # shape propagation inside DTensor: not a real op
            return func(*args, **kwargs)
        if any(getattr(t, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__ for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        if getattr(func, "namespace", None) != "profiler" and func is not torch.ops.aten.detach.default:
            self.records.append((func, *compat.tree_map(self._ref, (args, kwargs, out))))
        return out


def graph_from_records(records, names: dict) -> torch.fx.Graph:
    """An fx graph of recorded ops; tensors not produced by a recorded op become inputs named by ``names``."""
    g = torch.fx.Graph()
    env = {}
    counter = [0]

    def node_for(x):
        if not isinstance(x, _Ref):
            return x
        if x.token not in env:
            nm = names.get(x.key)
            if nm is None:
                nm = f"in{counter[0]}"
                counter[0] += 1
            n = g.placeholder(nm.replace(".", "_"))
            n.meta["shape"] = x.shape
            env[x.token] = n
        return env[x.token]

    last = None
    for func, args, kwargs, out in records:
        node = g.call_function(func, compat.tree_map(node_for, tuple(args)), compat.tree_map(node_for, dict(kwargs)))
        flat, _ = compat.tree_flatten(out)
        tensors = [t for t in flat if isinstance(t, _Ref)]
        node.meta["shape"] = ", ".join(t.shape for t in tensors)
        for t in tensors:
            env[t.token] = node
        last = node
    g.output(last)
    return g
