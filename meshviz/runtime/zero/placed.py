"""ZeRO over dist tensors: optimizer states (then gradients, then parameters) Shard along one mesh axis."""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
import torch.distributed as tdist

from ... import trace
from ...core.layout import chunk
from ...core.placements import Replicate, Shard
from ...core.sharding import SHARDED
from ..autograd import run_reshards
from ..dtensor import DistTensor, new_dist
from ..reshard import BUCKET_BYTES
from .blocks import step_on_blocks
from .engine import Zero, clear_grads

__all__ = ["PlacedZero", "StateView", "sharded_placements", "dist_params_for_dist_grads", "grads_as_params",
           "laid_out_states"]


def sharded_placements(p: DistTensor, axis, mesh=None) -> list | None:
    """Placements that shard ``p`` along mesh axis ``axis``, or None when it cannot be.

    Paddle's rule (``get_placement_with_sharding``): the first tensor dim that no other mesh axis shards, so a
    tensor-parallel weight sharded on dim 0 is sharded on dim 1. Left alone: a parameter on another mesh than
    ``mesh`` (when given), one already split on the sharding axis, one with no free dim, and (as in Paddle) one
    whose dim 0 is 1.
    """
    pm = p.process_mesh
    if mesh is not None and mesh != pm:
        return None
    i = pm.axis(axis)
    pl = list(p.placements)
    if not isinstance(pl[i], Replicate) or p.dim() == 0 or p.shape[0] == 1:
        return None
    taken = {q.dim for q in pl if isinstance(q, Shard)}
    free = [d for d in range(p.dim()) if d not in taken]
    if not free:
        return None
    pl[i] = Shard(free[0])
    return pl


@torch.no_grad()
def dist_params_for_dist_grads(optimizer, place) -> list:
    """Every dense parameter of ``optimizer`` whose gradient is a dist tensor (a plain model fed dist batches)
    becomes a dist tensor, in place, Replicate on the gradient's mesh, as Paddle's update makes it; its states
    follow. ``place(dense, mesh, placements)`` makes the dist tensors. Returns the parameters it changed."""
    made = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if isinstance(p, DistTensor) or not isinstance(g, DistTensor):
                continue
            mesh = g.process_mesh
            rep = [Replicate()] * mesh.ndim
            value = place(p.detach().to(g.device), mesh, rep)
            new = torch.nn.Parameter(value, requires_grad=p.requires_grad)
            p.grad = None
            torch.utils.swap_tensors(p, new)
            p.grad = g
            st = optimizer.state.get(p)
            for k, v in (st or {}).items():
                if torch.is_tensor(v) and not isinstance(v, DistTensor) and v.dim() > 0:
                    st[k] = place(v, mesh, rep)
            made.append(p)
    return made


@torch.no_grad()
def grads_as_params(optimizer, reshard=None, skip=frozenset()) -> None:
    """Every dist parameter's gradient laid out as the parameter (Partial gradients reduced once, before the
    update reads them), but for those whose id is in ``skip``: the all-reduces along one mesh line run as one
    collective per bucket, each gradient with the events of its own reshard (``reshard`` is not needed for that;
    it stays for callers that pass theirs)."""
    todo = [q for group in optimizer.param_groups for q in group["params"]
            if isinstance(q, DistTensor) and q.grad is not None and id(q) not in skip
            and q.grad.placements != q.placements]
    for q, g in zip(todo, run_reshards([q.grad for q in todo], [q.placements for q in todo], own=True)):
        q.grad = g


class StateView(MutableMapping):
    """An optimizer's ``state`` read through the user's parameters: a shadow's entry shows under its parameter."""

    def __init__(self, state, shadow: dict, of_shadow: dict):
        self._state, self._shadow, self._of_shadow = state, shadow, of_shadow

    def _key(self, p):
        return self._shadow.get(p, p)

    def __getitem__(self, p):
        return self._state[self._key(p)]

    def __setitem__(self, p, value) -> None:
        self._state[self._key(p)] = value

    def __delitem__(self, p) -> None:
        del self._state[self._key(p)]

    def __contains__(self, p) -> bool:
        return self._key(p) in self._state

    def __iter__(self):
        return (self._of_shadow.get(k, k) for k in list(self._state))

    def __len__(self) -> int:
        return len(self._state)

    def get(self, p, default=None):
        k = self._key(p)
        return self._state[k] if k in self._state else default

    def __repr__(self) -> str:
        return repr(dict(self.items()))


