"""ZeRO-style group sharding (Paddle's group_sharded_parallel): levels os, os_g and p_g_os."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist
import torch.nn as nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from ... import trace
from ...nn import ClipGradByGlobalNorm
from ...trace import Event

__all__ = [
    "LEVELS",
    "group_sharded_parallel",
    "save_group_sharded_model",
    "GroupShardedOptimizer",
    "GroupShardedScaler",
    "Piece",
    "memory_stats",
]

LEVELS = ("os", "os_g", "p_g_os")
MODEL_FILE = "model.pdmodel"
OPT_FILE = "model.pdopt"


@dataclass(frozen=True)
class Piece:
    """How one parameter is split over the group: ``ranges[i]`` = flat elements [lo, hi) group rank i owns.

    mode: ``slice`` (elementwise chunks, os/os_g), ``whole`` (kept whole, owned by one rank), ``fsdp`` (FSDP2
    dim-0 chunks, p_g_os), ``replicated`` (kept whole on every rank, p_g_os small parameters).
    """

    name: str
    shape: tuple
    mode: str
    ranges: tuple

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def owners(self) -> list:
        return [i for i, (lo, hi) in enumerate(self.ranges) if hi > lo]

    def __repr__(self) -> str:
        return f"Piece({self.name}, {list(self.shape)}, {self.mode}, {list(self.ranges)})"


class _Group:
    def __init__(self, pg, ranks):
        self.pg = pg
        self.ranks = list(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(tdist.get_rank())

    def span(self, op, nbytes):
        return trace.span("collective", op=op, group=self.ranks, bytes=int(nbytes))


def _validate(model, optimizer, level, scaler, segment_size, buffer_max_size, grad_clip):
    if level not in LEVELS:
        raise ValueError(
            f"group_sharded_parallel: level must be one of {', '.join(repr(v) for v in LEVELS)}, got {level!r}"
        )
    if not isinstance(model, nn.Module):
        raise ValueError(f"group_sharded_parallel: model must be a torch.nn.Module, got {type(model).__name__}")
    if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
        raise ValueError(
            f"group_sharded_parallel: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, GroupShardedOptimizer):
        raise ValueError("group_sharded_parallel: this optimizer is already sharded")
    for name, v in (("segment_size", segment_size), ("buffer_max_size", buffer_max_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"group_sharded_parallel: {name} must be a positive int, got {v!r}")
    if scaler is not None and not all(hasattr(scaler, a) for a in ("scale", "step", "update")):
        raise ValueError("group_sharded_parallel: scaler must be a GradScaler (scale/step/update)")
    if grad_clip is not None and not isinstance(grad_clip, ClipGradByGlobalNorm):
        raise ValueError("group_sharded_parallel: grad_clip must be a meshviz.nn.ClipGradByGlobalNorm")
    names = {id(p): n for n, p in model.named_parameters()}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in names:
                raise ValueError("group_sharded_parallel: the optimizer holds a parameter that is not in the model")
    seen = set()
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) in seen:
                raise ValueError(f"group_sharded_parallel: parameter {names[id(p)]} appears twice in the optimizer")
            seen.add(id(p))
    return names


def _resolve_group(group) -> _Group:
    if group is None:
        pg = tdist.group.WORLD
    else:
        pg = getattr(group, "process_group", group)
    if pg is None or pg == tdist.GroupMember.NON_GROUP_MEMBER:
        ranks = getattr(group, "ranks", "?")
        raise ValueError(f"group_sharded_parallel: rank {tdist.get_rank()} is not in the group {ranks}")
    ranks = tdist.get_process_group_ranks(pg)
    return _Group(pg, ranks)


def _chunks(n: int, k: int) -> list:
    c = -(-n // k) if n else 0
    return [(min(i * c, n), min((i + 1) * c, n)) for i in range(k)]


def plan_pieces(named_shapes, level: str, nranks: int, segment_size: int) -> list:
    """Who owns what, computed identically on every rank. ``named_shapes``: [(name, shape), ...]."""
    pieces, load = {}, [0] * nranks
    small = []
    for name, shape in named_shapes:
        n = math.prod(shape)
        if level == "p_g_os":
            if n >= segment_size and len(shape) >= 1:
                rows = _chunks(shape[0], nranks)
                row = n // shape[0] if shape[0] else 0
                pieces[name] = Piece(name, tuple(shape), "fsdp", tuple((a * row, b * row) for a, b in rows))
            else:
                pieces[name] = Piece(name, tuple(shape), "replicated", tuple((0, n) for _ in range(nranks)))
        elif n >= segment_size and n >= nranks:
            rs = tuple(_chunks(n, nranks))
            pieces[name] = Piece(name, tuple(shape), "slice", rs)
            for i, (lo, hi) in enumerate(rs):
                load[i] += hi - lo
        else:
            small.append((name, tuple(shape), n))
    # whole parameters: largest first, each to the least-loaded rank (Paddle's greedy partition)
    for name, shape, n in sorted(small, key=lambda s: -s[2]):
        owner = min(range(nranks), key=lambda i: (load[i], i))
        load[owner] += n
        pieces[name] = Piece(name, shape, "whole", tuple((0, n) if i == owner else (0, 0) for i in range(nranks)))
    return [pieces[name] for name, _ in named_shapes]


class _Slot:
    """This rank's view of one managed parameter."""

    __slots__ = ("name", "param", "piece", "lo", "hi", "shard", "grad_buf", "group_index")

    def __init__(self, name, param, piece, rank, group_index=0):
        self.name, self.param, self.piece, self.group_index = name, param, piece, group_index
        self.lo, self.hi = piece.ranges[rank]
        self.shard = None
        self.grad_buf = None

    @property
    def owned(self) -> bool:
        return self.hi > self.lo


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class GroupShardedOptimizer:
    """The sharded optimizer ``group_sharded_parallel`` returns; ``step``/``clear_grad`` like Paddle's.

    It drives the user's own optimizer, whose ``param_groups`` now hold only this rank's shards (so learning
    rate schedulers built on it keep working). ``ownership`` lists a ``Piece`` per parameter.
    """

    def __init__(self, inner, model, level, group: _Group, slots, offload, grad_clip, buffer_max_size):
        self._inner_opt = inner
        self._model = model
        self.level = level
        self._group = group
        self._slots = slots
        self._offload = offload
        self._grad_clip = grad_clip
        self._buffer_max_size = buffer_max_size
        self._dirty = False
        self._hooks = []

    # torch.optim.Optimizer look-alike, enough for GradScaler and LR schedulers
    @property
    def param_groups(self):
        return self._inner_opt.param_groups

    @property
    def state(self):
        return self._inner_opt.state

    @property
    def defaults(self):
        return self._inner_opt.defaults

    @property
    def ownership(self) -> list:
        return [s.piece for s in self._slots]

    @property
    def group_ranks(self) -> list:
        return list(self._group.ranks)

    def __repr__(self) -> str:
        return f"GroupShardedOptimizer({type(self._inner_opt).__name__}, level={self.level!r}, group={self._group.ranks})"

    def get_lr(self) -> float:
        return self._inner_opt.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        for g in self._inner_opt.param_groups:
            g["lr"] = lr

    # gradients --------------------------------------------------------------------------------------------
    def _mark_dirty(self, _p=None):
        self._dirty = True

    def _reduce_to_owner(self, slot: _Slot):
        """os_g backward hook: reduce this gradient so that only its owners keep their part, then free it."""
        p, g, grp = slot.param, slot.param.grad, self._group
        piece = slot.piece
        flat = g.detach().reshape(-1)
        if piece.mode == "slice":
            c = piece.ranges[0][1] - piece.ranges[0][0]
            if c * grp.size != flat.numel():
                flat = torch.cat([flat, flat.new_zeros(c * grp.size - flat.numel())])
            out = flat.new_empty(c)
            with grp.span("reduce_scatter", flat.numel() * flat.element_size()):
                tdist.reduce_scatter_single(out, flat.contiguous(), group=grp.pg)
            mine = out[: slot.hi - slot.lo]
        else:
            owner = piece.owners()[0]
            flat = flat.clone() if owner == grp.rank else flat
            with grp.span("reduce", flat.numel() * flat.element_size()) as ev:
                if ev is not None:
                    ev.peer = grp.ranks[owner]
                tdist.reduce(flat, dst=grp.ranks[owner], group=grp.pg)
            mine = flat if owner == grp.rank else None
        if mine is not None:
            mine = mine.div_(grp.size)
            if self._offload and mine.device.type != "cpu":
                mine = mine.to("cpu")
            if slot.grad_buf is None:
                slot.grad_buf = mine
            else:
                slot.grad_buf.add_(mine)
            slot.shard.grad = slot.grad_buf
        p.grad = None

    def _sync_grads(self):
        """Average whole gradients over the group (os: all of them; p_g_os: the replicated small ones)."""
        if not self._dirty:
            return
        self._dirty = False
        grp = self._group
        slots = [s for s in self._slots if s.piece.mode in ("slice", "whole", "replicated")]
        if grp.size > 1:
            has = torch.tensor([s.param.grad is not None for s in slots], dtype=torch.uint8)
            with grp.span("all_reduce", has.numel()):
                tdist.all_reduce(has, op=tdist.ReduceOp.MAX, group=grp.pg)
            live = [s for s, h in zip(slots, has.tolist()) if h]
            for s in live:
                if s.param.grad is None:
                    s.param.grad = torch.zeros_like(s.param)
            self._bucketed_all_reduce([s.param.grad for s in live])
        else:
            live = [s for s in slots if s.param.grad is not None]
        for s in live:
            if s.shard is None or s.shard is s.param or not s.owned:
                continue
            g = s.param.grad.detach().reshape(-1)[s.lo : s.hi]
            s.shard.grad = g.to("cpu") if s.shard.device != g.device else g

    def _bucketed_all_reduce(self, grads):
        grp = self._group
        bucket, size = [], 0

        def flush():
            if not bucket:
                return
            flat = torch.cat([g.detach().reshape(-1) for g in bucket])
            with grp.span("all_reduce", flat.numel() * flat.element_size()):
                tdist.all_reduce(flat, group=grp.pg)
            flat.div_(grp.size)
            off = 0
            for g in bucket:
                n = g.numel()
                g.detach().copy_(flat[off : off + n].view_as(g))
                off += n
            bucket.clear()

        for g in grads:
            if bucket and (size + g.numel() > self._buffer_max_size or g.dtype != bucket[0].dtype):
                flush()
                size = 0
            bucket.append(g)
            size += g.numel()
        flush()

    def _clip(self):
        clip = self._grad_clip or getattr(self._inner_opt, "_grad_clip", None)
        if clip is None:
            return None
        sharded, replicated = [], []
        for s in self._slots:
            if s.piece.mode == "fsdp":
                g = s.param.grad
                if g is not None:
                    sharded.append(_local(g))
            elif s.piece.mode == "replicated":
                replicated.append(s.param.grad)
            elif s.owned and s.shard is not None:
                sharded.append(s.shard.grad)
        return clip.clip_pieces(sharded, replicated, group=self._group.pg)

    # step -------------------------------------------------------------------------------------------------
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_grads()
        self._clip()
        with trace.span("compute", op="optimizer_step", group=self._group.ranks):
            self._inner_opt.step()
        if self.level in ("os", "os_g"):
            self._gather_params()
        return loss

    @torch.no_grad()
    def _gather_params(self):
        grp = self._group
        for s in self._slots:
            p, piece = s.param, s.piece
            flat = p.detach().view(-1)
            if self._offload and s.shard is not None and s.owned and s.shard.device != p.device:
                flat[s.lo : s.hi].copy_(s.shard.detach(), non_blocking=False)
            if grp.size == 1:
                continue
            if piece.mode == "slice":
                c = piece.ranges[0][1] - piece.ranges[0][0]
                mine = flat.new_zeros(c)
                mine[: s.hi - s.lo] = flat[s.lo : s.hi]
                out = flat.new_empty(c * grp.size)
                with grp.span("all_gather", out.numel() * out.element_size()):
                    tdist.all_gather_single(out, mine, group=grp.pg)
                flat.copy_(out[: flat.numel()])
            else:
                owner = piece.owners()[0]
                with grp.span("broadcast", flat.numel() * flat.element_size()) as ev:
                    if ev is not None:
                        ev.peer = grp.ranks[owner]
                    tdist.broadcast(flat, src=grp.ranks[owner], group=grp.pg)

    def zero_grad(self, set_to_none: bool = True):
        for s in self._slots:
            s.param.grad = None
            s.grad_buf = None
            if s.shard is not None:
                s.shard.grad = None
        self._dirty = False

    clear_grad = zero_grad

    def minimize(self, loss):
        loss.backward()
        self.step()

    # state ------------------------------------------------------------------------------------------------
    def state_dict(self):
        """This rank's shard of the optimizer state (torch format over its shard parameters)."""
        return self._inner_opt.state_dict()

    def load_state_dict(self, state):
        self._inner_opt.load_state_dict(state)

    def full_state_dict(self, to_rank: int | None = 0):
        """The optimizer state of the whole model, in the unwrapped optimizer's format (collective)."""
        return _full_optimizer_state(self, to_rank)


