"""Program: a readable torch.fx graph of a step (serial or dist, main or startup) with shapes and collectives."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

__all__ = ["Program", "shape_str", "meta_from_spec", "skeleton"]


def shape_str(t) -> str:
    """A tensor as dtype and shape, e.g. ``f32[4, 8]``."""
    if not isinstance(t, torch.Tensor):
        return repr(t)
    dt = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
          torch.int64: "i64", torch.int32: "i32", torch.bool: "b8"}.get(t.dtype, str(t.dtype).replace("torch.", ""))
    return f"{dt}{list(t.shape)}"


def meta_from_spec(s):
    """A meta tensor for one ``input_spec`` entry (a tensor, an object with ``shape``/``dtype``, or a pair)."""
    if isinstance(s, torch.Tensor):
        return torch.empty(s.shape, dtype=s.dtype, device="meta")
    shape = getattr(s, "shape", None)
    dtype = getattr(s, "dtype", torch.float32)
    if shape is None and isinstance(s, (tuple, list)) and len(s) == 2:
        shape, dtype = s
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    shape = [1 if (d is None or d == -1) else int(d) for d in shape]
    return torch.empty(shape, dtype=dtype, device="meta")


def skeleton(layer):
    """A copy of the layer on the meta device with global shapes: the serial model, no data, no communication."""
    memo = {}
    for p in layer.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    for b in layer.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    try:
        return copy.deepcopy(layer, memo)
    except Exception:
        return None


class Program:
    """A readable program: ``graph`` (a torch.fx Graph), ``kind`` (serial/dist, main/startup), ``mode``.

    ``str(program)`` lists its nodes with shapes; ``ops()`` the op names in order; ``collectives()`` the
    communication nodes (c10d / functional collectives) of a dist program.
    """

    COMM = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")

    def __init__(self, kind: str, mode: str, graph: torch.fx.Graph | None, header: list, note: str = ""):
        self.kind, self.mode, self.graph, self.header, self.note = kind, mode, graph, header, note

    @staticmethod
    def _is_comm(node) -> bool:
        t = node.target
        ns = getattr(t, "namespace", None) or getattr(getattr(t, "_schema", None), "name", "").split("::")[0]
        return node.op == "call_function" and ns in Program.COMM and "_wrap_tensor_autograd" not in str(t)

    def ops(self) -> list:
        if self.graph is None:
            return []
        return [str(n.target) for n in self.graph.nodes if n.op == "call_function"]

    def collectives(self) -> list:
        if self.graph is None:
            return []
        return [str(n.target) for n in self.graph.nodes if self._is_comm(n)]

    def __str__(self) -> str:
        lines = [f"{self.kind} program ({self.mode})"] + [f"  {h}" for h in self.header]
        if self.note:
            lines.append(f"  # {self.note}")
        if self.graph is not None:
            for n in self.graph.nodes:
                shape = n.meta.get("shape")
                mark = "  <-- communication" if self._is_comm(n) else ""
                args = ", ".join(_format_arg(a) for a in n.args)
                if n.op == "placeholder":
                    lines.append(f"  %{n.name}: {shape or ''} = input")
                elif n.op == "output":
                    lines.append(f"  return {args}")
                else:
                    lines.append(f"  %{n.name}: {shape or ''} = {n.target}({args}){mark}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        n = len(self.ops())
        return f"Program({self.kind}, {self.mode}, {n} ops, {len(self.collectives())} collectives)"


def _format_arg(a) -> str:
    if isinstance(a, torch.fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_format_arg(x) for x in a)
        return f"[{inner}]"
    if isinstance(a, torch.ScriptObject) or type(a).__name__.startswith("ProcessGroup"):
        return "<group>"
    return repr(a)
