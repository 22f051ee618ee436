"""What an op writes besides its own block: other arguments (batch norm's statistics), the base of a written view."""

from __future__ import annotations

import contextvars
import weakref

import torch

from .. import compat
from ..compat import tree_map
from ..core.placements import Replicate
from . import dtensor as dtensor_module
from . import groups
from .autograd import run_reshard
from .dtensor import DistTensor, make_dist

__all__ = ["written_args", "writing", "moved", "write_back", "ViewOf", "view_made", "write_through", "out_variant",
           "into_out", "fresh", "wrote", "check_overlap", "run_whole", "check_reshape"]

_WRITTEN: dict = {}
# per thread (ranks as threads included): id of the caller's tensor, or of a copy laid out anew for the op ->
# [the caller's tensor, the copy the op writes]
_PENDING: contextvars.ContextVar[dict | None] = contextvars.ContextVar("meshviz_written", default=None)


_STATS = ((3, "running_mean"), (4, "running_var"))
# ops that write arguments their schema does not mark: native_batch_norm updates its running statistics in training
_UNMARKED = {torch.ops.aten.native_batch_norm.default: _STATS}


def written_args(func) -> tuple:
    """``(position, name)`` of the arguments after the first that ``func`` writes (its schema says so), cached."""
    hit = _WRITTEN.get(func)
    if hit is None:
        schema = getattr(func, "_schema", None)
        params = schema.arguments if schema is not None else []
        hit = _WRITTEN[func] = _UNMARKED.get(func) or tuple(
            (i, a.name) for i, a in enumerate(params) if i and a.alias_info is not None and a.alias_info.is_write)
    return hit


def writing(func, args, kwargs, is_dist) -> tuple[dict, contextvars.Token]:
    """Start watching the dist tensors ``func`` writes besides its first argument (see :func:`moved`)."""
    watched: dict = {}
    if func in _UNMARKED and not (args[5] if len(args) > 5 else kwargs.get("training", False)):
        return watched, _PENDING.set(watched)  # native_batch_norm in eval writes nothing
    for i, name in written_args(func):
        x = args[i] if i < len(args) else kwargs.get(name)
        if is_dist(x):
            watched[id(x)] = [x, x]
    return watched, _PENDING.set(watched)


def moved(x, y) -> None:
    """The op layer laid ``x`` out anew as ``y`` for the op: if the op writes ``x``, it writes ``y``."""
    watched = _PENDING.get()
    if watched is not None and y is not x:
        entry = watched.get(id(x))
        if entry is not None:
            entry[1] = y
            watched[id(y)] = entry


def write_back(watched: dict, token: contextvars.Token, redistribute) -> None:
    """Stop watching; what the op wrote into a copy goes back into the caller's tensor, in its own placements."""
    _PENDING.reset(token)
    done: set = set()
    for orig, copy in watched.values():
        if copy is orig or id(orig) in done:
            continue
        done.add(id(orig))
        back = redistribute(copy, orig._mpl, f"{orig.name or 'argument'} written back")
        with torch.no_grad():
            orig._local.copy_(back._local)
    for orig, _ in watched.values():
        orig._mv_writes += 1


# -- views: an in-place op on a view writes its base ----------------------------------------------------------------

def _version(block: torch.Tensor) -> int:
    try:
        return block._version
    except RuntimeError:  # an inference tensor keeps no count
        return -1


def _seen(t) -> tuple:
    """What has been written into ``t``'s block so far: its in-place ops (``_mv_writes``, which a new block counts
    too) and torch's count of the writes into the block from outside the op layer (an optimizer step on the blocks),
    with those of each tensor up its views whose block it shares (a write into that lands in ``t``'s block too)."""
    seen: list = []
    for _ in range(64):
        seen += (t._mv_writes, _version(t._local))
        rec = t._mv_view
        base = rec._base() if rec is not None and not rec.detached else None
        if base is None or rec._block() is not base._local:
            break
        t = base
    return tuple(seen)


