"""Auto-parallel training helpers: shard_layer, shard_optimizer (ShardingStage1/2/3), shard_dataloader."""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
import torch.distributed as tdist

from .. import trace
from ..core.mesh import ProcessMesh
from ..core.placements import Replicate, Shard
from ..runtime.devices import device
from ..runtime.dtensor import DistTensor
from ..runtime.world import init_parallel_env
from .api import dtensor_from_local, reshard, shard_tensor
from .shard_scaler import shard_scaler

__all__ = [
    "shard_layer",
    "shard_optimizer",
    "ShardingStage1",
    "ShardingStage2",
    "ShardingStage3",
    "shard_scaler",
    "shard_dataloader",
    "ShardDataloader",
]


# -- shard_layer --------------------------------------------------------------------------------------------


def _replicate_rest(layer: torch.nn.Module, mesh: ProcessMesh) -> None:
    for mod_name, mod in layer.named_modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            if not isinstance(p, DistTensor):
                new = shard_tensor(p, mesh, [Replicate()] * mesh.ndim,
                                   name=f"{mod_name}.{pname}" if mod_name else pname)
                setattr(mod, pname, new)
            elif p.name is None:
                p.name = f"{mod_name}.{pname}" if mod_name else pname
        for bname, b in list(mod.named_buffers(recurse=False)):
            if b is not None and not isinstance(b, DistTensor):
                mod._buffers[bname] = shard_tensor(b, mesh, [Replicate()] * mesh.ndim)


def shard_layer(layer: torch.nn.Module, process_mesh: ProcessMesh, shard_fn=None, input_fn=None, output_fn=None):
    """Convert every parameter and buffer of ``layer`` to a dist tensor on ``process_mesh``.

    ``shard_fn(name, sublayer, mesh)`` runs for every sub-layer (itself included) and may shard its parameters;
    whatever it leaves dense becomes Replicate. ``input_fn(inputs, mesh)`` / ``output_fn(outputs, mesh)`` run
    before / after ``forward``.
    """
    if not isinstance(layer, torch.nn.Module):
        raise ValueError(f"shard_layer expects an nn.Module, got {type(layer).__name__}")
    if not isinstance(process_mesh, ProcessMesh):
        raise ValueError(f"shard_layer expects a ProcessMesh, got {process_mesh!r}")
    init_parallel_env()
    if shard_fn is not None:
        for name, sub in list(layer.named_modules()):
            shard_fn(name, sub, process_mesh)
    _replicate_rest(layer, process_mesh)
    if input_fn is not None:
        layer.register_forward_pre_hook(lambda _m, inputs: input_fn(inputs, process_mesh))
    if output_fn is not None:
        layer.register_forward_hook(lambda _m, inputs, outputs: output_fn(outputs, process_mesh))
    return layer


# -- shard_optimizer ----------------------------------------------------------------------------------------


class _ShardingStage:
    stage = 0

    def __init__(self, sharding_mesh_dim=0, mesh: ProcessMesh | None = None, **kwargs):
        # Paddle: ShardingStage1(sharding_mesh_dim, mesh=None); older scripts pass the mesh first or mesh_dim=
        if "mesh_dim" in kwargs:
            sharding_mesh_dim = kwargs.pop("mesh_dim")
        if kwargs:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword arguments {sorted(kwargs)}")
        if isinstance(sharding_mesh_dim, ProcessMesh):
            sharding_mesh_dim, mesh = (mesh if mesh is not None else 0), sharding_mesh_dim
        if mesh is not None and not isinstance(mesh, ProcessMesh):
            raise ValueError(f"{type(self).__name__}: mesh must be a ProcessMesh, got {mesh!r}")
        if isinstance(sharding_mesh_dim, bool) or not isinstance(sharding_mesh_dim, (int, str)):
            raise ValueError(f"{type(self).__name__}: sharding_mesh_dim must be a mesh axis name or index, "
                             f"got {sharding_mesh_dim!r}")
        if mesh is not None:
            mesh.axis(sharding_mesh_dim)  # an unknown name raises here, on every rank
        self.axis = sharding_mesh_dim
        self.mesh = mesh

    @property
    def sharding_mesh_dim(self):
        return self.axis

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sharding_mesh_dim={self.axis!r})"

    def sharded(self, p: DistTensor) -> list | None:
        """Placements that shard ``p`` along the sharding axis, or None when it cannot be.

        Paddle's rule (``get_placement_with_sharding``): the first tensor dim that no other mesh axis shards, so a
        tensor-parallel weight sharded on dim 0 is sharded on dim 1. Left alone: a parameter on another mesh,
        one already split on the sharding axis, one with no free dim, and (as in Paddle) one whose dim 0 is 1.
        """
        mesh = p.process_mesh
        if self.mesh is not None and self.mesh != mesh:
            return None
        axis = mesh.axis(self.axis)
        pl = list(p.placements)
        if not isinstance(pl[axis], Replicate) or p.dim() == 0 or p.shape[0] == 1:
            return None
        taken = {q.dim for q in pl if isinstance(q, Shard)}
        free = [d for d in range(p.dim()) if d not in taken]
        if not free:
            return None
        pl[axis] = Shard(free[0])
        return pl


