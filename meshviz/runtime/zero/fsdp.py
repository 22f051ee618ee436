"""Level p_g_os: torch FSDP2 (``fully_shard``) on each child module and the root, small parameters kept whole."""

from __future__ import annotations

from torch import nn

from .group import ShardingGroup

__all__ = ["apply_fsdp", "unmix_foreach"]


def apply_fsdp(model, piece_of: dict, grp: ShardingGroup, dev, offload) -> None:
    """Shard the parameters whose piece is ``fsdp`` over ``grp``; the others are ignored by FSDP (replicated)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    names = {id(p): n for n, p in model.named_parameters()}
    ignored = {p for p in model.parameters()
               if piece_of.get(names[id(p)]) is None or piece_of[names[id(p)]].mode != "fsdp"}
    if len(ignored) == len(list(model.parameters())):
        return
    mesh = DeviceMesh.from_group(grp.pg, dev.type)
    policy = CPUOffloadPolicy() if (offload and dev.type != "cpu") else OffloadPolicy()
    for child in _units(model):
        if any(p not in ignored for p in child.parameters()):
            fully_shard(child, mesh=mesh, offload_policy=policy, ignored_params=ignored)
    fully_shard(model, mesh=mesh, offload_policy=policy, ignored_params=ignored)


def _units(model):
    """The children sharded one by one; a ModuleList or ModuleDict (no forward to hook) by its own children."""
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and type(child).forward is nn.Module.forward:
            yield from _units(child)
        else:
            yield child


def unmix_foreach(optimizer) -> None:
    """Step a param group that holds FSDP's DTensors beside whole plain tensors one tensor at a time.

    torch's optimizers default to their ``foreach`` kernels for CUDA parameters, and one foreach call over a list
    that mixes DTensors with plain tensors raises ("got mixed torch.Tensor and DTensor"); p_g_os leaves parameters
    under ``segment_size`` whole, so its groups can mix. A group the user asked to step with ``foreach`` or
    ``fused`` kernels is stepped one tensor at a time too (said once, as a warning): those kernels cannot run there.
    """
    import warnings

    from torch.distributed.tensor import DTensor

    for i, group in enumerate(optimizer.param_groups):
        if len({isinstance(p, DTensor) for p in group["params"]}) < 2:
            continue
        asked = [k for k in ("foreach", "fused") if group.get(k)]
        if asked:
            warnings.warn(f"group_sharded_parallel: param group {i} holds FSDP-sharded parameters beside ones under "
                          f"segment_size kept whole; torch's {' and '.join(asked)} kernels cannot step that mix, so "
                          f"it is stepped one tensor at a time", UserWarning, stacklevel=3)
            if group.get("fused"):
                group["fused"] = False
        group["foreach"] = False