class ViewOf:
    """How a dist tensor is a view of ``base``: ``func(base, *args, **kwargs)`` (its ``index``-th output).
    ``detached``: its block is not a view of the base's block (the op layer moved the base first, or DTensor ran the
    view), so a write into it reaches the base only through :func:`write_through`, and an in-place op on the base
    reaches it only when it is read anew (:meth:`refresh`; ``writes``: what it has seen written into the base's
    block, :func:`_seen`)."""

    __slots__ = ("_base", "func", "args", "kwargs", "index", "detached", "writes", "_block")

    def __init__(self, base, func, args, kwargs, index, detached: bool):
        # weakly: a view must not keep its base's block alive (activations saved for backward are views); a base
        # no one holds any more needs no write
        self._base, self.func, self.args, self.kwargs = weakref.ref(base), func, args, kwargs
        self.index, self.detached, self.writes = index, detached, _seen(base)
        self._block = None if detached else weakref.ref(base._local)  # the block its own is a view of

    @property
    def base(self):
        return self._base()

    def stale(self) -> bool:
        """Whether an in-place op on the base (or on one further up a chain of views) since the view's block was
        made did not land in that block (a copy, or a view of the base's block since replaced). The same on every
        rank: the counts and blocks change with the ops every rank runs."""
        base = self._base()
        if base is None:
            return False
        if (self.detached or self._block() is not base._local) and _seen(base) != self.writes:
            return True
        up = base._mv_view
        return up is not None and up.stale()

    def synced(self) -> None:
        """The view holds the base's value as it is now (a write through it reached the base)."""
        base = self._base()
        if base is not None:
            self.writes = _seen(base)

    def refresh(self, view) -> None:
        """``view`` holds ``func(base, ...)`` anew, in its own placements, as a torch view of a plain tensor sees
        its base's writes. Every rank of the mesh calls it (collectives)."""
        base = self._base()
        with torch.no_grad():
            out = dtensor_module._op_layer(self.func, (base, *self.args), self.kwargs)
            if self.index is not None:
                out = out[self.index]
            rec = out._mv_view if out is not base else None
            detached = rec.detached if rec is not None else out is not base
            if out._mpl != view._mpl and out._tpl is None and view._tpl is None:
                out, detached = run_reshard(out, out._pmesh, view._mpl, view.name), True
        view._hold(out)
        view._mv_writes += 1  # its own views read it anew too
        view._mv_view = ViewOf(base, self.func, self.args, self.kwargs, self.index, detached)


def fresh(args, kwargs, writer=None) -> bool:
    """Each dist view among an op's arguments whose base an in-place op wrote since is read anew first; ``writer``:
    the op, where it writes its first argument (:func:`check_overlap` first, whose answer it returns)."""
    whole = writer is not None and check_overlap(writer, args[0], (*args[1:], *kwargs.values()), args, kwargs)
    for a in args:
        kind = type(a)
        if kind is DistTensor:
            rec = a._mv_view
            if rec is not None and rec.stale():
                rec.refresh(a)
        elif kind is list or kind is tuple:
            fresh(a, {})
    for v in kwargs.values():
        if type(v) is DistTensor:
            rec = v._mv_view
            if rec is not None and rec.stale():
                rec.refresh(v)
    return whole


def view_made(d, args, kwargs, func, out) -> None:
    """Mark each dist output of the view op ``func`` as a view of its dist input ``args[0]`` (an in-place op on one
    then writes the input too); detached where the op (its decision ``d``, None: unknown) did not run on the input's
    own block."""
    if d is not None:
        d.view = True
    base = args[0]
    if not _is_dist(base):
        return
    detached = d is None or d.how != "local" or (d.moves is not None and d.moves[0] is not None)
    if _is_dist(out):
        if out is not base:  # DTensor may hand the input itself back (a view to its own shape)
            out._mv_view = ViewOf(base, func, args[1:], kwargs, None, detached)
    elif isinstance(out, (list, tuple)):
        for i, o in enumerate(out):
            if _is_dist(o) and o is not base:
                o._mv_view = ViewOf(base, func, args[1:], kwargs, i, detached)


def wrote(t, before, redistribute) -> None:
    """An in-place op wrote ``t``: counted (views of it whose blocks are copies read it anew), and where ``t`` is
    a view (``before``: its block and placements before the op, else None), the write reaches its base."""
    t._mv_writes += 1
    if before is not None:
        write_through(t, before, redistribute, t._pmesh.contains(groups.rank()))


