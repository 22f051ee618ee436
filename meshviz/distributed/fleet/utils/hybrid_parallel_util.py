"""Paddle's ``fleet.utils.hybrid_parallel_util``: gradient and parameter sync helpers."""

from __future__ import annotations

import functools

from ....runtime.data_parallel import average_gradients
from ...parallel import fused_allreduce_gradients as _dp_allreduce_gradients
from ...parallel import sync_params_buffers

__all__ = ["fused_allreduce_gradients", "broadcast_dp_parameters", "broadcast_mp_parameters",
           "broadcast_sharding_parameters", "broadcast_sep_parameters", "sync_params_buffers",
           "broadcast_input_data", "sync_dp_sep_grads"]


def sync_dp_sep_grads(parameter_list, hcg) -> None:
    """Paddle's gradient sync over dp and sep: summed over the sep group, averaged over the data-parallel group
    (one all-reduce over their fused group); a rank without a gradient counts zero."""
    import torch

    sep, dp = hcg.get_sep_parallel_world_size(), hcg.get_data_parallel_world_size()
    if sep > 1:
        params = list(parameter_list)
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(sep)
        average_gradients(params, hcg.get_dp_sep_parallel_group())
    elif dp > 1:
        average_gradients(parameter_list, hcg.get_data_parallel_group())


def fused_allreduce_gradients(parameter_list, hcg=None):
    """Average the gradients of ``parameter_list`` over the data-parallel group of ``hcg`` (None: the world);
    with a sep group (sep_degree > 1) they are also summed over it, as Paddle's."""
    if hcg is not None and hcg.get_sep_parallel_world_size() > 1:
        import torch

        params = None if isinstance(parameter_list, torch.Tensor) else list(parameter_list)
        if params is None or not all(isinstance(p, torch.Tensor) for p in params):
            raise TypeError("fused_allreduce_gradients: parameter_list is a list of parameters (such as "
                            "list(model.parameters()))")
        sync_dp_sep_grads([p for p in params if p.requires_grad], hcg)
        return
    _dp_allreduce_gradients(parameter_list, hcg)


def broadcast_dp_parameters(model, hcg, fuse_params=True):
    sync_params_buffers(model, hcg.get_data_parallel_group(), fuse_params=fuse_params)


def broadcast_mp_parameters(model, hcg, fuse_params=True):
    """Make the parameters that are not model-parallel shards equal over the model-parallel group."""
    sync_params_buffers(model, hcg.get_model_parallel_group(), is_model_parallel=True, fuse_params=fuse_params)


def broadcast_sharding_parameters(model, hcg, fuse_params=True):
    sync_params_buffers(model, hcg.get_sharding_parallel_group(), fuse_params=fuse_params)


def broadcast_sep_parameters(model, hcg, fuse_params=True):
    sync_params_buffers(model, hcg.get_sep_parallel_group(), fuse_params=fuse_params)


def _sharding_mean(parameter_list, hcg):
    """Average the gradients over the sharding group (the bucketed mean fused_allreduce_gradients uses)."""
    average_gradients(parameter_list, hcg.get_sharding_parallel_group())


_HEADER = 32  # int64s per rank: count, the layout's crc, the packed length, then the packed (dtype, ndim, *shape)


@functools.cache
def _dtypes():
    import torch

    return sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str)


def _pack(slots, tensors):
    """This rank's fixed-size header, and its packed (dtype code, ndim, *shape) of every tensor in full."""
    import zlib

    table = _dtypes()
    packed = []
    for t in tensors:
        packed += [table.index(t.dtype), t.dim(), *t.shape]
    head = [len(slots), zlib.crc32(repr(slots).encode()), len(packed)]
    fits = len(packed) <= _HEADER - len(head)
    return head + (packed if fits else []) + [0] * (_HEADER - len(head) - (len(packed) if fits else 0)), packed


def _unpack(packed, n):
    table, metas, i = _dtypes(), [], 0
    for _ in range(n):
        ndim = packed[i + 1]
        metas.append((tuple(packed[i + 2:i + 2 + ndim]), table[packed[i]]))
        i += 2 + ndim
    return metas


def broadcast_input_data(hcg, *inputs, **kwargs):
    """Paddle's ``broadcast_input_data`` (TensorParallel's pre-forward): every tensor among ``inputs`` and
    ``kwargs`` replaced by the model-parallel group's first rank's (its shape and dtype too), on this rank's device.

    Returns ``(inputs, kwargs)``; the caller's tensors are left as they are (Paddle overwrites them in place).
    Where the ranks of the group pass tensors in different places every rank raises ValueError. One small
    fixed-size all-gather carries the layouts and the first rank's shapes (a broadcast more where they do not fit
    in it), then one broadcast per tensor, as Paddle's.
    """
    import torch

    from ....runtime.devices import device
    from ...collective import all_gather, all_gather_object, broadcast

    group = hcg.get_model_parallel_group()
    if group is None or hcg.get_model_parallel_world_size() <= 1:
        return inputs, kwargs
    slots = [("arg", i) for i, v in enumerate(inputs) if isinstance(v, torch.Tensor)]
    slots += [("kw", k) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    args, kws = list(inputs), dict(kwargs)

    def get(slot):
        return args[slot[1]] if slot[0] == "arg" else kws[slot[1]]

    src, dev, is_src = group.ranks[0], device(), group.rank == 0
    header, packed = _pack(slots, [get(s) for s in slots])
    heads: list = []
    all_gather(heads, torch.tensor(header, dtype=torch.int64, device=dev), group=group)
    heads = [h.tolist() for h in heads]
    if any(h[:2] != heads[0][:2] for h in heads):  # the names, only where the layouts differ
        names: list = []
        all_gather_object(names, slots, group=group)
        raise ValueError(f"fleet TensorParallel: the model-parallel ranks {list(group.ranks)} pass tensors in "
                         f"different places, {names}; the inputs are broadcast from rank {src}")
    size = heads[0][2]
    if size <= _HEADER - 3:
        packed = heads[0][3:3 + size]
    else:
        buf = torch.tensor(packed, dtype=torch.int64, device=dev) if is_src else torch.empty(
            size, dtype=torch.int64, device=dev)
        broadcast(buf, src, group=group)
        packed = buf.tolist()
    for slot, (shape, dtype) in zip(slots, _unpack(packed, len(slots))):
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