def _broadcast_module(module, grp: _Group, tensors="all"):
    items = []
    if tensors in ("all", "params"):
        items += [p for p in module.parameters()]
    if tensors in ("all", "buffers"):
        items += [b for b in module.buffers()]
    with torch.no_grad():
        for t in items:
            with grp.span("broadcast", t.numel() * t.element_size()):
                tdist.broadcast(t.data, src=grp.ranks[0], group=grp.pg)


class GroupShardedScaler(ShardedGradScaler):
    """GradScaler for sharded training: syncs gradients first, agrees on inf/NaN over the group.

    Paddle's ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` works as in torch;
    ``minimize(optimizer, scaled_loss)`` is Paddle's step + update.
    """

    def unscale_(self, optimizer):
        sync = getattr(optimizer, "_sync_grads", None)
        if sync is not None:
            sync()
        return super().unscale_(optimizer)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        # local blocks of DTensor gradients and plain gradients together; one found_inf per rank, so every
        # rank joins the same single all-reduce whatever devices its shards live on
        per = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        g = _local(p.grad)
                        per.setdefault((g.device, g.dtype), []).append(g)
            for (dev, _), grads in per.items():
                fi = torch.zeros(1, device=dev)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, fi, inv_scale.to(dev))
                found_inf += fi.to(found_inf.device)
        return {found_inf.device: found_inf}

    def minimize(self, optimizer, *args, **kwargs):
        self.step(optimizer)
        self.update()