def write_through(view, before, redistribute, member: bool) -> None:
    """An in-place op wrote ``view`` (its block and placements were ``before``): where that write did not land in
    the base's block (a detached view, or a view the op laid out anew), the base's region is set to the view's
    value, in the base's own placements, and so on up a chain of views. Every rank of the mesh calls it
    (collectives). A view of the base's own block whose op handed it a new block of the same layout (a random fill
    draws the whole tensor and keeps its block) has that block copied into the old one: no collective."""
    block, placements = before
    first, changed = view._mv_view, view._local is not block
    own = changed  # the view holds a new block: its own from now on, so a later write into it goes the long way
    if changed and first is not None and not first.detached and view._mpl == placements \
            and view._local.shape == block.shape and view._local.dtype == block.dtype:
        with torch.no_grad():
            block.copy_(view._local)
        changed = False
    rec = view._mv_view
    seen = {id(view)}
    while rec is not None and (base := rec.base) is not None and id(base) not in seen:
        seen.add(id(base))
        if not (rec.detached or changed):  # the write landed in the base's block: on up the chain
            base._mv_writes += 1
            rec.synced()
            view, rec, changed = base, base._mv_view, False
            continue
        before = base._local
        with torch.no_grad():
            rep = (Replicate(),) * base._pmesh.ndim
            whole = redistribute(base, rep, "view's base")
            value = redistribute(view, rep, "written view")
            if member:
                region = rec.func(whole._local, *rec.args, **rec.kwargs)
                if rec.index is not None:
                    region = region[rec.index]
                region.copy_(value._local)
            if whole is not base:
                back = redistribute(whole, base._mpl, "view's base")
                if back._local.shape == base._local.shape and back._local.dtype == base._local.dtype:
                    base._local.copy_(back._local)
                else:
                    base._hold(back)
        base._mv_writes += 1
        rec.synced()
        rec.detached = rec.detached or changed
        view, rec, changed = base, base._mv_view, base._local is not before
    if first is not None:
        first.detached = first.detached or own
        first.synced()  # it holds what it wrote: the writes counted up its chain since are that one


# -- out= arguments: the op run as its functional overload, the result held by the caller's tensors -------------------

_OUTS: dict = {}  # op -> (names of its out arguments, its functional overload) or None


def out_variant(func):
    """``(out names, functional overload)`` for an op with ``out=`` arguments (``aten.add.out`` -> ``add.Tensor``:
    the same other arguments, nothing written), cached; None for any other op."""
    hit = _OUTS.get(func, False)
    if hit is not False:
        return hit
    schema = getattr(func, "_schema", None)
    outs = tuple(a.name for a in schema.arguments if a.is_out) if schema is not None else ()
    hit = None
    if outs:
        want = [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]
        packet = func._overloadpacket
        for name in packet.overloads():
            op = getattr(packet, name)
            s = op._schema
            if [(a.name, str(a.type)) for a in s.arguments] == want and not any(
                    a.alias_info is not None for a in s.arguments):
                hit = (outs, op)
                break
    _OUTS[func] = hit
    return hit


def into_out(func, args, kwargs, run, probe, redistribute):
    """Run an ``out=`` op whose outputs are all dist tensors as its functional overload (``run``: the op layer),
    then each out tensor holds its result (its layout too, as DTensor's out= gives; an out that is a view writes
    its base). NotImplemented where no out is a dist tensor. A shape other than the result's, or dist and plain outs
    together, raise on every rank before anything runs."""
    names, functional = out_variant(func)
    outs = [kwargs.get(n) for n in names]
    if not all(_is_dist(o) for o in outs):
        if any(_is_dist(o) for o in outs):
            raise ValueError(f"{func}: out= holds both dist and plain tensors; pass dist tensors only (or plain only)")
        return NotImplemented
    rest = {k: v for k, v in kwargs.items() if k not in names}
    shapes = probe(functional, args, rest)
    shapes = [shapes] if isinstance(shapes, torch.Tensor) else list(shapes)
    for n, o, s in zip(names, outs, shapes):
        if tuple(o.shape) != tuple(s.shape):
            raise ValueError(f"{func}: out= tensor {n!r} has shape {list(o.shape)}, the result {list(s.shape)}; a "
                             f"dist tensor cannot be resized in place: pass one of the result's shape")
    reads = (*args, *rest.values())
    if any([check_overlap(func, o, reads, args, kwargs) for o in outs]):
        return run_whole(func, args, kwargs, outs, redistribute)
    found: list = []
    tree_map(lambda x: found.append(x) if _is_dist(x) else None, (args, rest))
    res = run(functional, args, rest) if found else functional(*args, **rest)
    results = [res] if len(names) == 1 else list(res)
    for o, r in zip(outs, results):
        if not found:  # dense inputs only: the result is replicated on the out tensor's mesh, as in Paddle
            mesh = o._pmesh
            local = r if mesh.contains(groups.rank()) else compat.empty_block(r.dtype, r.device)
            r = make_dist(local, mesh, (Replicate(),) * mesh.ndim, tuple(r.shape))
        if r.dtype != o.dtype:
            r = run(torch.ops.aten._to_copy.default, (r,), {"dtype": o.dtype})
        before = (o._local, o._mpl) if o._mv_view is not None else None
        wrote(o._hold(r), before, redistribute)
    return outs[0] if len(names) == 1 else tuple(outs)


