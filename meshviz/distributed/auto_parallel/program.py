"""Program: a readable torch.fx graph of a step (serial or dist, main or startup) with shapes and collectives."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import types

import torch
import torch.nn as nn

__all__ = ["Program", "shape_str", "meta_from_spec", "split_input_spec", "count_inputs", "first_batch", "split_feeds",
           "local_of", "skeleton", "Rows", "row_split", "rows_as_dist", "check_shape", "check_piece"]


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


def _is_spec(s) -> bool:
    """One input's spec: a tensor, an object with ``shape``, or a ``(shape, dtype)`` pair."""
    if isinstance(s, torch.Tensor) or hasattr(s, "shape"):
        return True
    return (isinstance(s, (tuple, list)) and len(s) == 2 and isinstance(s[0], (tuple, list))
            and isinstance(s[1], (str, torch.dtype)))


def split_input_spec(input_spec):
    """``(inputs, labels)`` of an ``input_spec``: Paddle's ``[[input specs], [label specs]]``, or a flat list of the
    inputs' specs (labels None)."""
    if input_spec is None:
        return None, None
    if not isinstance(input_spec, (tuple, list)):
        raise ValueError(f"to_static: input_spec must be a list, got {type(input_spec).__name__}")
    if (len(input_spec) == 2 and not any(_is_spec(s) for s in input_spec)
            and all(isinstance(s, (tuple, list)) and all(_is_spec(x) for x in s) for s in input_spec)):
        return list(input_spec[0]), list(input_spec[1])
    bad = [s for s in input_spec if not _is_spec(s)]
    if bad:
        raise ValueError(f"to_static: input_spec must be [[input specs], [label specs]] or a list of input specs "
                         f"(tensors, InputSpec-like objects or (shape, dtype) pairs), got {bad[0]!r}")
    return list(input_spec), None


def count_inputs(layer, inputs_spec):
    """How many of the tensors fed to a step are the layer's inputs: the specs given, else the forward's
    positional parameters when it has no optional ones (None: ``split_feeds`` splits as Paddle does)."""
    if inputs_spec is not None:
        return len(inputs_spec)
    try:
        sig = inspect.signature(layer.forward)
    except (TypeError, ValueError):
        return None
    n = 0
    for prm in sig.parameters.values():
        if prm.kind in (prm.VAR_POSITIONAL, prm.VAR_KEYWORD):
            return None
        if prm.kind in (prm.POSITIONAL_ONLY, prm.POSITIONAL_OR_KEYWORD):
            if prm.default is not prm.empty:
                return None
            n += 1
    return n or None


def first_batch(loader):
    """The loader's first batch, read without moving it on: torch's RNG (a shuffling sampler's seed) and a
    shard_dataloader's epoch and pass under way stay as they were, so the batches training sees do not change."""
    own = getattr(loader, "first_batch", None)
    if callable(own):
        return own()
    rng = torch.random.get_rng_state()
    try:
        return next(iter(loader))
    finally:
        torch.random.set_rng_state(rng)


def split_feeds(items: list, n, with_labels: bool):
    """``(inputs, labels)`` of a step's arguments or a loader's batch, lists of tensors: the first ``n`` tensors
    are inputs, the rest labels; with ``n`` None, the last item is the label (a list or tuple of them: several),
    as Paddle splits a loader's batch. One list alone is the items."""
    if len(items) == 1 and isinstance(items[0], (list, tuple)):
        items = list(items[0])

    def flat(xs):
        return [t for x in xs for t in (x if isinstance(x, (list, tuple)) else [x])]

    if not with_labels:
        return flat(items), []
    if n is None:
        return (flat(items[:-1]), flat(items[-1:])) if len(items) > 1 else (flat(items), [])
    feeds = flat(items)
    return feeds[:n], feeds[n:]


@dataclasses.dataclass
class Rows:
    """How dist feeds split a batch's rows: over ``mesh`` as ``placements``; ``parts`` distinct blocks."""

    mesh: object
    placements: list
    rows: int
    parts: int