def _make_scaler(scaler, grp: _Group, device_type: str):
    if scaler is None or isinstance(scaler, GroupShardedScaler):
        return scaler
    kw = dict(
        init_scale=getattr(scaler, "_init_scale", 2.0**16),
        growth_factor=getattr(scaler, "_growth_factor", 2.0),
        backoff_factor=getattr(scaler, "_backoff_factor", 0.5),
        growth_interval=getattr(scaler, "_growth_interval", 2000),
        enabled=getattr(scaler, "_enabled", True),
    )
    return GroupShardedScaler(device=getattr(scaler, "_device", device_type), process_group=grp.pg, **kw)


def _emit_ownership(level, grp: _Group, slots):
    if not trace.active():
        return
    for s in slots:
        piece = s.piece
        lo, hi = piece.ranges[grp.rank]
        holds = {
            "os": {"param": [0, piece.numel], "grad": [0, piece.numel], "state": [lo, hi]},
            "os_g": {"param": [0, piece.numel], "grad": [lo, hi], "state": [lo, hi]},
            "p_g_os": {"param": [lo, hi], "grad": [lo, hi], "state": [lo, hi]},
        }[level]
        trace.emit(
            Event(
                kind="ownership",
                name=s.name,
                op=level,
                group=grp.ranks,
                shape_before=list(piece.shape),
                local_shape=[hi - lo],
                bytes=(hi - lo) * s.param.element_size(),
                extra={"mode": piece.mode, "numel": piece.numel, "ranges": [list(r) for r in piece.ranges], **holds},
            )
        )