# -- an in-place view op: its shape and strides are the dist tensor's own, fixed when it is made ---------------------

_RESHAPES: dict = {}  # op -> whether it changes its first argument's shape or strides in place


def check_reshape(func, self, args, kwargs, probe) -> None:
    """``t_``, ``transpose_``, ``unsqueeze_``, ``squeeze_``, ``resize_``, ``as_strided_`` on a dist tensor raise on
    every rank before anything moves where they would change its shape or strides (a dist tensor keeps those it was
    made with: it would hold the new block under the old shape); one that keeps both (``squeeze_`` of a dim not of
    size 1) runs."""
    hit = _RESHAPES.get(func)
    if hit is None:
        hit = _RESHAPES[func] = torch.Tag.inplace_view in func.tags
    if not hit:
        return
    out = probe(func, args, kwargs)
    if isinstance(out, torch.Tensor) and (out.shape != self.shape or out.stride() != dtensor_module.contiguous_stride(
            tuple(self.shape))):
        raise ValueError(f"{func}: changes a dist tensor's shape or strides in place ({list(self.shape)} -> "
                         f"{list(out.shape)}), which a dist tensor cannot; use the op that returns a new tensor "
                         f"(t = t.t(), t = t.unsqueeze(0), t = t.reshape(...))")


# -- an in-place op reading what it writes: refused where torch refuses, else run as one process runs it -----------

_SAME_VIEW_SAFE = {torch.ops.aten.copy_.default}  # each element read before it is written, as a pointwise op


def check_overlap(func, written, reads, args, kwargs) -> bool:
    """Whether ``func`` writing ``written`` reads memory of it another way too (a dist view of the same tensor among
    ``reads``): a partial overlap torch refuses (``t[1:].add_(t[:-1])``) raises, on every rank before anything
    moves; one torch runs (``t[:, 1:].copy_(t[:, :-1])``, ``mm(t, t, out=t)``: the result depends on the order it
    writes) answers True: the op runs on the whole tensors (:func:`run_whole`). Disjoint views, and the same view
    read by a pointwise op, run as usual. The blocks cannot tell: a view may be a copy, a block may hold none of it."""
    found = [a for r in reads for a in (r if type(r) is list or type(r) is tuple else (r,)) if type(a) is DistTensor]
    if not found:
        return False
    pointwise = torch.Tag.pointwise in func.tags or func in _SAME_VIEW_SAFE
    if written._mv_view is None and all(a._mv_view is None and (a is not written or pointwise) for a in found):
        return False
    root, chain = _chain(written)
    aliased = [a for a in found if _chain(a)[0] is root]
    if not aliased:
        return False
    numel = 1 + sum((n - 1) * st for n, st in zip(root.shape, root.stride()))
    where = torch.arange(numel if all(root.shape) else 0).as_strided(tuple(root.shape), root.stride())
    mine = _replay(root, chain, where)
    if mine is None:
        return False
    overlap = False
    views = [_replay(root, _chain(a)[1], where) for a in aliased]
    if any(v is None for v in views):
        return False  # a view torch cannot take again: nothing to tell
    for theirs in views:
        if (theirs.shape, theirs.stride(), theirs.storage_offset()) == (mine.shape, mine.stride(),
                                                                          mine.storage_offset()):
            overlap = overlap or not pointwise
        elif bool(torch.isin(theirs.reshape(-1), mine.reshape(-1)).any()):
            overlap = True
    if not overlap or any(a._pmesh != written._pmesh for a in compat.tree_flatten((args, kwargs))[0]
                          if type(a) is DistTensor):
        return False  # inputs on different meshes: the op layer refuses them
    # the dense op, on zeros laid out alike, says whether torch refuses it
    whole = torch.empty_strided(tuple(root.shape), root.stride(), dtype=root.dtype).zero_()
    stand = {id(a): _replay(root, _chain(a)[1], whole) for a in (written, *aliased)}
    pargs, pkwargs = tree_map(lambda x: stand.get(id(x), torch.zeros(x.shape, dtype=x.dtype)) if type(x) is DistTensor
                              else x.detach().cpu() if isinstance(x, torch.Tensor) else x, (args, kwargs))
    try:
        with torch.no_grad():
            func(*pargs, **pkwargs)
    except RuntimeError as e:
        if "memory location" in str(e):
            raise ValueError(f"{func}: {str(e).splitlines()[0]}") from None
    return True


