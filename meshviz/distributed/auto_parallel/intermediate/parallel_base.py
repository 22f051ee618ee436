"""What every parallelized model ends with: each parameter a dist tensor on its stage's mesh."""

from __future__ import annotations

import torch

from ....core.placements import Replicate
from ....runtime.dtensor import DistTensor
from ...api import reshard, shard_tensor
from .pipeline_parallel import stage_mesh

__all__ = ["param_holders", "shard_all_params", "remap_optimizer"]


def param_holders(model: torch.nn.Module) -> dict:
    """id(parameter) -> [(layer, name), ...], every layer that holds it (a tied weight has several)."""
    out: dict = {}
    for _, layer in model.named_modules(remove_duplicate=False):
        for pname, p in layer._parameters.items():
            if p is not None:
                hold = out.setdefault(id(p), [])
                if not any(h[0] is layer and h[1] == pname for h in hold):
                    hold.append((layer, pname))
    return out


def _share_across_stages(layer, origin, pname, placements, mesh):
    """A parameter of an earlier stage used by this layer too: swap in a copy resharded onto this layer's
    stage for its forward (the gradient flows back through the reshard), then put the original back. Once per
    layer and parameter: a later ``parallelize`` (a ``dp_config`` for a new optimizer) would move it twice."""
    shared = layer.__dict__.setdefault("_mv_shared_params", set())
    if pname in shared:
        return
    shared.add(pname)

    def pre(layer, input):
        layer._parameters[pname] = reshard(origin, mesh, placements)

    def post(layer, input, output):
        layer._parameters[pname] = origin

    layer.register_forward_pre_hook(pre)
    layer.register_forward_hook(post, always_call=True)  # a forward that raises puts the original back too


def shard_all_params(model, mesh, layer_param_placements: dict) -> None:
    """Paddle's ``_shard_all_param``: every parameter still dense becomes a dist tensor on its layer's stage mesh,
    Replicate unless a plan deferred placements for it (a shared parameter); a shared parameter is placed once,
    by the first layer holding it, and reaches layers of other stages through a reshard."""
    placed: dict = {}  # id(parameter as found) -> (dist parameter, stage)
    keep = []  # hold the originals so no id is reused while this runs
    for name, layer in model.named_modules():
        stage = getattr(layer, "pipeline_stage_index", 0)
        smesh = stage_mesh(mesh, stage)
        for pname, param in list(layer._parameters.items()):
            if param is None:
                continue
            pl = layer_param_placements.get(layer, {}).get(pname) or [Replicate()] * smesh.ndim
            key = id(param)
            if key in placed:
                dparam, first_stage = placed[key]
                if dparam is not param:
                    setattr(layer, pname, dparam)
                if first_stage != stage:
                    _share_across_stages(layer, dparam, pname, pl, smesh)
                continue
            if isinstance(param, DistTensor):
                placed[key] = (param, stage)
                continue
            keep.append(param)
            dparam = shard_tensor(param, smesh, pl, name=f"{name}.{pname}" if name else pname)
            placed[key] = (dparam, stage)
            setattr(layer, pname, dparam)


def remap_optimizer(optimizer, mapping: dict) -> None:
    """Point ``optimizer`` at the parallelized parameters (``mapping``: id(old) -> new), as Paddle's
    ``update_param_list`` does."""
    if optimizer.state:
        raise ValueError("parallelize: the optimizer already holds state (it has stepped); create it from the "
                         "model's parameters and pass it before training")
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(id(p), p) for p in group["params"]]