def group_sharded_parallel(
    model,
    optimizer,
    level,
    scaler=None,
    group=None,
    offload=False,
    sync_buffers=False,
    buffer_max_size=2**23,
    segment_size=2**20,
    sync_comm=False,
    *,
    grad_clip=None,
):
    """Shard optimizer states ('os'), also gradients ('os_g'), also parameters ('p_g_os') over ``group``.

    Returns ``(model, optimizer, scaler)``. Every rank of the group calls it. Parameters start from the group's
    first rank. ``segment_size``: parameters with fewer elements stay whole (os/os_g: owned by one rank,
    chosen greedily by size; p_g_os: replicated). 'os' averages whole gradients once per step; 'os_g' reduces
    each gradient to its owners as soon as backward produces it and frees it; 'p_g_os' is torch FSDP2
    (``fully_shard``) on each child module and the root. ``offload`` keeps optimizer shards (and, for p_g_os,
    parameters) on the CPU when the ranks compute on GPUs. ``grad_clip`` (or ``optimizer._grad_clip``): a
    ``meshviz.nn.ClipGradByGlobalNorm`` applied to the sharded gradients with the true global norm.
    ``buffer_max_size`` bounds the fused all-reduce of 'os' (elements); ``sync_comm`` is accepted for
    compatibility (torch orders its own communication).
    """
    names = _validate(model, optimizer, level, scaler, segment_size, buffer_max_size, grad_clip)
    from ..env import device as _device, init_parallel_env

    init_parallel_env()
    grp = _resolve_group(group)
    dev = _device()
    _broadcast_module(model, grp)

    order = [p for g in optimizer.param_groups for p in g["params"]]
    pieces = plan_pieces([(names[id(p)], tuple(p.shape)) for p in order], level, grp.size, segment_size)
    piece_of = {pc.name: pc for pc in pieces}

    if level == "p_g_os":
        _apply_fsdp(model, piece_of, grp, dev, offload)
        new_params = dict(model.named_parameters())
        for g in optimizer.param_groups:
            g["params"] = [new_params[names[id(p)]] for p in g["params"]]
        order = [p for g in optimizer.param_groups for p in g["params"]]

    gidx = [gi for gi, g in enumerate(optimizer.param_groups) for _ in g["params"]]
    slots = [_Slot(pc.name, p, pc, grp.rank, gi) for p, pc, gi in zip(order, pieces, gidx)]
    slot_of = {id(s.param): s for s in slots}
    optimizer.state.clear()
    offload = bool(offload) and dev.type != "cpu"
    if level in ("os", "os_g"):
        for g in optimizer.param_groups:
            shards = []
            for p in g["params"]:
                s = slot_of[id(p)]
                if not s.owned:
                    continue
                if not p.is_contiguous():
                    p.data = p.data.contiguous()
                view = p.detach().view(-1)[s.lo : s.hi]
                s.shard = nn.Parameter(view.to("cpu", copy=True) if offload else view)
                shards.append(s.shard)
            g["params"] = shards
    else:
        for s in slots:
            s.shard = s.param

    opt = GroupShardedOptimizer(optimizer, model, level, grp, slots, offload, grad_clip, buffer_max_size)
    for s in slots:
        if level == "os_g":
            hook = (lambda slot: (lambda p: opt._reduce_to_owner(slot)))(s)
        elif level == "os" or s.piece.mode == "replicated":
            hook = opt._mark_dirty
        else:
            continue
        opt._hooks.append(s.param.register_post_accumulate_grad_hook(hook))
    if sync_buffers:
        model.register_forward_pre_hook(lambda m, args: _broadcast_module(m, grp, "buffers"))
    _emit_ownership(level, grp, slots)
    return model, opt, _make_scaler(scaler, grp, dev.type)


