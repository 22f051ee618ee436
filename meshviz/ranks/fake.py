"""Tensors without storage for a simulated rank, and what in its run may make it behave unlike another rank."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor

from .. import compat
from .ledger import Ledger

__all__ = ["SimulatedTensors", "Layouts", "KEEP_VALUES", "REAL_INDICES", "users_read", "WatchedEnv"]

KEEP_VALUES = 1 << 16  # a tensor made from Python data (a flag, a step count) keeps its values up to this many elements
REAL_INDICES = 1 << 22  # integer and bool tensors (ids, indices, masks) up to this many elements are real
aten = torch.ops.aten
_INDEX = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


# -- what a rank's layouts and rank reads were: what may make one rank behave unlike another --------------------------

class Layouts:
    """Every layout a dist tensor of the rank had when an op met it: (ProcessMesh, placements, global shape), where
    placements are meshviz's (a dist tensor) or torch's (a DTensor inside an op: ``_StridedShard`` included)."""

    def __init__(self) -> None:
        self.seen: dict = {}

    def note(self, args) -> None:
        for x in args:
            if isinstance(x, (list, tuple)):
                for y in x:
                    if isinstance(y, torch.Tensor):
                        self._one(y)
            elif isinstance(x, torch.Tensor):
                self._one(x)

    def _one(self, x) -> None:
        from ..runtime.dtensor import DistTensor, process_mesh_of

        if isinstance(x, DistTensor):
            mesh = x._pmesh
            key = (mesh.unique_id, x._mpl, x.shape)  # a tuple and a torch.Size: equal to the tuples kept
            if key in self.seen:
                return
            key = (key[0], tuple(key[1]), tuple(key[2]))
        elif isinstance(x, DTensor):
            spec = x._spec
            key = (id(spec.mesh), tuple(spec.placements), tuple(x.shape))
            if key in self.seen:
                return
            mesh = process_mesh_of(spec.mesh)
        else:
            return
        if key not in self.seen:
            self.seen[key] = (mesh, key[1], key[2])

    def layouts(self) -> list:
        return list(self.seen.values())


_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_C10D = os.path.abspath(tdist.distributed_c10d.__file__)
_WORLD = os.path.join(_PKG, "runtime", "world.py")
# the functions that only pass a rank on to their caller
_FORWARD = {(_C10D, "get_rank"), (_C10D, "get_group_rank"), (_WORLD, "get_rank"), (_WORLD, "rank"),
            (_WORLD, "_env_int")}
# meshviz functions that hand the rank itself to the caller (Paddle's fleet getters)
_HANDS_OVER = {os.path.join(_PKG, "distributed", "fleet", "__init__.py"),
               os.path.join(_PKG, "distributed", "fleet", "topology.py")}


def _reader(frame):
    """The frame that asked for the rank (past the functions that only pass it on), or None."""
    f = frame
    while f is not None and (f.f_code.co_filename, f.f_code.co_name) in _FORWARD:
        f = f.f_back
    return f


def users_read(frame) -> str | None:
    """Where the user's own code read its rank (directly or through a getter that hands it over), else None."""
    f = _reader(frame)
    if f is None:
        return None
    name = f.f_code.co_filename
    if name in _HANDS_OVER:
        f = _reader(f.f_back)
        name = f.f_code.co_filename if f is not None else ""
    if not f or name.startswith(_PKG) or name.startswith(_TORCH) or name.startswith("<frozen"):
        return None
    return f"{os.path.basename(name)}:{f.f_lineno} in {f.f_code.co_name}()"


class WatchedEnv(dict):
    """A rank's variables; reading its rank from them (``RANK`` before the process group exists) is noted."""

    KEYS = frozenset({"RANK", "LOCAL_RANK", "PADDLE_TRAINER_ID", "PADDLE_LOCAL_RANK"})

    def __init__(self, env, reads: list):
        super().__init__(env)
        self.reads = reads

    def __contains__(self, key) -> bool:
        if key in self.KEYS:
            where = users_read(sys._getframe(2))
            if where is not None:
                self.reads.append(where)
        return super().__contains__(key)


# -- tensors without storage --------------------------------------------------------------------------------------

_VALUE_ERROR, _SHAPE_ERROR = compat.fake_data_errors()
_FAKE = compat.fake_tensor_type()
_DEVICE = torch.ops.prim.device.default
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_FAKE_OR_TENSOR = frozenset({_FAKE, torch.Tensor})
_EMPTY = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                    aten.new_empty.default, aten.new_empty_strided.default})
_OPS = compat.FakeOps()  # shared by every simulated rank: a key holds no rank's tensors