class ShardingStage1(_ShardingStage):
    """Optimizer states sharded along one mesh axis; gradients all-reduced, parameters all-gathered after the step."""

    stage = 1


class ShardingStage2(ShardingStage1):
    """Stage 1 and gradients reduce-scattered: each rank keeps only the gradient shard it updates."""

    stage = 2


class ShardingStage3(ShardingStage2):
    """Stage 2 and parameters themselves sharded; they are gathered when an op needs them."""

    stage = 3


@torch.no_grad()
def _place_plain(optimizer) -> None:
    """Dense parameters left on the CPU of a GPU rank move to its GPU, in place (their gradients, as dist tensors,
    come back on the GPU, where the dist parameters' blocks already are; Paddle creates them there)."""
    want = device()
    if want.type == "cpu":
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, DistTensor) or p.device.type != "cpu":
                continue
            p.data = p.data.to(want)
            if p.grad is not None:
                p.grad = p.grad.to(want)
            st = optimizer.state.get(p)
            if st:
                for k, v in st.items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        st[k] = v.to(want)


class _StateView(MutableMapping):
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


class _ShardOptimizer:
    """Wraps a torch optimizer whose parameters are dist tensors (Paddle's shard_optimizer result)."""

    def __init__(self, optimizer: torch.optim.Optimizer, shard_fn=None, gradient_accumulation_steps: int = 1):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"shard_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be a positive int, got {gradient_accumulation_steps}")
        if shard_fn is not None and not isinstance(shard_fn, _ShardingStage):
            raise ValueError(f"shard_fn must be ShardingStage1/2/3, got {shard_fn!r}")
        self._inner = optimizer
        self._stage = shard_fn
        # as in Paddle, only recorded: every step() updates; the training loop decides how often to call it
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self._shadow: dict = {}  # param -> sharded leaf the inner optimizer updates (stages 1 and 2)
        self._of_shadow: dict = {}  # that leaf -> the user's param
        _place_plain(optimizer)
        if shard_fn is not None:
            self._setup_sharding()

    def _setup_sharding(self, only=None) -> None:
        """Shard the states (stage 1/2: through a sharded shadow leaf; stage 3: the parameter itself) of every dist
        parameter, or of those in ``only`` (parameters that became dist at a step)."""
        stage = self._stage
        skip = {id(s) for s in self._shadow.values()}
        wanted = None if only is None else {id(p) for p in only}
        for group in self._inner.param_groups:
            new_params = []
            for p in group["params"]:
                if not isinstance(p, DistTensor) or id(p) in skip or (wanted is not None and id(p) not in wanted):
                    new_params.append(p)
                    continue
                pl = stage.sharded(p)
                if pl is None:
                    new_params.append(p)
                    continue
                with torch.no_grad():
                    sharded = reshard(p.detach(), p.process_mesh, pl)
                if stage.stage >= 3:
                    p._hold(sharded)  # the parameter itself now lives sharded
                    new_params.append(p)
                    self._emit_ownership(p, "param+grad+state")
                else:
                    shadow = torch.nn.Parameter(sharded, requires_grad=True)
                    self._shadow[p] = shadow
                    self._of_shadow[shadow] = p
                    new_params.append(shadow)
                    self._emit_ownership(p, "state" if stage.stage == 1 else "grad+state")
            group["params"] = new_params

    @torch.no_grad()
    def _make_dist(self) -> None:
        """A dense parameter whose gradient is a dist tensor (a plain model fed dist batches) becomes a dist tensor,
        in place, Replicate on the gradient's mesh, as Paddle's update makes it; its states follow."""
        made = []
        for group in self._inner.param_groups:
            for p in group["params"]:
                g = p.grad
                if isinstance(p, DistTensor) or not isinstance(g, DistTensor):
                    continue
                mesh = g.process_mesh
                rep = [Replicate()] * mesh.ndim
                value = shard_tensor(p.detach().to(g.device), mesh, rep)
                new = torch.nn.Parameter(value, requires_grad=p.requires_grad)
                p.grad = None
                torch.utils.swap_tensors(p, new)
                p.grad = g
                st = self._inner.state.get(p)
                for k, v in (st or {}).items():
                    if torch.is_tensor(v) and not isinstance(v, DistTensor) and v.dim() > 0:
                        st[k] = shard_tensor(v, mesh, rep)
                made.append(p)
        if made and self._stage is not None:
            self._setup_sharding(only=made)

    def _emit_ownership(self, p, what) -> None:
        if trace.active():
            from ..core.sharding import SHARDED, STAGES

            level, mesh = STAGES[self._stage.stage], p.process_mesh
            group = mesh.axis_group_of(tdist.get_rank(), self._stage.axis)
            trace.emit(trace.Ownership(
                p.name, level, SHARDED[level], tuple(p.shape), group=group, mesh=mesh.to_dict(),
                placements=tuple(repr(q) for q in (self._stage.sharded(p) or p.placements)),
                tensor_id=p.tensor_id).to_event())

    @property
    def param_groups(self):
        return self._inner.param_groups

    @property
    def state(self):
        """The inner optimizer's state, keyed by the user's parameters (a stage-1/2 state lives on a sharded shadow
        of the parameter; ``opt.state[p]`` finds it)."""
        return _StateView(self._inner.state, self._shadow, self._of_shadow)

    def _grad_clip_of(self):
        return self.__dict__.get("_grad_clip") or getattr(self._inner, "_grad_clip", None)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @torch.no_grad()
    def _sync_grads(self) -> None:
        shadows = {id(s) for s in self._shadow.values()}
        for group in self._inner.param_groups:
            for q in group["params"]:
                if isinstance(q, DistTensor) and q.grad is not None and id(q) not in shadows:
                    want = list(q.placements)
                    if list(q.grad.placements) != want:
                        q.grad = reshard(q.grad, q.process_mesh, want)  # Partial grads reduced once, here
        for p, shadow in self._shadow.items():
            if p.grad is None:
                shadow.grad = None
                continue
            g = p.grad
            if self._stage.stage == 1:
                g = reshard(g, p.process_mesh, p.placements)  # full gradient kept, then this rank's part
            shadow.grad = reshard(g, shadow.process_mesh, shadow.placements)
            if self._stage.stage >= 2:
                p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        self._make_dist()
        self._sync_grads()
        clip = self._grad_clip_of()
        if clip is not None:
            clip([q for group in self._inner.param_groups for q in group["params"]])
        out = self._inner.step(closure) if closure is not None else self._inner.step()
        for p, shadow in self._shadow.items():
            full = reshard(shadow.detach(), p.process_mesh, p.placements)
            p._hold(full)
        return out

    def clear_grad(self, set_to_zero: bool = True) -> None:
        self.zero_grad(set_to_none=not set_to_zero)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)
        for p in self._shadow:
            p.grad = None

    def state_dict(self):
        return self._inner.state_dict()

    def load_state_dict(self, sd) -> None:
        self._inner.load_state_dict(sd)

    set_state_dict = load_state_dict

    def __repr__(self) -> str:
        return f"ShardOptimizer({type(self._inner).__name__}, stage={self._stage!r})"