def _apply_fsdp(model, piece_of, grp: _Group, dev, offload):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    names = {id(p): n for n, p in model.named_parameters()}
    ignored = {p for p in model.parameters() if piece_of.get(names[id(p)]) is None or piece_of[names[id(p)]].mode != "fsdp"}
    if len(ignored) == len(list(model.parameters())):
        return
    mesh = DeviceMesh.from_group(grp.pg, dev.type)
    policy = CPUOffloadPolicy() if (offload and dev.type != "cpu") else OffloadPolicy()
    for child in model.children():
        if any(p not in ignored for p in child.parameters()):
            fully_shard(child, mesh=mesh, offload_policy=policy, ignored_params=ignored)
    fully_shard(model, mesh=mesh, offload_policy=policy, ignored_params=ignored)


# saving -------------------------------------------------------------------------------------------------------
def _gather_object(obj, grp: _Group, to_rank):
    if grp.size == 1:
        return [obj]
    out = [None] * grp.size
    tdist.all_gather_object(out, obj, group=grp.pg)
    return out


def _full_optimizer_state(opt: GroupShardedOptimizer, to_rank=0):
    grp, inner = opt._group, opt._inner_opt
    # index of each slot in the unwrapped optimizer's flat parameter order
    local = {}
    for i, s in enumerate(opt._slots):
        if s.piece.mode == "fsdp":
            st = inner.state.get(s.param, {})
            full = {}
            for k in sorted(st):
                v = st[k]
                full[k] = v.full_tensor() if hasattr(v, "full_tensor") else v
            if grp.rank == 0:
                local[i] = ("full", {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in full.items()})
        elif s.piece.mode == "replicated":
            if grp.rank == 0:
                st = inner.state.get(s.param, {})
                local[i] = ("full", {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in st.items()})
        elif s.owned:
            st = inner.state.get(s.shard, {})
            local[i] = ((s.lo, s.hi), {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in st.items()})
    parts = _gather_object(local, grp, to_rank)
    state = {}
    for i, s in enumerate(opt._slots):
        n, shape = s.piece.numel, s.piece.shape
        merged = {}
        for part in parts:
            if i not in part:
                continue
            where, st = part[i]
            for k, v in st.items():
                if where == "full" or not torch.is_tensor(v) or v.dim() == 0 or v.numel() != where[1] - where[0]:
                    merged.setdefault(k, v)
                    continue
                buf = merged.get(k)
                if buf is None or buf.dim() == 0 or buf.numel() != n:
                    buf = merged[k] = torch.zeros(n, dtype=v.dtype)
                buf[where[0] : where[1]] = v.reshape(-1)
        for k, v in list(merged.items()):
            if torch.is_tensor(v) and v.dim() == 1 and v.numel() == n and len(shape) != 1:
                merged[k] = v.view(shape)
        if merged:
            state[i] = merged
    groups = []
    for gi, g in enumerate(inner.param_groups):
        idx = [i for i, s in enumerate(opt._slots) if s.group_index == gi]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": idx})
    return {"state": state, "param_groups": groups}


