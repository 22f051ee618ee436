"""Level p_g_os: torch FSDP2 (``fully_shard``) on each child module and the root, small parameters kept whole."""

from __future__ import annotations

import torch
import torch.distributed as tdist
from torch import nn

from ... import compat, trace
from ...compat.fsdp import comm_bases
from ..comm import Call, CollectiveOp, run
from ..data_parallel import tensors_in
from ..devices import device
from ..match import checking
from .group import ShardingGroup

__all__ = ["apply_fsdp", "unmix_foreach"]


def apply_fsdp(model, piece_of: dict, grp: ShardingGroup, dev, offload, used: dict | None = None) -> None:
    """Shard the parameters whose piece is ``fsdp`` over ``grp``; the others are ignored by FSDP (replicated).

    ``used`` (given): every unit's backward gives each of its parameters a gradient, zeros where this rank's
    backward made none (a branch another rank took), so that the ranks reduce-scatter the same tensors; it records
    ``id(param)`` -> "used" (a gradient of its own), "zeros" (zeros, and it had none) or "added" (zeros added).
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    names = {id(p): n for n, p in model.named_parameters()}
    ignored = {p for p in model.parameters()
               if piece_of.get(names[id(p)]) is None or piece_of[names[id(p)]].mode != "fsdp"}
    if len(ignored) == len(list(model.parameters())):
        return
    mesh = DeviceMesh.from_group(grp.pg, dev.type)
    policy = CPUOffloadPolicy() if (offload and dev.type != "cpu") else OffloadPolicy()
    units = [child for child in _units(model) if any(p not in ignored for p in child.parameters())]
    tied = _tied(model, units, ignored)
    for together in tied:
        fully_shard(together if len(together) > 1 else together[0], mesh=mesh, offload_policy=policy,
                    ignored_params=ignored)
    units = [u for together in tied for u in together]
    fully_shard(model, mesh=mesh, offload_policy=policy, ignored_params=ignored)
    names = {id(m): n or "the model" for n, m in model.named_modules()}
    if trace.active() or checking():
        # FSDP2's own gathers and reduce-scatters then go through the comm layer: traced, in the roll-call, and
        # matched; untraced, torch issues them itself, as DataParallel's buckets go through it only when traced
        for together in tied + [[model]]:
            _through_comm_layer(together[0], grp, "+".join(names[id(u)] for u in together))
    if used is not None:
        seen: set = set()
        for i, unit in enumerate(units + [model]):
            for group in _param_groups(unit):
                if id(group) not in seen:  # units sharded together share one group
                    seen.add(id(group))
                    _fill_unused(group, used)
            unit.register_forward_pre_hook(_same_unit(i, [names[id(u)] for u in units + [model]], grp),
                                           prepend=True)
        _anchor_units(model, units)


def _anchor_units(model, units: list) -> None:
    """Make every backward through the model's output reach each unit whose forward ran, with zeros where the loss
    does not read the unit's output: FSDP2 would otherwise reduce-scatter such a unit's gradients at the end of this
    rank's backward, after the others' units, while a rank whose loss reads it does so in the backward's order, and
    the ranks' collectives would no longer match."""
    ran: list = []

    def record(module, args, output):
        if torch.is_grad_enabled():
            ran.extend(t for t in tensors_in(output) if t.requires_grad)

    def anchor(module, args, output):
        if not ran or not torch.is_grad_enabled():
            ran.clear()
            return None
        # a zero read from an empty slice of each (no 0 * inf): its backward gives each output a zero gradient
        zero = sum(h.reshape(-1)[:0].sum().float() for h in ran)
        ran.clear()
        return _map_tensors(output, lambda t: t + zero.to(t.dtype) if t.requires_grad and t.is_floating_point() else t)

    for unit in units:
        unit.register_forward_hook(record)
    model.register_forward_pre_hook(lambda module, args: ran.clear(), prepend=True)
    model.register_forward_hook(anchor)


def _map_tensors(x, fn):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if type(x) in (list, tuple):  # a container of another type is left as it is
        return type(x)(_map_tensors(v, fn) for v in x)
    if type(x) is dict:
        return {k: _map_tensors(v, fn) for k, v in x.items()}
    return x


