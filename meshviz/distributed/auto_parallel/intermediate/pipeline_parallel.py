"""Pipeline split for ``dist.parallelize``: SplitPoint, split_spec / global_spec, stage meshes and transfers."""

from __future__ import annotations

import itertools
import re
import warnings
from collections import OrderedDict
from enum import Enum

import torch

from ....core.placements import Replicate
from ....runtime.dtensor import DistTensor
from ...api import reshard, shard_tensor

__all__ = [
    "SplitPoint", "resolve_split_spec", "stage_mesh", "stage_indices", "assign_stages", "register_pipeline_hooks",
    "register_stage_transfers",
]


class SplitPoint(Enum):
    """Where a pipeline split sits: BEGINNING (before the layer; not supported, as in Paddle) or END (after it)."""

    BEGINNING = 0
    END = 1


def stage_mesh(mesh, pp_idx: int = 0):
    """The sub-mesh of pipeline stage ``pp_idx`` (the whole mesh when it has no ``pp`` axis)."""
    if "pp" in mesh.dim_names:
        return mesh.get_mesh_with_dim("pp", pp_idx)
    return mesh


def _prefix_layers(names: list, split_spec) -> list:
    """Paddle's matching of a str / list ``split_spec``: the layers named ``<prefix>.<n>`` or named exactly, in
    ``named_modules`` order, less a matched name whose numbered children matched too (``layers`` when
    ``layers.0`` ... did)."""
    for prefix in split_spec:
        if not isinstance(prefix, str):
            raise ValueError(f"split_spec as a list holds layer names or prefixes (str), got {prefix!r}")
    try:
        patterns = [re.compile(rf"{prefix}\.\d+$") for prefix in split_spec]
    except re.error as e:
        raise ValueError(f"split_spec {list(split_spec)} is not a valid regular expression: {e}") from None
    matched = [n for n in names if n in split_spec or any(p.match(n) for p in patterns)]
    numbered = re.compile(r"^(.+)\.\d+$")
    bases = {m.group(1) for m in map(numbered.match, matched) if m}
    return [n for n in matched if n not in bases]


def _split_after(n: int, pp_size: int) -> list:
    """Paddle's ``divide_list_indices``: the index of the last layer of every stage but the last, the first
    ``n % pp_size`` stages holding one layer more than the others."""
    base, extra = divmod(n, pp_size)
    out, last = [], -1
    for i in range(pp_size - 1):
        last += base + (1 if i < extra else 0)
        out.append(last)
    return out


def resolve_split_spec(model: torch.nn.Module, mesh, config: dict):
    """Check ``pp_config`` and return ``(split_spec_dict, global_spec, pipeline_layer_names)``; no side effects.

    ``pipeline_layer_names`` (the layers a str / list ``split_spec`` matched) is None for a dict ``split_spec``:
    with a ``global_spec``, every layer then moves a tensor of another mesh onto its own stage, as in Paddle.
    """
    if not isinstance(config, dict):
        raise ValueError(f"pp_config should be a dict, got {type(config).__name__}")
    unknown = set(config) - {"split_spec", "global_spec"}
    if unknown:
        raise ValueError(f"pp_config has unknown keys {sorted(unknown)}; it takes 'split_spec' and 'global_spec'")
    split_spec = config.get("split_spec")
    if split_spec is None:
        return None, None, None
    if "pp" not in mesh.dim_names:
        raise ValueError(f"pp_config needs a mesh axis named 'pp'; the mesh {mesh} has {mesh.dim_names}")
    global_spec = config.get("global_spec")
    names = [name for name, _ in model.named_modules() if name]
    pp_size = mesh.get_dim_size("pp")
    matched = None
    if isinstance(split_spec, str):
        split_spec = [split_spec]
    if isinstance(split_spec, (list, tuple)):
        matched = _prefix_layers(names, split_spec)
        if not matched:
            raise ValueError(f"No layer matches the split_spec {list(split_spec)}: it names layers, or the prefix "
                             f"of numbered layers (such as 'llama.layers' for llama.layers.0, llama.layers.1, ...)")
        if len(matched) < pp_size:
            raise ValueError(f"The number of layers must not be less than the pp size, but got {len(matched)} "
                             f"layers ({matched}) and pp size {pp_size}")
        if len(matched) % pp_size:
            base, extra = divmod(len(matched), pp_size)
            warnings.warn(f"The number of layers ({len(matched)}) is not divisible by the pp size ({pp_size}): "
                          f"the first {extra} stages hold {base + 1} of them, the others {base}", stacklevel=5)
        spec = OrderedDict((matched[i], SplitPoint.END) for i in _split_after(len(matched), pp_size))
    elif isinstance(split_spec, dict):
        spec = OrderedDict(split_spec)
        for name, point in spec.items():
            if name not in names:
                raise ValueError(f"layer name:{name} not in the model, please check the split_spec")
            if not isinstance(point, SplitPoint):
                raise ValueError(f"split_spec[{name!r}] should be a SplitPoint, got {point!r}")
            if point == SplitPoint.BEGINNING:
                raise NotImplementedError("SplitPoint.BEGINNING is not supported currently")
        if len(spec) != pp_size - 1:
            raise ValueError(f"split_spec has {len(spec)} split points; a pp degree of {pp_size} needs "
                             f"{pp_size - 1}")
    else:
        raise ValueError(f"split_spec should be a str, a list of str or a dict of layer name -> SplitPoint, got "
                         f"{type(split_spec).__name__}")
    if global_spec:
        if isinstance(global_spec, str):
            global_spec = [global_spec]
        elif not isinstance(global_spec, (list, tuple)):
            raise ValueError(f"global_spec can only be a str or a list of str, but got: {type(global_spec)}")
        for name in global_spec:
            if name not in names:
                raise ValueError(f"layer name:{name} not in the model, please check the global_spec")
    return spec, list(global_spec) if global_spec else None, matched


