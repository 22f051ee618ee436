"""ZeRO over flat owner slots: each parameter's flat elements split over a group (os, os_g) or FSDP2 (p_g_os)."""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.distributed as tdist
import torch.nn as nn

from ... import trace
from ...core.sharding import SHARDED, Piece, plan_pieces
from ..comm import all_reduce_mean_
from ..data_parallel import reached_in_backward
from ..devices import device
from .engine import ModelHook, Zero, clear_grads, create_states, set_grad_quietly, watch_grad_assign, watch_zero_grad
from .fsdp import apply_fsdp, unmix_foreach
from .group import ShardingGroup, broadcast_module
from .slot import Slot, local_tensor
from .state import full_optimizer_state, load_full_optimizer_state

__all__ = ["FlatZero"]


class FlatZero(Zero):
    """Shard ``inner``'s parameters (those of ``model``, ``names``: id -> name) over ``grp`` at ``level``.

    Parameters start from the group's first rank. ``segment_size``: parameters with fewer elements stay whole
    (os/os_g: owned by one rank, chosen greedily by size; p_g_os: replicated). 'os' averages whole gradients once
    per step; 'os_g' reduces each gradient to its owners during backward, in an order every rank shares (the
    model's parameters in reverse), and frees it; 'p_g_os' is FSDP2. A gradient some ranks did not make (a branch
    one rank took) counts as zeros from them, as in a dense run.
    ``offload`` (on a ``dev`` other than the CPU) keeps every optimizer state on the CPU. ``grad_clip``: a
    ``ClipGradByGlobalNorm`` applied to the sharded gradients; ``buffer_max_size`` bounds the fused all-reduce
    (elements). ``sync_buffers``: buffers broadcast from the first rank before every forward. ``dp``: a group of
    ranks that hold the same shards in other sharding groups; gradients are averaged over it too. ``exclude``: names
    of parameters kept whole at p_g_os. ``clip_kinds``: the names of the model-parallel split parameters and of those
    with ``need_clip = False``; ``mp``: the model-parallel group the split ones' squares are added over.
    """

    def __init__(self, inner, model, level, grp: ShardingGroup, names: dict, dev, *, offload=False,
                 segment_size=2**20, grad_clip=None, buffer_max_size=2**23, sync_buffers=False,
                 dp: ShardingGroup | None = None, exclude=frozenset(), clip_kinds=(frozenset(), frozenset()), mp=None):
        super().__init__(inner, level)
        self._dp = dp
        self._split, self._no_clip = clip_kinds
        self._mp = mp
        self._model = model
        self._group = grp
        self._grad_clip = grad_clip
        self._buffer_max_size = buffer_max_size
        self._dirty = False
        self._forwarded = False  # os, p_g_os: whether a forward with gradients on ran since the last step
        self._hooks = []
        self._queued = False  # os_g: whether a backward is under way (its end is queued)
        self._reduced = False  # os_g: whether a backward's end reduced the gradients since the last step
        self._order: list = []  # os_g: this backward's slots, in the order every rank reduces them
        self._ready: set = set()  # os_g: id of each parameter whose gradient this backward made
        self._parts: list = []  # os_g: (slot, made here, this rank's part) of each slot this backward reduced
        self._pos: dict = {}  # os_g: id of each parameter -> its place in this backward's order
        self._late: set = set()  # os_g: id of each parameter whose gradient came after its turn in this backward
        self._used: dict = {}  # p_g_os: id(param) -> "used", "zeros" (none before) or "added" since the step
        self._given: dict = {}  # os, p_g_os: id(slot) -> a weak reference to the gradient _sync_grads gave its copy
        broadcast_module(model, grp)
        if dp is not None:
            broadcast_module(model, dp)
        # an optimizer that has stepped: its states carry over into the shards (Paddle keeps the accumulators it has)
        saved = {i: dict(st) for i, p in enumerate(q for g in inner.param_groups for q in g["params"])
                 if (st := inner.state.get(p))}
        self._slots = self._plan(names, dev, offload, segment_size, exclude)
        at = {id(p): i for i, p in enumerate(model.parameters())}
        self._reverse = sorted(self._slots, key=lambda s: -at[id(s.param)])  # os_g: the order of its reductions
        self._offload = offload = bool(offload) and dev.type != "cpu"  # on a CPU rank every state already is there
        inner.state.clear()
        if level in ("os", "os_g"):
            self._shard_slices(offload)
        else:
            self._keep_whole(offload)
        if saved:
            self._carry_states(saved)
        for s in self._slots:
            if not s.param.requires_grad:  # frozen: no gradient to reduce (Paddle's skip non-trainable ones)
                continue
            if level == "os_g":
                hook = self._grad_ready
            elif level == "os" or s.piece.mode == "replicated":
                hook = self._mark_dirty
            else:
                continue
            self._hooks.append(s.param.register_post_accumulate_grad_hook(hook))
        if level in ("os", "p_g_os"):
            model.register_forward_pre_hook(ModelHook(self._mark_forward))
        else:  # the reduced parts live beside the freed gradients: the model's zero_grad must drop them too,
            watch_zero_grad(model, self._module_zero_grad)
            self._slot_of = {id(s.param): s for s in self._slots}  # and so must ``p.grad = None`` by hand
            for s in self._slots:
                watch_grad_assign(s.param, self._grad_assigned)
        if sync_buffers:
            model.register_forward_pre_hook(ModelHook(self._sync_buffers))
        self._emit_ownership()

    def _carry_states(self, saved: dict) -> None:
        """Load the states the optimizer held before sharding (slot index -> whole values) into this rank's shards;
        a parameter that had none stays without (its next step starts it afresh, as in one process)."""
        inner = self._inner_opt
        params = self.grad_params()
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            create_states(inner, params)
        finally:
            for p, g in zip(params, grads):
                p.grad = g
        load_full_optimizer_state(inner, self._slots, self._group, saved)
        for i, s in enumerate(self._slots):
            if i not in saved:
                inner.state.pop(s.shard if s.shard is not None else s.param, None)

    def _sync_buffers(self, module, args) -> None:
        broadcast_module(module, self._group, "buffers")
        if self._dp is not None:
            broadcast_module(module, self._dp, "buffers")

    # who owns what -------------------------------------------------------------------------------------------
    def _plan(self, names, dev, offload, segment_size, exclude) -> list:
        inner, grp, model = self._inner_opt, self._group, self._model
        order = [p for g in inner.param_groups for p in g["params"]]
        pieces = plan_pieces([(names[id(p)], tuple(p.shape)) for p in order], self.level, grp.size, segment_size)
        pieces = [Piece(pc.name, pc.shape, "replicated", tuple((0, pc.numel) for _ in range(grp.size)))
                  if pc.name in exclude else pc for pc in pieces]
        if self.level == "p_g_os":
            apply_fsdp(model, {pc.name: pc for pc in pieces}, grp, dev, offload, self._used)
            new_params = dict(model.named_parameters())
            for g in inner.param_groups:
                g["params"] = [new_params[names[id(p)]] for p in g["params"]]
            order = [p for g in inner.param_groups for p in g["params"]]
            unmix_foreach(inner)
        gidx = [gi for gi, g in enumerate(inner.param_groups) for _ in g["params"]]
        return [Slot(pc.name, p, pc, grp.rank, gi) for p, pc, gi in zip(order, pieces, gidx)]

    def _shard_slices(self, offload) -> None:
        """os/os_g: the inner optimizer steps a flat view of the elements this rank owns (a CPU copy offloaded)."""
        slot_of = {id(s.param): s for s in self._slots}
        for g in self._inner_opt.param_groups:
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

    def _keep_whole(self, offload) -> None:
        # FSDP2's CPUOffloadPolicy keeps the sharded parameters (and their states) on the CPU; the small, whole
        # ones it ignores are offloaded here: the optimizer steps a CPU copy, copied back after each step
        for s in self._slots:
            whole = s.piece.mode == "replicated"
            s.shard = nn.Parameter(s.param.detach().reshape(-1).to("cpu", copy=True)) if offload and whole \
                else s.param
        if offload:
            swap = {id(s.param): s.shard for s in self._slots}
            for g in self._inner_opt.param_groups:
                g["params"] = [swap.get(id(p), p) for p in g["params"]]

    def _emit_ownership(self) -> None:
        if not trace.active():
            return
        grp, level = self._group, self.level
        for s in self._slots:
            piece = s.piece
            lo, hi = piece.ranges[grp.rank]
            trace.emit(trace.Ownership(
                s.name, level, SHARDED[level], tuple(piece.shape), group=tuple(grp.ranks), held=(lo, hi),
                ranges=piece.ranges, mode=piece.mode, local_shape=(hi - lo,),
                nbytes=(hi - lo) * s.param.element_size(),
            ).to_event())

    # gradients -------------------------------------------------------------------------------------------
    def _mark_dirty(self, _p=None):
        self._dirty = True

    def _mark_forward(self, _module, _args):
        self._forwarded = self._forwarded or torch.is_grad_enabled()

    def _grad_ready(self, p):
        """os_g backward hook: ``p``'s gradient is made; each gradient whose turn has come is reduced to its owners
        now (the first of a backward queues its end)."""
        if not self._queued:
            self._begin(in_backward=True)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if self._pos.get(id(p), len(self._order)) < len(self._parts):
            # its turn has passed: a nested backward (a reentrant checkpoint's) made it after this one's graph was
            # read as not reaching it, or made it a second time; it is reduced at the end, with the ranks' agreement
            self._late.add(id(p))
            return
        self._ready.add(id(p))
        order = self._order
        while len(self._parts) < len(order) and id(order[len(self._parts)].param) in self._ready:
            self._reduce_next()

    def _begin(self, in_backward: bool) -> None:
        self._queued = True
        self._order = [s for s in self._reverse if s.param.requires_grad]
        self._pos = {id(s.param): i for i, s in enumerate(self._order)}
        self._ready, self._parts, self._late = set(), [], set()
        if in_backward:  # a parameter this backward's graph does not reach gets no gradient: none is waited for
            self._ready = {id(s.param) for s in self._order if not reached_in_backward(s.param)}

    @torch.no_grad()
    def _reduce_next(self) -> None:
        s = self._order[len(self._parts)]
        made = s.param.grad is not None
        self._parts.append((s, made, self._reduce_to_owner(s)))

    @torch.no_grad()
    def _end_backward(self):
        """End of an os_g backward (or a step with none since the last): the parameters no gradient came for here
        are reduced as zeros, in the same order, so every rank runs the same collectives; then the ranks agree on
        which any of them made a gradient for (one MAX all-reduce), and those alone reach the shards (a parameter
        no rank's backward reached is not stepped, as in a dense run)."""
        if not self._queued:
            self._begin(in_backward=False)
        while len(self._parts) < len(self._order):
            self._reduce_next()
        parts, late = self._parts, self._late
        self._clear_pass()
        self._reduced = True
        flags = self._agree([m for _, m, _ in parts] + [id(s.param) in late for s, _, _ in parts])
        made, again = flags[: len(parts)], flags[len(parts) :]
        kept = [(s, mine) for (s, _, mine), m in zip(parts, made) if m]
        # a gradient that came after its turn on some rank (see _grad_ready): reduced again, zeros where none came
        kept += [(s, self._reduce_to_owner(s)) for (s, _, _), a in zip(parts, again) if a]
        self._dp_mean([mine for _, mine in kept if mine is not None])
        for s, mine in kept:
            if mine is None:
                continue
            if s.grad_buf is None:
                s.grad_buf = mine
            else:
                s.grad_buf.add_(mine)
            s.shard.grad = s.grad_buf

    def _agree(self, flags: list) -> list:
        """``flags`` OR-ed over the group and the dp group (one MAX all-reduce over each)."""
        groups = [g for g in (self._group, self._dp) if g is not None and g.size > 1]
        if not groups or not flags:
            return [bool(f) for f in flags]
        t = torch.tensor(flags, dtype=torch.uint8, device=device())
        for g in groups:
            g.all_reduce(t, op=tdist.ReduceOp.MAX)
        return [bool(f) for f in t.tolist()]

    def _dp_mean(self, tensors: list) -> None:
        """Average ``tensors`` (each rank of the dp group passes the same shapes) over the dp group."""
        if self._dp is not None and tensors:
            itemsize = tensors[0].element_size()
            all_reduce_mean_(tensors, self._dp.group, bucket_bytes=self._buffer_max_size * itemsize)

    def _reduce_to_owner(self, slot: Slot):
        """Reduce this gradient (zeros where this rank has none) so that only its owners keep their part, averaged,
        then free it; returns this rank's part (None where it owns none)."""
        p, g, grp = slot.param, slot.param.grad, self._group
        piece = slot.piece
        if piece.mode == "slice":
            c = piece.ranges[0][1] - piece.ranges[0][0]
            if g is None:
                flat = p.new_zeros(c * grp.size)
            else:
                flat = g.detach().reshape(-1)
                if c * grp.size != flat.numel():
                    flat = torch.cat([flat, flat.new_zeros(c * grp.size - flat.numel())])
            out = flat.new_empty(c)
            grp.reduce_scatter_into(out, flat.contiguous())
            mine = out[: slot.hi - slot.lo]
        else:
            owner = piece.owners()[0]
            flat = p.new_zeros(p.numel()) if g is None else g.detach().reshape(-1)
            flat = flat.clone() if owner == grp.rank and g is not None else flat
            grp.reduce(flat, owner)
            mine = flat if owner == grp.rank else None
        set_grad_quietly(p, None)
        if mine is None:
            return None
        mine = mine.div_(grp.size)
        return mine.to("cpu") if self._offload and mine.device.type != "cpu" else mine

    def _sync_grads(self):
        """Average whole gradients over the group (os: all of them; p_g_os: the replicated small ones), a rank
        without one adding zeros. p_g_os: a gradient FSDP made of zeros alone (no rank's backward used the
        parameter, which had none) is dropped, as a dense run has none."""
        if self.level == "os_g":
            if not self._reduced:  # no backward here since the last step: join the others' reductions, with zeros
                self._end_backward()
            return
        grp = self._group
        slots = [s for s in self._slots if s.piece.mode in ("slice", "whole", "replicated")]
        fsdp = [s for s in self._slots if s.piece.mode == "fsdp"]
        # whether a backward ran since the last step travels with the flags: the ranks skip, or average, together
        agreed = self._agree([self._dirty or bool(self._used)] + [s.param.grad is not None for s in slots]
                             + [self._used.get(id(s.param)) == "used" for s in fsdp])
        self._dirty = False
        used = dict(self._used)
        self._used.clear()  # in place: FSDP's post-backward hooks hold this dict
        forwarded, self._forwarded = self._forwarded, False
        if not agreed[0]:
            if forwarded:
                warnings.warn(self._no_gradient_message(False), UserWarning, stacklevel=3)
            self._drop_stale([s for s in slots if s.param.grad is not None])
            return
        reached = agreed[1 + len(slots):]
        if fsdp and not any(reached) and any(used.get(id(s.param)) for s in fsdp):
            warnings.warn(self._no_gradient_message(True), UserWarning, stacklevel=3)
        for s, real in zip(fsdp, reached):
            if not real and used.get(id(s.param)) == "zeros":
                s.param.grad = None
        if self._dp is not None:  # FSDP reduced each gradient over the group; over the dp group it is averaged here
            held = self._agree([s.param.grad is not None for s in fsdp])
            for s, h in zip(fsdp, held):
                if h and s.param.grad is None:
                    s.param.grad = torch.zeros_like(s.param)
            self._dp_mean([local_tensor(s.param.grad) for s, h in zip(fsdp, held) if h])
        if grp.size > 1 or self._dp is not None:
            live = [s for s, h in zip(slots, agreed[1:]) if h]
            for s in live:
                if s.param.grad is None:
                    s.param.grad = torch.zeros_like(s.param)
            itemsize = live[0].param.grad.element_size() if live else 4
            all_reduce_mean_([s.param.grad for s in live], grp.group, bucket_bytes=self._buffer_max_size * itemsize)
            self._dp_mean([s.param.grad for s in live])
        else:
            live = [s for s in slots if s.param.grad is not None]
        self._drop_stale(live)
        for s in live:
            if s.shard is None or s.shard is s.param or not s.owned:
                continue
            g = s.param.grad.detach().reshape(-1)[s.lo : s.hi]
            s.shard.grad = g.to("cpu") if s.shard.device != g.device else g
            self._given[id(s)] = weakref.ref(s.shard.grad)

    def _drop_stale(self, live: list) -> None:
        """A stepped copy whose parameter has no gradient now (the model's own ``zero_grad()`` dropped it) keeps
        none either: the optimizer must not step it on the gradient of an earlier step, as a dense run would not.
        Only a gradient this sync gave it is dropped (``create_states`` gives the copies gradients of their own)."""
        keep = {id(s) for s in live}
        for s in self._slots:
            given = self._given.get(id(s))
            if id(s) not in keep and given is not None and s.shard.grad is not None and given() is s.shard.grad:
                s.shard.grad = None

    def _no_gradient_message(self, units_ran: bool) -> str:
        inputs = ("a backward(inputs=...) naming the model's parameters reaches only those kept whole (under "
                  "segment_size): the forward used gathered copies of the sharded ones; call backward() without inputs")
        if units_ran:
            return (f"group_sharded_parallel (p_g_os): backward ran, but it reached none of the sharded parameters "
                    f"on any rank, so they do not change in this step; {inputs}")
        why = (f"was backward() called? {inputs[0].upper()}{inputs[1:]}" if self.level == "p_g_os"
               else "was backward() called?")
        return (f"group_sharded_parallel ({self.level}): step() after a forward with gradients on, but no parameter "
                f"on any rank has a gradient, so nothing changes; {why}")

    def _clip(self):
        clip = self._grad_clip or getattr(self._inner_opt, "_grad_clip", None)
        if clip is None:
            return None
        sharded, replicated = [], []  # (gradient, whether it is a model-parallel block)
        for s in self._slots:
            if s.name in self._no_clip:
                continue
            split = s.name in self._split
            if s.piece.mode == "fsdp":
                g = s.param.grad
                if g is not None:
                    sharded.append((local_tensor(g), split))
            elif s.piece.mode == "replicated":
                replicated.append((s.shard.grad if s.shard is not s.param else s.param.grad, split))
            elif s.owned and s.shard is not None:
                sharded.append((s.shard.grad, split))
        if self._mp is None:
            return clip.clip_pieces([g for g, _ in sharded], [g for g, _ in replicated], group=self._group.pg)
        # the split blocks' squares added over the mp group too; the other gradients are the same on each mp rank
        grp, mp = self._group.pg, self._mp
        parts = [([g for g, m in sharded if m], [grp, mp]), ([g for g, m in sharded if not m], [grp]),
                 ([g for g, m in replicated if m], [mp]), ([g for g, m in replicated if not m], [])]
        return clip.clip_hybrid([([g for g in gs if g is not None], groups) for gs, groups in parts])

    # step ------------------------------------------------------------------------------------------------
    def _before_sync(self, closure):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _inner_step(self, closure):
        if self._offload:
            self._load_copies()
        with trace.span("compute", op="optimizer_step", group=self._group.ranks):
            self._inner_opt.step()

    @torch.no_grad()
    def _load_copies(self):
        """Offloaded: each CPU copy the optimizer steps takes what its parameter holds now (a checkpoint loaded or
        an in-place edit since the last step), as the parameter itself would be stepped without offload."""
        sliced = self.level in ("os", "os_g")
        for s in self._slots:
            if s.shard is None or s.shard is s.param or (sliced and not s.owned):
                continue
            flat = s.param.detach().reshape(-1)
            s.shard.detach().copy_(flat[s.lo : s.hi] if sliced else flat)

    def _gather(self):
        self._reduced = False  # the next step reduces what backward makes from here on
        if self.level in ("os", "os_g"):
            self._gather_params()
        elif self._offload:
            self._restore_whole()

    @torch.no_grad()
    def _restore_whole(self):
        """p_g_os with offload: the small parameters were stepped as CPU copies; copy them back."""
        for s in self._slots:
            if s.shard is not None and s.shard is not s.param:
                s.param.detach().view(-1).copy_(s.shard.detach())

    @torch.no_grad()
    def _gather_params(self):
        grp = self._group
        for s in self._slots:
            p, piece = s.param, s.piece
            flat = p.detach().view(-1)
            if self._offload and s.shard is not None and s.owned:
                flat[s.lo : s.hi].copy_(s.shard.detach())
            if grp.size == 1:
                continue
            if piece.mode == "slice":
                c = piece.ranges[0][1] - piece.ranges[0][0]
                mine = flat.new_zeros(c)
                mine[: s.hi - s.lo] = flat[s.lo : s.hi]
                out = flat.new_empty(c * grp.size)
                grp.all_gather_into(out, mine)
                flat.copy_(out[: flat.numel()])
            else:
                owner = piece.owners()[0]
                grp.broadcast(flat, owner)

    def zero_grad(self, set_to_none: bool = True):
        """Every gradient (the parameters' and the shards' the inner optimizer steps) dropped, or zeroed in place."""
        clear_grads({id(t): t for s in self._slots for t in (s.param, s.shard) if t is not None}.values(), set_to_none)
        if set_to_none:
            for s in self._slots:
                s.grad_buf = None  # os_g: the shard's gradient, zeroed above otherwise
        self._dirty = False
        self._used.clear()
        self._reduced = False
        self._clear_pass()  # os_g (a backward that raised left its end queued on no one)

    def _module_zero_grad(self, module, set_to_none: bool) -> None:
        """os_g, after ``module.zero_grad()``: the reduced parts of its parameters' gradients go as theirs did."""
        mine = {id(p) for p in module.parameters()}
        for s in self._slots:
            if id(s.param) in mine and s.shard is not None:
                clear_grads([s.shard], set_to_none)
                if set_to_none:
                    s.grad_buf = None

    def _grad_assigned(self, p) -> None:
        """os_g: ``p.grad`` set by hand (dropped or replaced): the reduced part of its earlier gradients goes."""
        s = self._slot_of.get(id(p))
        if s is not None and s.shard is not None:
            set_grad_quietly(s.shard, None)
            s.grad_buf = None

    def _clear_pass(self) -> None:
        """os_g: no backward's reductions under way."""
        self._queued = False
        self._order, self._ready, self._parts, self._late = [], set(), [], set()

    # state -----------------------------------------------------------------------------------------------
    def full_state_dict(self, to_rank: int | None = 0):
        """The optimizer state of the whole model, in the unwrapped optimizer's format (collective)."""
        return full_optimizer_state(self._inner_opt, self._slots, self._group)

    def load_full_state_dict(self, state: dict) -> None:
        """Load the whole model's optimizer state (``full_state_dict``'s ``"state"``) into this rank's shards,
        making them first before training (a step at learning rate 0: collective then)."""
        create_states(self, self.grad_params())
        load_full_optimizer_state(self._inner_opt, self._slots, self._group, state)