def row_split(inputs: list, labels: list, world: int, who: str) -> Rows | None:
    """How the dist inputs split the batch's rows (None: the inputs are plain); ValueError, the same on every rank
    (it reads only their global layout), where a rank's block is not its rows: the inputs must all be dist or all
    plain, lie on one mesh of every rank, split along dim 0 on some axes and replicated on the others, all alike.
    Dist labels may lie otherwise: the loss takes them as dist tensors."""
    from ...core.placements import Replicate, Shard
    from ..api import is_dist_tensor

    def is_dist(t):
        return is_dist_tensor(t) or hasattr(t, "to_local")

    dist = [t for t in inputs if is_dist(t)]
    if not dist:
        if any(is_dist(t) for t in labels):
            raise ValueError(f"{who}: dist labels with plain inputs: with strategy.sharding feed the inputs as dist "
                             f"tensors too (shard_dataloader's batches), or every tensor plain (each rank's part)")
        return None
    if len(dist) != len(inputs):
        raise ValueError(f"{who}: with strategy.sharding the inputs must be all dist tensors (each rank runs its "
                         f"rows of them) or all plain; got {len(dist)} dist of {len(inputs)}")
    first = dist[0]
    if not is_dist_tensor(first):
        raise ValueError(f"{who}: a torch DTensor feed is not supported here; feed meshviz dist tensors "
                         f"(shard_dataloader's batches) or plain tensors")
    mesh, pl = first.process_mesh, list(first.placements)
    if sorted(mesh.process_ids) != list(range(world)):
        raise ValueError(f"{who}: the dist batch lies on {mesh}, which must hold every rank (0..{world - 1}): each "
                         f"rank trains on its own block of the batch")
    if first.dim() == 0 or not all(p == Shard(0) or isinstance(p, Replicate) for p in pl):
        raise ValueError(f"{who}: a dist batch must be split along its rows (Shard(0)) or replicated on each mesh "
                         f"axis, got {pl}")
    for t in dist[1:]:
        same = is_dist_tensor(t) and t.process_mesh == mesh and list(t.placements) == pl
        if not same or t.shape[:1] != first.shape[:1]:
            got = f"{getattr(t, 'process_mesh', None)} {list(getattr(t, 'placements', []))} {list(t.shape)}"
            raise ValueError(f"{who}: every dist input must split the same rows the same way: the first is {mesh} "
                             f"{pl} {list(first.shape)}, another {got}")
    parts = 1
    for axis, p in enumerate(pl):
        parts *= mesh.shape[axis] if p == Shard(0) else 1
    return Rows(mesh, pl, int(first.shape[0]), parts)


def rows_as_dist(out, rows: Rows):
    """The forward's outputs on this rank's rows as dist tensors of the whole batch's rows (as the feeds lie)."""
    from ...runtime.autograd import from_local

    def one(o):
        if not isinstance(o, torch.Tensor):
            return o
        if o.dim() == 0:
            raise ValueError(f"DistModel: the model returned a 0-dim tensor from this rank's rows of a dist batch; "
                             f"with strategy.sharding its outputs must hold a row per sample ({rows.rows} in all)")
        return from_local(o, rows.mesh, rows.placements, [rows.rows] + list(o.shape[1:]))

    return type(out)(one(o) for o in out) if isinstance(out, (tuple, list)) else one(out)


def check_shape(key, value, own) -> None:
    """ValueError naming ``key`` (before anything is written) when ``value`` cannot be loaded into tensor ``own``:
    another shape, or a dist tensor on another mesh (Paddle would load its local block as this rank's)."""
    if torch.is_tensor(own) and (not torch.is_tensor(value) or value.shape != own.shape):
        got = list(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise ValueError(f"set_state_dict: {key} has shape {list(own.shape)}, got {got}")
    mesh, got = getattr(own, "process_mesh", None), getattr(value, "process_mesh", None)
    if mesh is not None and got is not None and got != mesh:
        raise ValueError(f"set_state_dict: {key} lies on {mesh}, got a dist tensor on {got}: dist.reshard it onto "
                         f"{mesh} first")


def check_piece(key, value, piece) -> None:
    """ValueError naming ``key`` when ``value`` is not a state of the whole parameter ``piece`` describes (a 0-dim
    value is an optimizer's scalar state, such as Adam's step)."""
    if not torch.is_tensor(value) or value.dim() == 0:
        return
    shape = tuple(value.shape)
    if shape == tuple(piece.shape) or (piece.mode != "fsdp" and shape == (piece.numel,)):
        return
    raise ValueError(f"set_state_dict: {key} has shape {list(piece.shape)}, got {list(shape)}")


def local_of(p):
    """This rank's block of a dist tensor; a plain tensor itself."""
    if hasattr(p, "_local_value"):
        return p._local_value()
    if hasattr(p, "to_local"):
        return p.to_local()
    return p


def skeleton(layer):
    """A copy of the layer on the meta device with global shapes: the serial model, no data, no communication."""
    memo = {}
    for p in layer.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    for b in layer.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    try:
        serial = copy.deepcopy(layer, memo)
    except Exception:
        return None
    for m in serial.modules():
        # a function set as the forward (layer.forward = f) is no method of the copy: it would run the original
        # layer, its data and its communication, on some ranks only
        if "forward" in vars(m) and not isinstance(vars(m)["forward"], types.MethodType):
            m.forward = _instance_forward
    return serial


def _instance_forward(*args, **kwargs):
    raise RuntimeError("the layer's forward is a function set on the instance (layer.forward = f): it runs the "
                       "original layer, not its copy on the meta device; define forward in the layer's class")


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