def shard_optimizer(optimizer, shard_fn=None, gradient_accumulation_steps: int = 1):
    """Make ``optimizer`` step dist parameters: Partial gradients are reduced once before the update; dense
    parameters on the CPU of a GPU rank move to its GPU (in place). With
    ``ShardingStage1/2/3(sharding_mesh_dim, mesh)`` optimizer states (then gradients, then parameters) are sharded
    along that mesh axis. ``gradient_accumulation_steps`` is recorded as Paddle records it: every ``step()``
    updates, so a loop that accumulates k micro-batches calls ``step()`` once per k."""
    return _ShardOptimizer(optimizer, shard_fn, gradient_accumulation_steps)



class ShardDataloader:
    """Iterates a DataLoader and turns every batch tensor into a dist tensor split along one mesh axis."""

    def __init__(self, dataloader, meshes, input_keys=None, shard_dims=None, is_dataset_splitted=False):
        meshes = list(meshes) if isinstance(meshes, (list, tuple)) else [meshes]
        if not meshes or not all(isinstance(m, ProcessMesh) for m in meshes):
            raise ValueError(f"shard_dataloader: meshes must be a ProcessMesh or a list of them, got {meshes!r}")
        if isinstance(shard_dims, (list, tuple)):
            if len(shard_dims) != len(meshes):
                raise ValueError(f"shard_dataloader: {len(shard_dims)} shard_dims for {len(meshes)} meshes")
            dims = list(shard_dims)
        else:
            dims = [shard_dims] * len(meshes)
        self._axes = [None if d is None else m.axis(d) for m, d in zip(meshes, dims)]  # raises on unknown names
        self.dataloader = dataloader
        self.meshes = meshes
        self.input_keys = list(input_keys) if input_keys is not None else None
        self.is_dataset_splitted = is_dataset_splitted
        init_parallel_env()

    def _placements(self, i: int, ndim: int):
        mesh = self.meshes[i]
        pl = [Replicate()] * mesh.ndim
        axis = self._axes[i]
        if axis is not None and ndim > 0:
            pl[axis] = Shard(0)
        return mesh, pl

    def _convert(self, value, i: int):
        if isinstance(value, torch.Tensor) and not isinstance(value, DistTensor):
            mesh, pl = self._placements(min(i, len(self.meshes) - 1), value.dim())
            if self.is_dataset_splitted:
                return dtensor_from_local(value, mesh, pl)
            return shard_tensor(value, mesh, pl)
        return value

    def _shard(self, batch):
        if isinstance(batch, dict):
            keys = self.input_keys or list(batch)
            return {k: self._convert(v, keys.index(k) if k in keys else 0) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            if len(self.meshes) > 1:
                out = [self._convert(v, i) for i, v in enumerate(batch)]
            else:
                out = [self._convert(v, 0) for v in batch]
            return type(batch)(out) if isinstance(batch, tuple) else out
        return self._convert(batch, 0)

    def __iter__(self):
        for batch in self.dataloader:
            yield self._shard(batch)

    def __call__(self):
        return iter(self)

    def __len__(self) -> int:
        return len(self.dataloader)

    def __repr__(self) -> str:
        return f"ShardDataloader(meshes={len(self.meshes)}, axes={self._axes})"


def shard_dataloader(dataloader, meshes, input_keys=None, shard_dims=None, is_dataset_splitted=False):
    """Split every batch along the mesh axis ``shard_dims`` names (batch dim 0), Replicate on the other axes.

    With several meshes (pipelines), element i of a tuple batch (or ``input_keys[i]`` of a dict batch) goes to
    ``meshes[i]``; a single tensor goes to ``meshes[0]``. Unlike Paddle, the axis named is the axis used.
    ``is_dataset_splitted=True``: each rank's loader already yields its own part.
    """
    return ShardDataloader(dataloader, meshes, input_keys, shard_dims, is_dataset_splitted)

