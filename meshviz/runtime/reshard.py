"""Executes the planner's reshard steps with torch collectives on this rank's local block."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist

from .. import compat, rank_context, trace
from ..core.crossmesh import landing
from ..core.layout import chunk, local_block
from ..core.partial import partial_fill
from ..core.placements import ReduceType, Shard
from ..core.planner import Plan, Step
from ..trace.state import trace_state
from . import groups
from .comm import Call, CollectiveOp, all_to_all_flat, divide_, peer_names, reduction, run
from .devices import staged_recv, staged_send
from .dtensor import to_torch_placements
from .reshard_events import issued_now, plan_event, run_traced, step_event, traced_plan

__all__ = ["run_plan", "run_step", "run_plans", "check_runnable", "BUCKET_BYTES"]

@dataclass
class ReshardState:
    plan_ids: itertools.count = field(default_factory=lambda: itertools.count(1))  # alike on every rank: events pair up


RESHARD = rank_context.slot("reshard", ReshardState)


def _state() -> ReshardState:
    return RESHARD.get()


def _block_shape(step: Step, placements, mesh, coord) -> list[int]:
    return [b - a for a, b in local_block(step.shape, mesh, placements, coord)]


def _line_coords(step: Step, rank: int):
    coord = step.mesh.coordinate(rank)
    out = []
    for j in range(step.mesh.shape[step.axis]):
        c = list(coord)
        c[step.axis] = j
        out.append(tuple(c))
    return coord, out


@dataclass(frozen=True)
class _Line:
    """A rank's line along a step's axis: its coordinate, the line's coordinates and ranks (mesh order), its index
    in the line, and (all_gather, all_to_all) each member's block size along ``step.dim`` before the step."""

    coord: tuple
    coords: list
    ranks: tuple
    index: int
    sizes: list | None


_lines: dict = {}  # (id(step), rank) -> (step, _Line): pure facts of a plan's step, asked on every run


def _line(step: Step, rank: int) -> _Line:
    hit = _lines.get((id(step), rank))
    if hit is not None and hit[0] is step:
        return hit[1]
    coord, coords = _line_coords(step, rank)
    sizes = None
    if step.op in ("all_gather", "all_to_all"):
        sizes = [_block_shape(step, step.before, step.mesh, c)[step.dim] for c in coords]
    line = _Line(coord, coords, step.mesh.axis_group_of(rank, step.axis), coord[step.axis], sizes)
    if len(_lines) >= 4096:
        _lines.clear()
    _lines[(id(step), rank)] = (step, line)
    return line


def _reduce_type(step: Step, dtype: torch.dtype) -> ReduceType | None:
    """The reduction a step runs on a block of ``dtype``: the mean of bools is true where any summand is, their sum
    in bool (as Paddle's), not a division a bool cannot hold."""
    if step.reduce is ReduceType.kRedAvg and dtype is torch.bool:
        return ReduceType.kRedSum
    return step.reduce


def check_runnable(plan: Plan, dtype: torch.dtype) -> None:
    """ValueError, on every rank before any step communicates, for a plan no rank can finish: one that reduces a
    complex tensor by max or min (complex numbers have no order) or ends in a co-shard order a dist tensor cannot
    hold."""
    if dtype.is_complex:
        bad = [s.reduce for s in plan.steps if s.reduce in (ReduceType.kRedMax, ReduceType.kRedMin)
               and s.op in ("all_reduce", "reduce_scatter")]
        if bad:
            raise ValueError(f"reshard {list(plan.src_placements)} -> {list(plan.dst_placements)} reduces a {dtype} "
                             f"tensor by {bad[0].short}: complex numbers have no order, so Partial({bad[0].short}) of "
                             f"one cannot be reduced; use Partial(sum), Partial(avg) or a real dtype")
    if any(isinstance(p, Shard) and p.co_shard_order for p in plan.dst_placements):
        to_torch_placements(plan.dst_placements)  # raises for an order torch DTensor cannot hold


