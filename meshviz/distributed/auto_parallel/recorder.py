"""DispatchRecorder: the aten and c10d ops one real step runs on this rank, and the fx graph they make."""

from __future__ import annotations

import torch

from ... import compat
from ...backends import threads as thread_backend
from .program import shape_str

__all__ = ["DispatchRecorder", "graph_from_records"]


class DispatchRecorder(compat.TorchDispatchMode):
    """Records the aten and c10d ops one real step runs on this rank (on local blocks; subclasses desugar)."""

    def __init__(self):
        super().__init__()
        self.records = []

    def _observe(self, func, tensors) -> None:
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
            self.records.append((func, args, kwargs, out))
        return out


def graph_from_records(records, names: dict) -> torch.fx.Graph:
    """An fx graph of recorded ops; tensors not produced by a recorded op become inputs named by ``names``."""
    g = torch.fx.Graph()
    env = {}
    counter = [0]

    def node_for(x):
        if not isinstance(x, torch.Tensor):
            return x
        key = id(x)
        if key not in env:
            nm = names.get(key)
            if nm is None:
                nm = f"in{counter[0]}"
                counter[0] += 1
            n = g.placeholder(nm.replace(".", "_"))
            n.meta["shape"] = shape_str(x)
            env[key] = n
        return env[key]

    last = None
    for func, args, kwargs, out in records:
        node = g.call_function(func, compat.tree_map(node_for, tuple(args)), compat.tree_map(node_for, dict(kwargs)))
        flat, _ = compat.tree_flatten(out)
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        node.meta["shape"] = ", ".join(shape_str(t) for t in tensors)
        for t in tensors:
            env[id(t)] = node
        last = node
    g.output(last)
    return g