def run_whole(func, args, kwargs, written, redistribute):
    """Run ``func`` as one process does on the whole tensors (each dist argument gathered; one that is a view of a
    tensor ``func`` writes, the same view of that tensor gathered): each written tensor (``written``) then holds
    its part of the result, in its own placements. Every rank of the mesh calls it (collectives)."""
    dists: dict = {}
    for x in compat.tree_flatten((args, kwargs))[0]:
        if type(x) is DistTensor:
            dists[id(x)] = x
    roots = {id(r): r for r in (_chain(w)[0] for w in written)}
    mesh = written[0]._pmesh
    member = mesh.contains(groups.rank())
    rep = (Replicate(),) * mesh.ndim
    wholes, stand = {}, {}
    with torch.no_grad():
        for key, r in roots.items():
            got = redistribute(r, rep, "written argument")._local
            w = wholes[key] = torch.empty_strided(tuple(r.shape), r.stride(), dtype=r.dtype, device=got.device)
            if member:
                w.copy_(got.reshape(w.shape))
        for key, x in dists.items():
            root, chain = _chain(x)
            if id(root) in wholes:
                stand[key] = _replay(root, chain, wholes[id(root)])
            else:
                stand[key] = redistribute(x, (Replicate(),) * x._pmesh.ndim, "argument")._local
        if member:
            pargs, pkwargs = tree_map(lambda x: stand[id(x)] if type(x) is DistTensor else x, (args, kwargs))
            with compat.no_dispatch_modes():
                func(*pargs, **pkwargs)
        for key, r in roots.items():
            local = wholes[key].contiguous() if member else compat.empty_block(r.dtype, r._local.device)
            back = redistribute(make_dist(local, mesh, rep, tuple(r.shape)), r._mpl, r.name)
            if back._local.shape == r._local.shape and back._local.dtype == r._local.dtype:
                r._local.copy_(back._local)
            else:
                r._hold(back)
            r._mv_writes += 1
    for w in written:
        rec = w._mv_view
        if rec is not None and rec.stale():
            rec.refresh(w)
        elif id(w) not in roots:
            w._mv_writes += 1
    return written[0] if len(written) == 1 else tuple(written)


def _chain(t) -> tuple:
    """The tensor ``t`` is a view of at the top of its views (``t`` itself when none), and the views down to ``t``."""
    recs: list = []
    for _ in range(64):
        rec = t._mv_view
        base = rec.base if rec is not None else None
        if base is None:
            break
        recs.append(rec)
        t = base
    return t, recs[::-1]


def _replay(root, chain, on):
    """The views ``chain`` taken of ``on`` (a tensor laid out as ``root``, or "meta": a meta one); None where a view
    takes a tensor argument."""
    x = torch.empty_strided(tuple(root.shape), root.stride(), dtype=root.dtype, device="meta") if on == "meta" else on
    for rec in chain:
        if any(isinstance(a, torch.Tensor) for a in (*rec.args, *rec.kwargs.values())):
            return None
        try:
            x = rec.func(x, *rec.args, **rec.kwargs)
        except (RuntimeError, NotImplementedError):  # a view torch cannot take of it: nothing to tell
            return None
        if rec.index is not None:
            x = x[rec.index]
    return x


def _is_dist(x) -> bool:
    return type(x) is DistTensor
