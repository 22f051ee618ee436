"""Paddle's ``fleet.utils.hybrid_parallel_util``: gradient and parameter sync helpers."""

from __future__ import annotations

from ....runtime.data_parallel import average_gradients
from ...parallel import fused_allreduce_gradients, sync_params_buffers

__all__ = ["fused_allreduce_gradients", "broadcast_dp_parameters", "broadcast_mp_parameters",
           "broadcast_sharding_parameters", "sync_params_buffers", "broadcast_input_data"]


def broadcast_dp_parameters(model, hcg):
    sync_params_buffers(model, hcg.get_data_parallel_group())


def broadcast_mp_parameters(model, hcg):
    """Make the parameters that are not model-parallel shards equal over the model-parallel group."""
    sync_params_buffers(model, hcg.get_model_parallel_group(), is_model_parallel=True)


def broadcast_sharding_parameters(model, hcg):
    sync_params_buffers(model, hcg.get_sharding_parallel_group())


def _sharding_mean(parameter_list, hcg):
    """Average the gradients over the sharding group (the bucketed mean fused_allreduce_gradients uses)."""
    average_gradients(parameter_list, hcg.get_sharding_parallel_group())


def broadcast_input_data(hcg, *inputs, **kwargs):
    """Paddle's ``broadcast_input_data`` (TensorParallel's pre-forward): every tensor among ``inputs`` and
    ``kwargs`` replaced by the model-parallel group's first rank's (its shape and dtype too), on this rank's device.

    Returns ``(inputs, kwargs)``; the caller's tensors are left as they are (Paddle overwrites them in place).
    Where the ranks of the group pass tensors in different places every rank raises ValueError.
    """
    import torch

    from ....runtime.devices import device
    from ...collective import all_gather_object, broadcast

    group = hcg.get_model_parallel_group()
    if group is None or hcg.get_model_parallel_world_size() <= 1:
        return inputs, kwargs
    slots = [("arg", i) for i, v in enumerate(inputs) if isinstance(v, torch.Tensor)]
    slots += [("kw", k) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    args, kws = list(inputs), dict(kwargs)

    def get(slot):
        return args[slot[1]] if slot[0] == "arg" else kws[slot[1]]

    metas = []
    all_gather_object(metas, [(s, tuple(get(s).shape), get(s).dtype) for s in slots], group=group)
    if any([m[0] for m in meta] != slots for meta in metas):
        raise ValueError(f"fleet TensorParallel: the model-parallel ranks {list(group.ranks)} pass tensors in "
                         f"different places, {[[m[0] for m in meta] for meta in metas]}; the inputs are broadcast "
                         f"from rank {group.ranks[0]}")
    src, dev, is_src = group.ranks[0], device(), group.rank == 0
    for slot, shape, dtype in metas[0]:
        mine = get(slot)
        if is_src:
            out = mine.to(dev)
            with torch.no_grad():
                broadcast(out.detach().contiguous(), src, group=group)
        else:
            out = torch.empty(shape, dtype=dtype, device=dev)
            broadcast(out, src, group=group)
            if mine.requires_grad and (out.is_floating_point() or out.is_complex()):
                out.requires_grad_(True)
        if slot[0] == "arg":
            args[slot[1]] = out
        else:
            kws[slot[1]] = out
    return tuple(args), kws