def _all_gather(step: Step, local: torch.Tensor, group, sizes: list) -> torch.Tensor:
    d = step.dim
    k = len(sizes)
    out_shape = list(local.shape)
    out_shape[d] = sum(sizes)
    if len(set(sizes)) == 1 and d == 0:
        out = local.new_empty(out_shape)
        src = local.contiguous()
        run(Call(CollectiveOp.ALL_GATHER, group, lambda g: compat.all_gather_single(out, src, group=g.process_group),
                 tensors=(src,), nbytes=src.numel() * src.element_size() * k, traced=False))
        return out
    m = max(sizes)
    moved = local.movedim(d, 0)
    if moved.shape[0] < m:
        pad = moved.new_zeros((m - moved.shape[0],) + tuple(moved.shape[1:]))
        moved = torch.cat([moved, pad])
    buf = moved.new_empty((k * m,) + tuple(moved.shape[1:]))
    src = moved.contiguous()
    run(Call(CollectiveOp.ALL_GATHER, group, lambda g: compat.all_gather_single(buf, src, group=g.process_group),
             tensors=(src,), nbytes=src.numel() * src.element_size() * k, traced=False))
    # block i is buf[i*m : i*m + sizes[i]]; a full block ends where the next begins, so runs of them are one slice
    # (even blocks: buf itself; ceil-chunked ones: at most two slices, not one op per rank of the line)
    spans: list[list[int]] = []
    for i, s in enumerate(sizes):
        if s == 0:
            continue
        if spans and spans[-1][1] == i * m:
            spans[-1][1] = i * m + s
        else:
            spans.append([i * m, i * m + s])
    if not spans:
        joined = buf[:0]
    elif len(spans) == 1 and spans[0] == [0, k * m]:
        joined = buf
    elif len(spans) == 1:
        joined = buf[spans[0][0] : spans[0][1]]  # at dim 0 a copy: a view would keep the padding alive with it
        if d == 0:
            return joined.clone()
    else:
        joined = torch.cat([buf[a:b] for a, b in spans])
    return joined.movedim(0, d).contiguous()


_CHUNK_BYTES = 4 << 20


