"""Tensor-parallel plans: ColWiseParallel, RowWiseParallel, SequenceParallel*, PrepareLayerInput/Output."""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from ....core.placements import Partial, Replicate, Shard
from ....runtime.dtensor import DistTensor
from ...api import reshard, shard_tensor

__all__ = [
    "PlanBase",
    "ColWiseParallel",
    "RowWiseParallel",
    "PrepareLayerInput",
    "PrepareLayerOutput",
    "SequenceParallelBegin",
    "SequenceParallelEnd",
    "SequenceParallelEnable",
    "SequenceParallelDisable",
    "c_split",
    "c_concat",
    "match_layer",
]

logger = logging.getLogger(__name__)


def _axis(mesh, name: str, who: str) -> int:
    if name not in mesh.dim_names:
        raise ValueError(f"{who} needs a mesh axis named {name!r}; the mesh {mesh} has {mesh.dim_names}")
    return mesh.dim_names.index(name)


def _label(layer, what: str) -> str | None:
    name = getattr(layer, "_mv_layer_name", None)
    return f"{name}:{what}" if name else None


def _first(x, who: str):
    """The tensor a hook works on: ``x`` itself or the first element of a tuple/list (Paddle's convention)."""
    target = x[0] if isinstance(x, (tuple, list)) else x
    if isinstance(x, (tuple, list)) and not x:
        raise ValueError(f"{who}: the layer got no positional input to reshard")
    if not isinstance(target, torch.Tensor):
        raise ValueError(f"{who}: expected a tensor, got {type(target).__name__}")
    return target


def _put_first(x, target):
    if isinstance(x, (tuple, list)):
        out = list(x)
        out[0] = target
        return type(x)(out) if isinstance(x, tuple) else out
    return target


def _as_dist(t, mesh):
    """A dense tensor reaching a plan's hook is the same value on every rank: Replicate on the plan's mesh."""
    if isinstance(t, DistTensor):
        return t
    return shard_tensor(t, mesh, [Replicate()] * mesh.ndim)


def _move(t, mesh, placements, label):
    if label is not None and t.name is None:
        t.name = label
    if t.process_mesh == mesh and list(t.placements) == list(placements):
        return t
    return reshard(t, mesh, placements)


def c_split(x, process_mesh, need_transpose, label=None):
    """Split the sequence dim of a ``[b, s, h]`` (or, transposed first, ``[s, b, h]``) tensor along ``mp``.

    The batch dim is the one ``dp`` shards (Paddle's rule): ``dp`` on dim 0 -> sequence is dim 1, ``dp`` on dim 1 ->
    sequence is dim 0; with no ``dp`` sharding, dim 0.
    """
    mp = _axis(process_mesh, "mp", "sequence parallel")
    target = _first(x, "sequence parallel")
    if target.dim() != 3:
        raise ValueError(f"sequence parallel expects a 3-D [b, s, h] tensor, got shape {list(target.shape)}")
    target = _as_dist(target, process_mesh)
    if need_transpose:
        target = target.transpose(0, 1)
    placements = list(target.placements) if target.process_mesh == process_mesh else \
        [Replicate()] * process_mesh.ndim
    dp_pl = placements[process_mesh.dim_names.index("dp")] if "dp" in process_mesh.dim_names else None
    if dp_pl == Shard(0):
        split = 1
    elif dp_pl == Shard(1) or dp_pl is None:
        split = 0
    else:  # Paddle warns here; dim 0 is the sequence of the [s, b, h] layout the plans produce
        logger.debug(f"parallel api don't know {list(target.shape)} which dimension is batch, default is to cut "
                     f"to the 0th dimension")
        split = 0
    placements[mp] = Shard(split)  # a sequence the degree does not divide: the first ranks get a row more
    return _put_first(x, _move(target, process_mesh, placements, label))


def c_concat(x, process_mesh, need_transpose, label=None, who="sequence parallel"):
    """Gather the ``mp`` axis of a tensor back to Replicate (then transpose ``[s, b, h]`` -> ``[b, s, h]``).
    ``who`` is not sequence parallel (a gathered column output): a tensor of any rank, never transposed."""
    mp = _axis(process_mesh, "mp", who)
    target = _first(x, who)
    if who == "sequence parallel" and target.dim() != 3:
        raise ValueError(f"sequence parallel expects a 3-D [s, b, h] tensor, got shape {list(target.shape)}")
    target = _as_dist(target, process_mesh)
    placements = list(target.placements) if target.process_mesh == process_mesh else \
        [Replicate()] * process_mesh.ndim
    placements[mp] = Replicate()
    target = _move(target, process_mesh, placements, label)
    if need_transpose:
        target = target.transpose(0, 1)
    return _put_first(x, target)