def stage_indices(model: torch.nn.Module, spec: OrderedDict) -> dict:
    """Layer name -> pipeline stage: a split at the END of a layer starts the next stage at the next layer (in
    ``named_modules`` order) that is not inside it. Nothing is changed."""
    names = [name for name, _ in model.named_modules() if name]
    marks = [0] * len(names)
    for split_name in spec:
        index = names.index(split_name)
        nxt = next((i for i in range(index + 1, len(names)) if not names[i].startswith(split_name + ".")), None)
        if nxt is None:
            raise ValueError(f"the last layer:{split_name} must not be SplitPoint.END, please check the split_spec")
        marks[nxt] = 1
    return dict(zip(names, itertools.accumulate(marks)))


def assign_stages(model: torch.nn.Module, stages: dict) -> None:
    """Set ``pipeline_stage_index`` on every sub-layer."""
    for name, layer in model.named_modules():
        if name:
            layer.pipeline_stage_index = stages[name]


def _to_mesh(t, mesh, label):
    if isinstance(t, DistTensor):
        if label is not None and t.name is None:
            t.name = label
        return reshard(t, mesh, t.placements if t.process_mesh.ndim == mesh.ndim else [Replicate()] * mesh.ndim)
    if isinstance(t, torch.Tensor):
        return shard_tensor(t, mesh, [Replicate()] * mesh.ndim)
    raise ValueError(f"output should be a dict of tensors or list of tensors or tensor, but {type(t)}")


def register_stage_transfers(model, mesh, spec) -> None:
    """The transfer to the next stage after each split layer. Registered after the plans' hooks, so that a split
    layer's own output hook (a gathered column output, a sequence-parallel split or gather) works on its stage's
    mesh and the transfer is the last thing the layer does."""
    by_name = dict(model.named_modules())

    def forward_post_hook(layer, input, output):
        nxt = stage_mesh(mesh, layer.pipeline_stage_index + 1)
        label = f"{getattr(layer, '_mv_layer_name', '')}:output"
        if isinstance(output, dict):
            for key in list(output):
                output[key] = _to_mesh(output[key], nxt, label)
            return output
        if isinstance(output, (list, tuple)):
            moved = [_to_mesh(t, nxt, label) for t in output]
            return type(output)(moved) if isinstance(output, tuple) else moved
        return _to_mesh(output, nxt, label)

    for name in spec:
        by_name[name].register_forward_hook(forward_post_hook)


def register_pipeline_hooks(model, mesh, spec, global_spec, pipeline_layers) -> None:
    """Mark the split layers; with ``global_spec``, the global layers' outputs Replicate on the whole mesh, and
    every tensor of another mesh reaching a pipeline layer (each layer for a dict ``split_spec``) resharded
    Replicate onto its stage first."""
    by_name = dict(model.named_modules())
    for name in spec:
        by_name[name].split_point = spec[name]
    if not global_spec:
        return
    g_mesh = mesh.get_mesh_with_dim("pp")

    def global_post_hook(layer, input, output):
        def glob(t):
            if isinstance(t, torch.Tensor):
                return shard_tensor(t, g_mesh, [Replicate()] * g_mesh.ndim)
            return t

        if isinstance(output, (list, tuple)):
            out = [glob(t) for t in output]
            return tuple(out) if isinstance(output, tuple) else out
        if isinstance(output, torch.Tensor):
            return glob(output)
        raise TypeError("layer output can only be tensor or list/tuple of tensor")

    def global_pre_hook(layer, args, kwargs):
        here = stage_mesh(mesh, getattr(layer, "pipeline_stage_index", 0))

        def to_stage(t):
            if isinstance(t, DistTensor) and t.process_mesh != here:
                return reshard(t, here, [Replicate()] * here.ndim)
            return t

        return tuple(to_stage(t) for t in args), {k: to_stage(t) for k, t in kwargs.items()}

    for name in global_spec:
        by_name[name].register_forward_hook(global_post_hook)
    # Paddle's rule: the layers a str / list split_spec matched, every layer for a dict one
    for name in pipeline_layers if pipeline_layers is not None else [n for n in by_name if n]:
        by_name[name].register_forward_pre_hook(global_pre_hook, with_kwargs=True)