def _all_reduce(step: Step, local: torch.Tensor, group, fresh: bool = False) -> torch.Tensor:
    """``fresh``: ``local`` is the caller's to overwrite (a bucket, a block no one else holds): it is reduced in
    place."""
    op, finish = reduction(_reduce_type(step, local.dtype), group)
    src = local.contiguous()
    if group.backend == "simulated":  # nothing moves: the overlap chunks buy is nil, their ops are not
        out = src if fresh else src.clone()
        run(Call(CollectiveOp.ALL_REDUCE, group,
                 lambda g: [tdist.all_reduce(out, op=op, group=g.process_group, async_op=True)],
                 tensors=(src,), traced=False))
        if finish is not None:
            finish(out)
        return out
    out = src if fresh else torch.empty_like(src)
    flat_out, flat_in = out.view(-1), src.view(-1)
    n = flat_out.numel()
    per = max(1, _CHUNK_BYTES // max(1, src.element_size()))

    def start(g):
        # copy the next chunk while the previous one is reduced: the result must be a new tensor, and this hides
        # the copy (on gloo chunks even beat one in-place all_reduce of the whole tensor)
        works = []
        for i in range(0, n, per):
            if not fresh:
                flat_out[i : i + per].copy_(flat_in[i : i + per])
            works.append(tdist.all_reduce(flat_out[i : i + per], op=op, group=g.process_group, async_op=True))
        if n == 0:
            works.append(tdist.all_reduce(flat_out, op=op, group=g.process_group, async_op=True))
        return works

    run(Call(CollectiveOp.ALL_REDUCE, group, start, tensors=(src,), traced=False))
    if finish is not None:
        finish(out)
    return out


def _reduce_scatter(step: Step, local: torch.Tensor, group, k: int, my_index) -> torch.Tensor:
    d = step.dim
    rt = _reduce_type(step, local.dtype)
    sizes = [chunk(local.shape[d], k, j) for j in range(k)]
    lens = [b - a for a, b in sizes]
    if rt in (ReduceType.kRedSum, ReduceType.kRedAvg) and len(set(lens)) == 1:
        # even chunks: one reduce-scatter along dim 0 (another dim moved there first), not an all-to-all of k pieces
        op, finish = reduction(rt, group)
        src = local.movedim(d, 0).contiguous() if d else local.contiguous()
        out = src.new_empty((lens[0],) + tuple(src.shape[1:]))
        run(Call(CollectiveOp.REDUCE_SCATTER, group,
                 lambda g: compat.reduce_scatter_single(out, src, op=op, group=g.process_group), tensors=(src,),
                 traced=False))
        if finish is not None:
            finish(out)
        return out.movedim(0, d).contiguous() if d else out
    # every reduction and uneven chunks: an all-to-all of the chunks, then a local reduction
    moved = local.movedim(d, 0)
    pieces = [moved[a:b].contiguous() for a, b in sizes]
    recv = [torch.empty_like(pieces[my_index]) for _ in range(k)]
    _all_to_all(recv, pieces, group)
    stack = torch.stack(recv)
    if rt in (ReduceType.kRedSum, ReduceType.kRedAvg):
        red = stack.sum(0, dtype=stack.dtype)  # as the collectives reduce: in the tensor's dtype (int32 stays int32)
    elif rt == ReduceType.kRedMax:
        red = stack.amax(0)
    elif rt == ReduceType.kRedMin:
        red = stack.amin(0)
    else:
        red = stack.prod(0, dtype=stack.dtype)
    out = red.movedim(0, d).contiguous()
    if rt == ReduceType.kRedAvg:
        divide_(out, k)
    return out


def _all_to_all(recv: list, send: list, group) -> None:
    """all_to_all on flattened buffers (works on gloo, uneven pieces included)."""
    unpack = []

    def start(g):
        work, fn = all_to_all_flat(recv, send, g.process_group)
        unpack.append(fn)
        return work

    run(Call(CollectiveOp.ALL_TO_ALL, group, start, tensors=send, traced=False, then=lambda: unpack[0]()))


def _all_to_all_dims(step: Step, local: torch.Tensor, group, a_sizes: list, my_index) -> torch.Tensor:
    a, b = step.dim, step.dst_dim
    k = len(a_sizes)
    splits = [chunk(local.shape[b], k, j) for j in range(k)]
    my_b = splits[my_index][1] - splits[my_index][0]
    even = local.shape[b] % k == 0 and len(set(a_sizes)) == 1
    if even:
        # one copy to pack (partner j's columns become the j-th contiguous piece), none to unpack when a == 0
        packed = local.unflatten(b, (k, my_b)).movedim(b, 0).contiguous().reshape(-1)
        out = torch.empty_like(packed)
        run(Call(CollectiveOp.ALL_TO_ALL, group, lambda g: tdist.all_to_all_single(out, packed, group=g.process_group),
                 tensors=(packed,), traced=False))
        piece = list(local.shape)
        piece[b] = my_b
        stacked = out.view([k] + piece)  # [k, ..., a_j, ..., my_b, ...]
        if a == 0:
            return stacked.view([k * piece[0]] + piece[1:])
        return stacked.movedim(0, a).flatten(a, a + 1).contiguous()
    send = [local.narrow(b, lo, hi - lo).contiguous() for lo, hi in splits]
    recv = []
    for j in range(k):
        shp = list(local.shape)
        shp[a] = a_sizes[j]
        shp[b] = my_b
        recv.append(local.new_empty(shp))
    _all_to_all(recv, send, group)
    return torch.cat(recv, dim=a).contiguous()


def _slice(step: Step, local: torch.Tensor, k: int, my_index: int) -> torch.Tensor:
    lo, hi = chunk(local.shape[step.dim], k, my_index)
    return local.narrow(step.dim, lo, hi - lo).clone()


def _send_recv(step: Step, local: torch.Tensor | None, rank: int, dtype, device) -> torch.Tensor | None:
    dst_mesh = step.target_mesh
    ops, tensors, result, pending, copy_back = [], [], None, [], []
    shp = _block_shape(step, step.after, dst_mesh, dst_mesh.coordinate(rank)) if dst_mesh.contains(rank) else []
    whole = None  # this rank's block, where pieces of several sources make it up (or an empty piece of one)
    if step.blocks is not None and (sum(t == rank for _, t in step.groups) > 1 or 0 in shp):
        whole = torch.empty(shp, dtype=dtype, device=device)
    for j, (s, t) in enumerate(step.groups):
        blk = step.blocks[j] if step.blocks is not None else None
        if blk is not None and s != t and any(b == a for a, b in blk):  # an empty piece (of an empty block): no
            continue  # message, which gloo could pair with a later one
        if s == rank:
            v = local if blk is None else local[tuple(slice(a, b) for a, b in blk)]
            if t == rank and whole is not None:
                pending.append((j, v))
            elif t == rank:
                result = v.clone()
            else:
                v = v.contiguous()
                ops.append(tdist.P2POp(tdist.isend, staged_send(v), t))  # gloo: CUDA through a CPU copy
                tensors.append(v)
        elif t == rank:
            buf = torch.empty(shp if whole is None else [b - a for a, b in blk], dtype=dtype, device=device)
            host, fin = staged_recv(buf)
            ops.append(tdist.P2POp(tdist.irecv, host, s))
            tensors.append(buf)
            pending.append((j, buf))
            if fin is not None:
                copy_back.append(fin)
    if ops:
        run(Call(CollectiveOp.SEND_RECV, groups.world_group(), lambda g: tdist.batch_isend_irecv(ops),
                 tensors=tensors, traced=False, then=lambda: [fin() for fin in copy_back],
                 peers=peer_names(op.peer for op in ops)))
    if whole is not None:
        for j, piece in pending:
            if piece.numel():
                whole[landing(step, j)] = piece
        return whole
    if pending:
        result = pending[0][1]
    return result


def run_step(step: Step, local, rank: int, dtype, device, fresh: bool = False):
    """One step on this rank; returns the new local value (None: this rank holds nothing afterwards). ``fresh``:
    ``local`` is the caller's to give away (an earlier step made it): a step that keeps the block returns it
    uncopied (values never change in place: another dist tensor may hold the same block)."""
    if step.op == "send_recv":
        return _send_recv(step, local, rank, dtype, device)
    if local is None or not step.mesh.contains(rank):
        return local
    if step.mesh.mesh.shape[step.axis] == 1:  # a line of one rank: every step keeps the block (a new tensor)
        return local if fresh else local.clone()
    line = _line(step, rank)
    k = len(line.coords)
    if step.op == "slice":
        return _slice(step, local, k, line.index)
    if step.op == "zero_fill":
        fill = partial_fill(step.after, line.coord, step.axis)
        if fill == "value":
            return local if fresh else local.clone()
        return torch.zeros_like(local) if fill == "zero" else torch.ones_like(local)
    groups.mesh_groups(step.mesh)  # every line's group, made in program order
    if k == 1:
        return local if fresh else local.clone()
    group = groups.line_group(line.ranks)
    if step.op == "all_gather":
        return _all_gather(step, local, group, line.sizes)
    if step.op == "all_reduce":
        return _all_reduce(step, local, group)
    if step.op == "reduce_scatter":
        return _reduce_scatter(step, local, group, k, line.index)
    if step.op == "all_to_all":
        return _all_to_all_dims(step, local, group, line.sizes, line.index)
    raise ValueError(f"unknown step {step.op}")


_GROUPED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")  # steps on a mesh line's group


def run_plan(plan: Plan, local, rank: int, *, dtype=None, device=None, name=None, tensor_id=None,
             own: bool = False):
    """Run every step of ``plan`` on this rank, emitting one ``reshard_step`` event per step it took part in (its
    ``bytes``: what this rank received in the step). ``own``: the caller gives ``local`` up (a gradient that is
    replaced), so no step copies it to keep it; after the first step the block is the plan's anyway."""
    dtype = dtype if dtype is not None else local.dtype
    device = device if device is not None else local.device
    check_runnable(plan, dtype)
    if plan.cross_mesh and any(s.op in _GROUPED and s.mesh == plan.dst_mesh for s in plan.steps):
        groups.mesh_groups(plan.dst_mesh)  # collectives after the send: every rank makes their groups, in one order
    if not plan.steps and not own and local is not None and plan.src_placements != plan.dst_placements:
        local = local.clone()  # a relabel along mesh axes of one rank: the caller keeps its block
    ctx = rank_context.current()
    st = trace_state(ctx)
    if not st.sinks:
        for i, step in enumerate(plan.steps):
            local = run_step(step, local, rank, dtype, device, own or i > 0)
        return local
    return run_traced(plan, local, rank, dtype, device, own, name, tensor_id, next(RESHARD.get(ctx).plan_ids), st,
                      ctx, run_step)


_FUSABLE = ("all_reduce", "all_gather", "reduce_scatter")
BUCKET_BYTES = 25 << 20  # as DDP's buckets


def _fusable(plan: Plan, rank: int) -> tuple | None:
    """What lets plans run as one collective: one step, an all-reduce, an all-gather or a sum / mean
    reduce-scatter that splits its dim evenly, on a line of several ranks this rank is in; their signature."""
    if len(plan.steps) != 1:
        return None
    step = plan.steps[0]
    if step.op not in _FUSABLE or step.mesh.mesh.shape[step.axis] == 1 or not step.mesh.contains(rank):
        return None
    if step.op != "all_reduce":
        if plan.shape[step.dim] % step.mesh.shape[step.axis]:
            return None
        if step.op == "reduce_scatter" and step.reduce not in (ReduceType.kRedSum, ReduceType.kRedAvg):
            return None
    return step.op, step.mesh, step.axis, step.reduce


def run_plans(plans, locals_, rank: int, names, tensor_ids, dtypes, devices, into=None, own: bool = False) -> list:
    """Run many plans on this rank: those that all-reduce, all-gather or reduce-scatter along the same mesh line go
    as one collective per bucket of about 25 MB (as DDP buckets gradients), the others one by one; every tensor gets
    the events its own :func:`run_plan` would emit (one plan, one step each). ``into``: for each plan, a block the
    result may be written into (where an all-gather bucket's result fits it, it is, and that block is returned)."""
    out: list = [None] * len(plans)
    groups_: dict = {}
    for plan, local, dtype in zip(plans, locals_, dtypes):
        if dtype is not None or local is not None:
            check_runnable(plan, dtype if dtype is not None else local.dtype)
    for i, (plan, local) in enumerate(zip(plans, locals_)):
        sig = _fusable(plan, rank) if local is not None else None
        if sig is not None and ((dtypes[i] is not None and dtypes[i] != local.dtype)
                                or (devices[i] is not None and torch.device(devices[i]) != local.device)):
            sig = None  # the result goes elsewhere (a meta-device parameter's gradient, another dtype): its own run
        if sig is None:
            out[i] = run_plan(plan, local, rank, dtype=dtypes[i], device=devices[i], name=names[i],
                              tensor_id=tensor_ids[i], own=own)
            continue
        groups_.setdefault((sig, local.dtype, local.device), []).append(i)
    for (sig, _dtype, _device), members in groups_.items():
        bucket, size = [], 0
        for i in members:
            bucket.append(i)
            size += locals_[i].numel() * locals_[i].element_size()
            if size >= BUCKET_BYTES:
                _run_bucket(sig, bucket, plans, locals_, out, rank, names, tensor_ids, into)
                bucket, size = [], 0
        if bucket:
            _run_bucket(sig, bucket, plans, locals_, out, rank, names, tensor_ids, into)
    return out


def _run_bucket(sig, bucket, plans, locals_, out, rank, names, tensor_ids, into) -> None:
    if len(bucket) == 1:
        i = bucket[0]
        out[i] = run_plan(plans[i], locals_[i], rank, name=names[i], tensor_id=tensor_ids[i])
        return
    op, mesh, axis, _reduce = sig
    step = plans[bucket[0]].steps[0]
    st = trace_state()
    tracing = bool(st.sinks)
    ids, traced = {}, {}
    if tracing:
        me = trace.my_rank(st)
        for i in bucket:
            ids[i] = next(_state().plan_ids)
            traced[i] = traced_plan(plans[i], rank)
            plan_event(st, traced[i], me, locals_[i], names[i], tensor_ids[i], ids[i])
        issued = issued_now()
    t0 = time.time()
    line, _ = groups.axis_group(mesh, axis, rank)
    group = groups.line_group(line)
    k = len(line)
    if op == "all_reduce":
        flat = _all_reduce(step, torch.cat([locals_[i].reshape(-1) for i in bucket]), group, fresh=True)
        at = 0
        for i in bucket:
            n = locals_[i].numel()
            out[i] = flat[at:at + n].view(locals_[i].shape)
            at += n
    elif op == "all_gather":  # rank j's block of every tensor, its dim first, then the blocks put side by side
        moved = [locals_[i].movedim(plans[i].steps[0].dim, 0) for i in bucket]
        src = torch.cat([m.reshape(-1) for m in moved])
        gathered = src.new_empty((k, src.numel()))
        run(Call(CollectiveOp.ALL_GATHER, group,
                 lambda g: compat.all_gather_single(gathered.view(-1), src, group=g.process_group),
                 tensors=(src,), nbytes=src.numel() * src.element_size() * k, traced=False))
        at = 0
        for i, m in zip(bucket, moved):
            n, d = m.numel(), plans[i].steps[0].dim
            dst = None if into is None else into[i]
            moved_dst = None if dst is None else dst.movedim(d, 0)
            if (moved_dst is not None and dst.dtype == gathered.dtype and dst.device == gathered.device
                    and moved_dst.shape == (k * m.shape[0],) + tuple(m.shape[1:])):
                # straight into the block it replaces: no copy of the bucket beside it
                moved_dst.unflatten(0, (k, m.shape[0])).copy_(gathered[:, at:at + n].view((k,) + m.shape))
                out[i] = dst
                at += n
                continue
            whole = gathered[:, at:at + n].reshape((k * m.shape[0],) + tuple(m.shape[1:]))
            if whole._base is not None:  # a view would keep the whole bucket of every rank alive
                whole = whole.clone(memory_format=torch.contiguous_format)
            out[i] = whole.movedim(0, d).contiguous() if d else whole
            at += n
    else:  # reduce-scatter: rank j's chunk of every tensor packed j-th, each rank keeps its own chunks, reduced
        moved = [locals_[i].movedim(plans[i].steps[0].dim, 0) for i in bucket]
        src = torch.cat([m.reshape(k, -1) for m in moved], dim=1).reshape(-1)
        mine = src.new_empty(src.numel() // k)
        red, finish = reduction(_reduce_type(step, src.dtype), group)
        run(Call(CollectiveOp.REDUCE_SCATTER, group,
                 lambda g: compat.reduce_scatter_single(mine, src, op=red, group=g.process_group),
                 tensors=(src,), traced=False))
        if finish is not None:
            finish(mine)
        at = 0
        copied = any(plans[i].steps[0].dim for i in bucket)
        for i, m in zip(bucket, moved):
            n, d = m.numel() // k, plans[i].steps[0].dim
            part = mine[at:at + n].view((m.shape[0] // k,) + tuple(m.shape[1:]))
            # a part laid out anew owns its storage; then so does every part, or the views would keep the whole
            # chunk alive beside the copies
            out[i] = part.movedim(0, d).contiguous() if d else part.clone() if copied else part
            at += n
    if tracing:
        for i in bucket:
            step_event(st, traced[i], me, 0, out[i], t0, names[i], tensor_ids[i], ids[i], issued)