def _reduce_partial(output, process_mesh, label):
    """A row-parallel output is Partial along ``mp``: all-reduce it there (through the planner)."""
    mp = process_mesh.dim_names.index("mp")
    target = output[0] if isinstance(output, (tuple, list)) and output else output
    if not isinstance(target, DistTensor) or not isinstance(target.placements[mp], Partial) \
            or target.process_mesh != process_mesh:
        return output
    placements = list(target.placements)
    placements[mp] = Replicate()
    return _put_first(output, _move(target, process_mesh, placements, label))


# -- plans --------------------------------------------------------------------------------------------------


class PlanBase:
    """A tensor-parallel plan for the layers (or parameters) a ``parallelize_plan`` key matches."""

    def __init__(self):
        self.share_param_list = {}

    def apply(self, layer, process_mesh, shard_param_list):
        raise NotImplementedError("Don't call the PlanBase directly.")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k not in ("share_param_list", "fn"))
        return f"{type(self).__name__}({args})"


def _is_linear(layer) -> bool:
    return isinstance(layer, nn.Linear)


class _ShardParams(PlanBase):
    """Shared by the column and row plans: which parameters to split, and on which torch dim."""

    kind = ""
    default_params: tuple = ()

    def _paddle_dim(self, ndim: int, name: str) -> int:
        raise NotImplementedError

    def param_placements(self, layer, process_mesh, shard_param_list, layer_name=""):
        """``{param name: placements}`` this plan gives ``layer`` (checked; nothing is changed)."""
        mp = _axis(process_mesh, "mp", type(self).__name__)
        names = self._param_names(shard_param_list)
        out = {}
        for name in names:
            param = getattr(layer, name, None)
            if not isinstance(param, torch.Tensor) or isinstance(param, DistTensor):
                continue
            dim = self._paddle_dim(param.dim(), f"{layer_name}.{name}" if layer_name else name)
            if _is_linear(layer) and name == "weight":
                dim = 1 - dim  # Paddle's Linear weight is [in, out], torch's [out, in]
            degree = process_mesh.shape[mp]
            if param.shape[dim] % degree:
                raise ValueError(
                    f"{type(self).__name__} on {layer_name or type(layer).__name__}: {name} has shape "
                    f"{list(param.shape)}; its dim {dim} ({param.shape[dim]}) is not divisible by the mp degree "
                    f"{degree}")
            pl = [Replicate()] * process_mesh.ndim
            pl[mp] = Shard(dim)
            out[name] = pl
        return out

    def _param_names(self, shard_param_list):
        return list(dict.fromkeys(shard_param_list)) or list(self.default_params)

    def _shard(self, layer, process_mesh, shard_param_list):
        if not isinstance(layer, (nn.Linear, nn.Embedding)):
            logger.warning(f"{type(self).__name__} is designed to handle Linear and Embedding. But got "
                           f"{type(layer).__name__}. Will try to shard {self.kind} if the layer contains one.")
        deferred = {}
        layer_name = getattr(layer, "_mv_layer_name", "")
        for name, pl in self.param_placements(layer, process_mesh, shard_param_list, layer_name).items():
            param = getattr(layer, name)
            if self.share_param_list.get(id(param), 1) > 1:
                deferred[name] = pl  # a shared parameter is placed once, for all its layers, at the end
                continue
            setattr(layer, name, shard_tensor(param, process_mesh, pl,
                                              name=f"{layer_name}.{name}" if layer_name else name))
        return deferred


class ColWiseParallel(_ShardParams):
    """Split a layer's output features over ``mp``: Paddle's ``weight`` ``Shard(1)`` (``[in, out]``) and ``bias``
    ``Shard(0)``. A torch ``nn.Linear`` stores ``[out, in]``, so there the weight is ``Shard(0)``; an
    ``nn.Embedding`` weight (``[num, dim]`` in both) is ``Shard(1)``. ``gather_output=True`` all-gathers the output
    back to Replicate along ``mp``, whatever its rank (Paddle's hook asserts a 3-D output)."""

    kind = "weight and bias"
    default_params = ("weight", "bias")

    def __init__(self, gather_output: bool = False) -> None:
        super().__init__()
        self.gather_output = gather_output

    def _paddle_dim(self, ndim, name):
        if ndim == 2:
            return 1
        if ndim == 1:
            return 0
        raise ValueError(f"ColWiseParallel: {name} should have 1 or 2 dims, got {ndim}")

    def gather_output_hook(self, process_mesh):
        def gather_hook(layer, input, output):
            return c_concat(output, process_mesh, False, _label(layer, "output"), "ColWiseParallel")

        return gather_hook

    def apply(self, layer, process_mesh, shard_param_list):
        deferred = self._shard(layer, process_mesh, shard_param_list)
        if self.gather_output:
            layer.register_forward_hook(self.gather_output_hook(process_mesh))
        return deferred