def save_group_sharded_model(model, output, optimizer=None):
    """Write the full model (``output/model.pdmodel``) and optimizer (``output/model.pdopt``) with torch.save.

    Every rank of the sharding group calls it (it gathers); the group's first rank writes. The files hold
    plain tensors: ``model.load_state_dict(torch.load(".../model.pdmodel"))`` on an unwrapped model, and
    ``opt.load_state_dict(torch.load(".../model.pdopt"))`` on its unwrapped optimizer.
    """
    if os.path.isfile(output):
        raise ValueError(f"save_group_sharded_model: output ({output}) must be a directory, not a file")
    if optimizer is not None and not isinstance(optimizer, GroupShardedOptimizer):
        raise ValueError("save_group_sharded_model: optimizer must be the one group_sharded_parallel returned")
    grp = optimizer._group if optimizer is not None else _resolve_group(None)
    sd = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        sd[k] = v.detach().cpu().clone()
    osd = optimizer.full_state_dict() if optimizer is not None else None
    if grp.rank == 0:
        os.makedirs(output, exist_ok=True)
        torch.save(sd, os.path.join(output, MODEL_FILE))
        if osd is not None:
            torch.save(osd, os.path.join(output, OPT_FILE))
    if grp.size > 1:
        tdist.barrier(group=grp.pg)


def memory_stats(model, optimizer=None) -> dict:
    """Bytes this rank holds now: parameters, gradients, optimizer states (each storage counted once)."""
    seen = set()

    def nbytes(tensors):
        total = 0
        for t in tensors:
            if t is None or not torch.is_tensor(t):
                continue
            st = _local(t).untyped_storage()
            if st.data_ptr() in seen or st.nbytes() == 0:
                continue
            seen.add(st.data_ptr())
            total += st.nbytes()
        return total

    params = list(model.parameters())
    out = {"params": nbytes(params)}
    grads = [p.grad for p in params]
    inner = optimizer
    if isinstance(optimizer, GroupShardedOptimizer):
        grads += [s.grad_buf for s in optimizer._slots] + [s.shard.grad for s in optimizer._slots if s.shard is not None]
        inner = optimizer._inner_opt
    out["grads"] = nbytes(grads)
    states = []
    if inner is not None:
        for st in inner.state.values():
            states += [v for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    out["states"] = nbytes(states)
    out["total"] = out["params"] + out["grads"] + out["states"]
    return out