def _tensor_args(args, kwargs) -> list:
    out = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(y for y in x if isinstance(y, torch.Tensor))
    return out


def _small_index(t) -> bool:
    return t.dtype in _INDEX and t.numel() <= REAL_INDICES


class SimulatedTensors(compat.fake_tensor_mode_type()):  # type: ignore[misc]
    """torch's fake tensors for one simulated rank: every floating-point tensor its code makes has a shape, a dtype
    and a device but no storage (what its ledger counts instead). Index tensors stay real: an integer or bool tensor
    of up to :data:`REAL_INDICES` elements made by a factory (``arange``, ``randint``) or from real index tensors
    holds its values, so the ids, masks and offsets code computes with (DTensor's own included) are right and
    cheap. A tensor made from Python data of up to :data:`KEEP_VALUES` elements keeps its values (a flag, a step
    count). Where a value is unknown, ``item()`` reads 0; an op whose output's shape depends on values
    (``masked_select``, ``nonzero``) gives its largest output (every element selected)."""

    def __init__(self, ledger: Ledger | None = None, layouts: Layouts | None = None):
        super().__init__(allow_non_fake_inputs=True)
        compat.fresh_fake_outputs(self)
        self.ledger = ledger
        self.layouts = layouts
        self._depth = 0

    def may_turn_const(self, t) -> bool:
        return compat.may_keep_values(self, t, KEEP_VALUES)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sub = not _FAKE_OR_TENSOR.issuperset(types)
        if sub and self.layouts is not None:
            self.layouts.note(args)
        if _FAKE not in types:
            real = self._real(func, args, kwargs)
            if real is not NotImplemented:
                self._count(real)
                return real
        if sub and any(not issubclass(t, _FAKE) and t not in _PLAIN for t in types):
            return NotImplemented  # a subclass (a dist tensor) runs the op first, as FakeTensorMode would let it
        if func is _DEVICE:  # asked for each fake input by much of torch's C++: answered as the mode would
            t = args[0]
            return torch.device("meta") if t.fake_mode.in_kernel_invocation else t.fake_device
        key = _OPS.key(self, func, args, kwargs)
        if key is not None:
            out = _OPS.get(self, key, args)
            if out is not None:
                self._count(out)
                return out
        self._depth += 1
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        except _VALUE_ERROR:
            if func is aten._local_scalar_dense.default:
                t = args[0]
                return False if t.dtype == torch.bool else 0.0 if t.is_floating_point() else 0
            raise
        except _SHAPE_ERROR:
            out = self._largest(func, args, kwargs)
        finally:
            self._depth -= 1
        if key is not None:
            _OPS.learn(key, func, args, out)
        if out is not NotImplemented:
            self._count(out)
        return out

    def _count(self, out) -> None:
        """The ledger counts what an op of the rank's made: not an op the fake kernel runs inside another (a
        decomposition's steps; the first call only, the next ones hit its cache), since a real kernel makes only
        the outer op's output, nor DTensor's global-shape stand-ins, which hold no memory."""
        if self.ledger is not None and self._depth == 0 and not compat.in_sharding_propagation():
            self.ledger.saw(out)

    def _real(self, func, args, kwargs):
        """``func`` run for real when it makes or works on index tensors only (NotImplemented otherwise)."""
        tensors = _tensor_args(args, kwargs)
        if any(isinstance(t, _FAKE) or not _small_index(t) for t in tensors):
            return NotImplemented
        if not tensors:  # a factory: real only when it makes a small index tensor (asked of the meta device first)
            # no device: the default one (C++ code such as DDP's bucket rebuild makes its index tensors so)
            dev = kwargs.get("device") or torch.get_default_device()
            if torch.device(dev).type != "cpu":
                return NotImplemented
            try:
                with compat.no_dispatch_modes():
                    probe = func(*args, **{**kwargs, "device": torch.device("meta")})
            except Exception:
                return NotImplemented
            if not isinstance(probe, torch.Tensor) or not _small_index(probe):
                return NotImplemented
        with compat.no_dispatch_modes():
            out = func(*args, **kwargs)
            if func in _EMPTY:  # what memory held before: zeros, as a value read off a fake tensor is
                out.zero_()
            return out

    def _largest(self, func, args, kwargs):
        x = args[0]
        with self:
            if func is aten.masked_select.default:
                n = torch.broadcast_shapes(x.shape, args[1].shape).numel()
                return torch.empty(n, dtype=x.dtype, device=x.device)
            if func in (aten.nonzero.default, aten.argwhere.default):
                return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        raise NotImplementedError(f"{func}: its output's shape depends on the values, which a simulated rank does not "
                                  f"have")