class RowWiseParallel(_ShardParams):
    """Split a layer's input features over ``mp``: Paddle's ``weight`` ``Shard(0)`` (``[in, out]``), which for a
    torch ``nn.Linear`` (``[out, in]``) is ``Shard(1)``; the bias stays whole. The output is a Partial sum along
    ``mp``, all-reduced after the layer (or reduce-scattered by the enclosing sequence-parallel plan).
    ``is_input_parallel=False``: the input is whole, and is split along its last dim first (as Paddle's hook
    splits dim 2, the hidden dim, of a ``[b, s, h]`` input)."""

    kind = "weight"
    default_params = ("weight",)

    def __init__(self, is_input_parallel: bool = True) -> None:
        super().__init__()
        self.is_input_parallel = is_input_parallel

    def _param_names(self, shard_param_list):
        names = [n for n in dict.fromkeys(shard_param_list) if n != "bias"]
        return names or list(self.default_params)

    def _paddle_dim(self, ndim, name):
        if ndim != 2:
            raise ValueError(f"RowWiseParallel: {name} should have 2 dims, got {ndim}")
        return 0

    def split_input_hook(self, process_mesh):
        mp = process_mesh.dim_names.index("mp")

        def split_hook(layer, input):
            target = _as_dist(_first(input, "RowWiseParallel"), process_mesh)
            placements = list(target.placements) if target.process_mesh == process_mesh else \
                [Replicate()] * process_mesh.ndim
            placements[mp] = Shard(target.dim() - 1)
            return _put_first(input, _move(target, process_mesh, placements, _label(layer, "input")))

        return split_hook

    def reduce_output_hook(self, process_mesh):
        def reduce_hook(layer, input, output):
            return _reduce_partial(output, process_mesh, _label(layer, "output"))

        return reduce_hook

    def apply(self, layer, process_mesh, shard_param_list):
        deferred = self._shard(layer, process_mesh, shard_param_list)
        if not self.is_input_parallel:
            layer.register_forward_pre_hook(self.split_input_hook(process_mesh))
        if not getattr(layer, "_mv_in_sp_region", False):
            layer.register_forward_hook(self.reduce_output_hook(process_mesh))
        return deferred


class _PrepareLayer(PlanBase):
    """``fn(process_mesh=mesh)`` returns the hook registered on the layer (``_hook``: which one)."""

    _hook = ""

    def __init__(self, fn=None) -> None:
        super().__init__()
        if not callable(fn):
            raise ValueError(f"{type(self).__name__} needs a callable fn(process_mesh) that returns the "
                             f"{self._hook}, got {fn!r}")
        self.fn = fn

    def _register(self, layer, hook) -> None:
        raise NotImplementedError

    def apply(self, layer, process_mesh, shard_param_list):
        self._register(layer, self.fn(process_mesh=process_mesh))


class PrepareLayerInput(_PrepareLayer):
    """``fn(process_mesh=mesh)`` returns a forward pre-hook ``hook(layer, input)`` for the layer."""

    _hook = "pre-hook"

    def _register(self, layer, hook) -> None:
        layer.register_forward_pre_hook(hook)


class PrepareLayerOutput(_PrepareLayer):
    """``fn(process_mesh=mesh)`` returns a forward hook ``hook(layer, input, output)`` for the layer."""

    _hook = "post-hook"

    def _register(self, layer, hook) -> None:
        layer.register_forward_hook(hook)


class SequenceParallelBegin(PlanBase):
    """On the LAST layer before the sequence-parallel range: its output ``[b, s, h]`` becomes ``[s/mp, b, h]``
    (``need_transpose=False``: ``[s, b, h]`` -> ``[s/mp, b, h]``)."""

    def __init__(self, need_transpose: bool = True) -> None:
        super().__init__()
        self.need_transpose = need_transpose

    def sequence_parallel_begin(self, process_mesh):
        def begin(layer, input, output):
            return c_split(output, process_mesh, self.need_transpose, _label(layer, "output"))

        return begin

    def apply(self, layer, process_mesh, shard_param_list):
        layer.register_forward_hook(self.sequence_parallel_begin(process_mesh))