def _tied(model, units: list, ignored) -> list:
    """``units`` in groups sharded together: units that share a sharded parameter (tied weights, such as an
    embedding and the output layer) go in one group (FSDP2 manages a parameter in one group only), and units that
    share one with a module outside every unit are left to the root's group."""
    unit_of = {}
    for i, unit in enumerate(units):
        for m in unit.modules():
            unit_of[id(m)] = i
    parent = list(range(len(units) + 1))  # the last one: the root

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict = {}
    for m in model.modules():
        at = unit_of.get(id(m), len(units))
        for p in m._parameters.values():
            if p is None or p in ignored:
                continue
            a, b = sorted((find(first.setdefault(id(p), at)), find(at)))
            parent[a] = b  # the root, where it is one of them, stays the root
    groups: dict = {}
    for i, unit in enumerate(units):
        if find(i) != find(len(units)):
            groups.setdefault(find(i), []).append(unit)
    return list(groups.values())


def _through_comm_layer(unit, grp: ShardingGroup, name: str) -> None:
    """``unit``'s all-gathers and reduce-scatters issued through :func:`~meshviz.runtime.comm.run` (torch's
    ``set_custom_all_gather`` / ``set_custom_reduce_scatter``), named ``name``."""
    AllGather, ReduceScatter = comm_bases()

    def empty(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    class Gather(AllGather):
        allocate = empty

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            works: list = []
            run(Call(CollectiveOp.ALL_GATHER, grp.group, lambda g: works.append(compat.all_gather_single(
                output_tensor, input_tensor, group=group, async_op=True)) or works[0],
                tensors=(input_tensor,), sync_op=not async_op, name=f"p_g_os {name}"))
            return works[0] if async_op else None

    class Scatter(ReduceScatter):
        allocate = empty

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            works: list = []
            run(Call(CollectiveOp.REDUCE_SCATTER, grp.group, lambda g: works.append(compat.reduce_scatter_single(
                output_tensor, input_tensor, op=op, group=group, async_op=True)) or works[0],
                tensors=(input_tensor,), sync_op=not async_op, name=f"p_g_os {name}",
                reduce_op="avg" if op == tdist.ReduceOp.AVG else "sum"))
            return works[0] if async_op else None

    unit.set_custom_all_gather(Gather())
    unit.set_custom_reduce_scatter(Scatter())


def _same_unit(index: int, names: list, grp: ShardingGroup):
    """A pre-forward hook (ahead of FSDP's gather): with collective checking on, the ranks check that they gather
    the same sublayer, and every rank raises where one runs a sharded sublayer that another skips."""

    def check(module, args):
        if grp.size == 1 or not checking():
            return
        out = torch.empty(grp.size, dtype=torch.int64, device=device())
        grp.all_gather_into(out, torch.tensor([index], dtype=torch.int64, device=device()))
        ran = out.tolist()
        if len(set(ran)) > 1:
            raise RuntimeError(
                "group_sharded_parallel (p_g_os): the ranks run different sharded sublayers here ("
                + ", ".join(f"rank {r} {names[i]!r}" for r, i in zip(grp.ranks, ran)) + "): every rank of the group "
                "must run the forward of each sublayer whose parameters are sharded (they are gathered for it); "
                "take the branch on every rank, or keep that sublayer whole (segment_size) or use level 'os_g'")

    return check


def _param_groups(unit) -> list:
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12
    if groups is None:
        groups = [state._fsdp_param_group] if getattr(state, "_fsdp_param_group", None) is not None else []
    return list(groups)


def _fill_unused(group, used: dict) -> None:
    """Before ``group``'s post-backward reduce-scatters: zeros for each parameter without a gradient (torch's
    ``set_reduce_scatter_unused_params``, which torch 2.11 lacks, and with a record of which were made)."""
    post_backward = group.post_backward

    def fill(*args, **kwargs):
        for fp in group.fsdp_params:
            if not hasattr(fp, "_unsharded_param") or not fp.unsharded_param.requires_grad:
                continue  # never gathered (no forward), or frozen
            key = id(fp.sharded_param)
            if fp.unsharded_param.grad is not None or getattr(fp, "unsharded_accumulated_grad", None) is not None:
                used[key] = "used"
            elif fp.unsharded_param.untyped_storage().size():  # gathered now: this unit ran its backward
                fp.unsharded_param.grad = torch.zeros_like(fp.unsharded_param)
                used.setdefault(key, "added" if fp.sharded_param.grad is not None else "zeros")
        return post_backward(*args, **kwargs)

    group.post_backward = fill


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