def _like(g, p):
    """``g`` as a gradient ``p`` accepts: a parameter built on the meta device (simulated ranks) names that device
    while its gradients' blocks lie elsewhere."""
    if g is None or g.device == p.device or not isinstance(g, DistTensor):
        return g
    return new_dist(g._local, g._pmesh, g._mpl, tuple(g.shape), g.stride(), device=p.device)


def laid_out_states(st: dict, p, placements, reshard, place) -> dict:
    """An optimizer's states ``st`` for the dist parameter ``p``, each one of ``p``'s shape laid out over its mesh as
    ``placements`` (``reshard(t, mesh, placements)`` a dist one, ``place(dense, mesh, placements)`` a dense one, as
    every rank stepped the same whole values); a step count, a scalar stays as it is (the same on every rank)."""
    mesh, out = p.process_mesh, {}
    for k, v in st.items():
        if not torch.is_tensor(v) or v.dim() == 0 or tuple(v.shape) != tuple(p.shape):
            out[k] = v
        elif isinstance(v, DistTensor):
            out[k] = reshard(v, mesh, placements)
        else:
            out[k] = place(v.detach().to(p.device), mesh, placements)
    return out


class PlacedZero(Zero):
    """Step ``inner``, whose parameters are dist tensors, sharding at ``level`` along mesh axis ``axis``.

    os/os_g: the inner optimizer steps a shadow leaf of each parameter, Shard on the axis (its states follow);
    os gets the whole gradient reduced then keeps its part, os_g reduce-scatters it (P->S) and frees the
    parameter's. p_g_os: the parameter itself now lives sharded. level None: nothing sharded, Partial gradients
    reduced once before the update. ``mesh``: only parameters on it are sharded. ``reshard(t, mesh, placements)``
    and ``place(dense, mesh, placements)`` move and make dist tensors (the caller's, so their events are its).
    """

    def __init__(self, inner, level, axis=0, mesh=None, *, reshard, place):
        super().__init__(inner, level)
        self._axis, self._mesh = axis, mesh
        self._reshard, self._place = reshard, place
        self._shadow: dict = {}  # param -> sharded leaf the inner optimizer updates (os, os_g)
        self._of_shadow: dict = {}  # that leaf -> the user's param
        self._full: dict = {}  # p_g_os: param -> the placements it had before it was sharded (its forward's)
        self._unhooked: dict = {}  # id -> a parameter frozen at the setup: its hook waits until it is unfrozen
        self._zeroed: set = set()  # os_g: id of each parameter whose part zero_grad(set_to_none=False) zeroed
        if level is not None:
            self._setup_sharding()

    def _sharded(self, p):
        return sharded_placements(p, self._axis, self._mesh)

    def _setup_sharding(self, only=None) -> None:
        """Shard the states (os/os_g: through a sharded shadow leaf; p_g_os: the parameter itself) of every dist
        parameter, or of those in ``only`` (parameters that became dist at a step)."""
        skip = {id(s) for s in self._shadow.values()}
        wanted = None if only is None else {id(p) for p in only}
        # every parameter's placements first: one that cannot be sharded raises before any is
        plans = {id(p): self._sharded(p) for group in self._inner_opt.param_groups for p in group["params"]
                 if isinstance(p, DistTensor) and id(p) not in skip and (wanted is None or id(p) in wanted)}
        for group in self._inner_opt.param_groups:
            new_params = []
            for p in group["params"]:
                pl = plans.get(id(p))
                if pl is None:
                    new_params.append(p)
                    continue
                with torch.no_grad():
                    sharded = self._reshard(p.detach(), p.process_mesh, pl)
                    states = self._sharded_states(p, pl)
                if self.level == "p_g_os":
                    self._full[p] = list(p.placements)
                    p._hold(sharded)  # the parameter itself now lives sharded
                    new_params.append(p)
                    if states is not None:
                        self._inner_opt.state[p] = states
                else:
                    shadow = torch.nn.Parameter(sharded, requires_grad=True)
                    self._shadow[p] = shadow
                    self._of_shadow[shadow] = p
                    if self._inner_opt.state.pop(p, None) and states is not None:
                        self._inner_opt.state[shadow] = states
                    self._view(p, shadow)
                    if p.requires_grad:  # a frozen one gets no gradient to lend (torch refuses the hook)
                        p.register_post_accumulate_grad_hook(self._lend_grad)
                    else:
                        self._unhooked[id(p)] = p
                    new_params.append(shadow)
                self._emit_ownership(p)
            group["params"] = new_params

    def _sharded_states(self, p, pl) -> dict | None:
        """The states the optimizer holds for ``p`` already (it has stepped), laid out as ``pl``: as Paddle shards
        the accumulators it finds, the steps after go on from them. None when it holds none."""
        st = self._inner_opt.state.get(p)
        return laid_out_states(st, p, pl, self._reshard, self._place) if st else None

    def _view(self, p, shadow) -> None:
        """Make ``shadow``'s block a view of this rank's part of ``p``'s (os, os_g): the inner optimizer's step
        writes ``p`` itself, whatever changed ``p`` since the last step (a loaded checkpoint, an in-place edit) is
        what it updates, and no copy of the part is held beside it. Left as it is where the part is not a slice of
        the block (a layout only torch can name, a rank outside the mesh)."""
        mesh, rank = p._pmesh, tdist.get_rank()
        if p._tpl is not None or shadow._tpl is not None or not mesh.contains(rank):
            return
        i = mesh.axis(self._axis)
        if not isinstance(shadow.placements[i], Shard):
            return
        d, blk, old = shadow.placements[i].dim, p._local, shadow._local
        lo, hi = chunk(blk.shape[d], mesh.shape[i], mesh.coordinate(rank)[i])
        if (old.untyped_storage()._cdata == blk.untyped_storage()._cdata  # the view already (the gather kept it)
                and old.storage_offset() == blk.storage_offset() + lo * blk.stride(d) and old.stride() == blk.stride()):
            return
        part = blk.narrow(d, lo, hi - lo)
        if part.shape != old.shape or part.dtype != old.dtype:
            return
        if part.device == old.device:
            shadow._hold(new_dist(part, mesh, shadow._mpl, tuple(shadow.shape), shadow.stride(), device=shadow.device))
        elif old.device.type == "meta" and not self._inner_opt.state.get(shadow):
            # a LazyGuard parameter initialize()d since the setup: the shadow (the same object) moves to its device
            new = torch.nn.Parameter(new_dist(part, mesh, shadow._mpl, tuple(shadow.shape), shadow.stride()),
                                     requires_grad=shadow.requires_grad)
            new.__dict__.update({k: v for k, v in shadow.__dict__.items() if not k.startswith("_")})
            new.grad = _like(shadow.grad, new)  # the swap takes the gradient too
            torch.utils.swap_tensors(shadow, new)

    def _lend_grad(self, p) -> None:
        """Backward hook (os, os_g): until the step reduces it, the shadow's gradient is its parameter's (the same
        block), so that a torch ``GradScaler``, which unscales and checks the param_groups' gradients, sees what
        backward left."""
        shadow = self._shadow.get(p)
        if shadow is not None and p.grad is not None:
            shadow.grad = _like(p.grad, shadow)

    def _hook_unfrozen(self) -> None:
        """Lend the gradients of parameters frozen at the setup and unfrozen since (their hook is made now: the
        gradient a backward left already is lent here, before a scaler reads the param_groups)."""
        for key, p in list(self._unhooked.items()):
            if p.requires_grad:
                del self._unhooked[key]
                p.register_post_accumulate_grad_hook(self._lend_grad)
                self._lend_grad(p)

    @property
    def param_groups(self):
        if self._unhooked:
            self._hook_unfrozen()
        return self._inner_opt.param_groups

    def _emit_ownership(self, p) -> None:
        if trace.active():
            level, mesh = self.level, p.process_mesh
            group = mesh.axis_group_of(tdist.get_rank(), self._axis)
            trace.emit(trace.Ownership(
                p.name, level, SHARDED[level], tuple(p.shape), group=group, mesh=mesh.to_dict(),
                placements=tuple(repr(q) for q in (self._sharded(p) or p.placements)),
                tensor_id=p.tensor_id).to_event())

    @property
    def full_placements(self) -> dict:
        """p_g_os: each sharded parameter -> the placements its forward uses it in (gathered along the axis)."""
        return dict(self._full)

    @property
    def state(self):
        """The inner optimizer's state, keyed by the user's parameters (an os/os_g state lives on a sharded shadow
        of the parameter; ``opt.state[p]`` finds it)."""
        return StateView(self._inner_opt.state, self._shadow, self._of_shadow)

    def grad_params(self) -> list:
        return [self._of_shadow.get(q, q) for group in self._inner_opt.param_groups for q in group["params"]]

    def _prepare(self) -> None:
        made = dist_params_for_dist_grads(self._inner_opt, self._place)
        if made and self.level is not None:
            self._setup_sharding(only=made)

    @torch.no_grad()
    def _sync_grads(self) -> None:
        """Every gradient reduced to the layout its step needs: the all-reduces along one mesh line go as one
        collective per bucket (each gradient keeps its own reshard events); os then keeps this rank's part."""
        grads_as_params(self._inner_opt, self._reshard, skip={id(s) for s in self._shadow.values()})
        # a parameter with no new gradient keeps its shard's (zeroed by zero_grad(set_to_none=False), so it is
        # stepped on zeros, as torch steps a zeroed gradient; None after zero_grad(): not stepped)
        live = [(p, shadow) for p, shadow in self._shadow.items() if p.grad is not None]
        for p, shadow in self._shadow.items():
            if p.grad is None and id(p) not in self._zeroed:  # dropped by the model's zero_grad(), or never made:
                shadow.grad = None  # not stepped, as torch's
        self._zeroed.clear()
        if self.level == "os":  # the full gradient kept, then this rank's part
            full = [(p, p.grad) for p, _ in live if p.grad.placements == p.placements]
            moving = [(p, p.grad) for p, _ in live if p.grad.placements != p.placements]
            reduced = run_reshards([g for _, g in moving], [p.placements for p, _ in moving], own=True)
            by_id = {id(p): g for p, g in full}
            by_id.update({id(p): g for (p, _), g in zip(moving, reduced)})
            for p, _shadow in live:
                p.grad = _like(by_id[id(p)], p)
        moved = run_reshards([p.grad for p, _ in live], [s.placements for _, s in live], own=self.level != "os")
        for (p, shadow), g in zip(live, moved):
            shadow.grad = _like(g, shadow)
            if self.level != "os":  # the parameter keeps its part alone, as Paddle's stage 2 (the next backward adds)
                p.grad = _like(g, p)

    def _inner_step(self, closure):
        for p, shadow in self._shadow.items():
            self._view(p, shadow)
        if closure is not None:
            return self._inner_opt.step(closure)
        return step_on_blocks(self._inner_opt)

    def _clip(self):
        clip = self.__dict__.get("_grad_clip") or getattr(self._inner_opt, "_grad_clip", None)
        if clip is not None:
            clip([q for group in self._inner_opt.param_groups for q in group["params"]])

    @torch.no_grad()
    def _gather(self) -> None:
        """The stepped shards back into the parameters (the all-gathers along one mesh line as one collective)."""
        items = list(self._shadow.items())
        bucket: list = []
        size = 0
        for i, (p, _) in enumerate(items):  # a bucket at a time: the gathered bucket is freed before the next
            bucket.append(items[i])
            size += p._local.numel() * p._local.element_size()
            if size >= BUCKET_BYTES or i == len(items) - 1:
                fulls = run_reshards([s.detach() for _, s in bucket], [q.placements for q, _ in bucket],
                                     into=[q for q, _ in bucket])
                for (q, shadow), full in zip(bucket, fulls):
                    if full is not None:  # None: gathered into q's block
                        q._hold(full)
                        self._view(q, shadow)  # the old block is let go
                bucket, size = [], 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner_opt.zero_grad(set_to_none=set_to_none)
        if self.level == "os_g" and not set_to_none:
            # the parameter's part is dropped, its shadow's zeroed: the next backward's gradient is reduce-scattered
            # once at the step (accumulated into a part, each gradient would be reduce-scattered in the backward)
            for p, shadow in self._shadow.items():
                if p.grad is not None or shadow.grad is not None:
                    p.grad = None
                    self._zeroed.add(id(p))
            return
        clear_grads(self._shadow, set_to_none)  # os keeps the parameters' whole gradients