class SequenceParallelEnd(PlanBase):
    """On the FIRST layer after the sequence-parallel range: its input ``[s/mp, b, h]`` becomes ``[b, s, h]``
    (``need_transpose=False``: ``[s, b, h]``)."""

    def __init__(self, need_transpose: bool = True) -> None:
        super().__init__()
        self.need_transpose = need_transpose

    def sequence_parallel_end(self, process_mesh):
        def end(layer, input):
            return c_concat(input, process_mesh, self.need_transpose, _label(layer, "input"))

        return end

    def apply(self, layer, process_mesh, shard_param_list):
        layer.register_forward_pre_hook(self.sequence_parallel_end(process_mesh))


class SequenceParallelEnable(PlanBase):
    """Run one layer sequence-parallel: its ``[b, s, h]`` input is split along the sequence (as ``[s/mp, b, h]``),
    its output gathered back to ``[b, s, h]``."""

    def __init__(self) -> None:
        super().__init__()

    def sequence_parallel_begin(self, process_mesh):
        def begin(layer, input):
            return c_split(input, process_mesh, True, _label(layer, "input"))

        return begin

    def sequence_parallel_end(self, process_mesh):
        def end(layer, input, output):
            return c_concat(output, process_mesh, True, _label(layer, "output"))

        return end

    def apply(self, layer, process_mesh, shard_param_list):
        logger.info("Sequence parallel with the usage of SequenceParallel may not reach the best throughput. "
                    "Try to use SequenceParallelBegin/End to achieve better performance")
        layer.register_forward_pre_hook(self.sequence_parallel_begin(process_mesh))
        layer.register_forward_hook(self.sequence_parallel_end(process_mesh))


class SequenceParallelDisable(PlanBase):
    """A layer inside the sequence-parallel range that needs the whole sequence: its input ``[s/mp, b, h]`` is
    gathered (to ``[b, s, h]``, or ``[s, b, h]`` with ``need_transpose=False``) and its output split again; a
    Partial output (a row-parallel layer's) is reduce-scattered straight into the split."""

    def __init__(self, need_transpose: bool = True) -> None:
        super().__init__()
        self.need_transpose = need_transpose

    def sequence_parallel_begin(self, process_mesh):
        def begin(layer, input, output):
            return c_split(output, process_mesh, self.need_transpose, _label(layer, "output"))

        return begin

    def sequence_parallel_end(self, process_mesh):
        def end(layer, input):
            return c_concat(input, process_mesh, self.need_transpose, _label(layer, "input"))

        return end

    def apply(self, layer, process_mesh, shard_param_list):
        layer.register_forward_pre_hook(self.sequence_parallel_end(process_mesh))
        layer.register_forward_hook(self.sequence_parallel_begin(process_mesh))


# plans whose output hook reshards the mp axis of what their layer returns
_SP_REGION = (SequenceParallelDisable, SequenceParallelEnable)


# -- matching -----------------------------------------------------------------------------------------------


def match_layer(parallelize_plan: dict, layer, name: str) -> list:
    """``[[plans], [param names]]`` for every key of ``parallelize_plan`` that matches the layer called ``name``.

    A key is a regular expression that must match the whole name (``llama.layers.*.mlp`` matches
    ``llama.layers.0.mlp``). A key ending in ``.attr`` where ``attr`` is a tensor of the layer names that
    parameter only (``lm_head.weight``).
    """
    return [[plans, params] for _, plans, params in _matches(parallelize_plan, layer, name)]


def _matches(parallelize_plan: dict, layer, name: str):
    out = []
    for key, plan in parallelize_plan.items():
        pattern = key
        attr_name = key.split(".")[-1]
        shard_param_list = []
        if key.endswith(f".{attr_name}") and isinstance(getattr(layer, attr_name, None), torch.Tensor):
            pattern = key[: -len(attr_name) - 1]
            shard_param_list.append(attr_name)
        try:
            found = re.match(pattern, name)
        except re.error as e:
            raise ValueError(f"parallelize_plan key {key!r} is not a valid regular expression: {e}") from None
        if pattern == name or (found is not None and found.end() - found.start() == len(name)):
            out.append((key, plan if isinstance(plan, list) else [plan], shard_param_list))
    return out


def check_plan(parallelize_plan) -> dict:
    if not isinstance(parallelize_plan, dict):
        raise ValueError(f"parallelize_plan should be a dict of layer name -> plan, got "
                         f"{type(parallelize_plan).__name__}")
    for key, plan in parallelize_plan.items():
        if not isinstance(key, str):
            raise ValueError(f"The key of the parallelize plan should be a string, got {key!r}.")
        plans = plan if isinstance(plan, list) else [plan]
        for p in plans:
            if not isinstance(p, PlanBase):
                raise ValueError(f"The value of the parallelize plan should be an instance of PlanBase or a list of "
                                 f"PlanBase; {key!r} maps to {p!r}.")
    return parallelize_plan
