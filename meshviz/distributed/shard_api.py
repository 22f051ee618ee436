"""Auto-parallel training helpers: shard_layer, shard_optimizer (ShardingStage1/2/3), shard_dataloader."""

from __future__ import annotations

import warnings

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..core.mesh import ProcessMesh
from ..core.placements import Replicate
from ..core.sharding import STAGES
from ..runtime.devices import device
from ..runtime.dtensor import DistTensor
from ..runtime.world import init_parallel_env
from ..runtime.zero import (
    PlacedZero,
    Zero,
    check_elementwise,
    create_states,
    dist_params_for_dist_grads,
    grads_as_params,
    sharded_placements,
)
from .api import reshard, shard_tensor
from .dataloader import ShardDataloader, shard_dataloader
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


def _holders(layer: torch.nn.Module, kind: str = "_parameters") -> dict:
    """id(tensor) -> (the parameter or buffer, every ``(sublayer, name, qualified name)`` that holds it);
    ``kind``: ``"_parameters"`` or ``"_buffers"``."""
    out: dict = {}
    for mod_name, mod in layer.named_modules():
        for pname, p in getattr(mod, kind).items():
            if p is not None:
                out.setdefault(id(p), (p, []))[1].append((mod, pname, f"{mod_name}.{pname}" if mod_name else pname))
    return out


def _keep_ties(held: dict, kind: str = "_parameters") -> None:
    """A parameter two sublayers held before ``shard_fn`` ran (an embedding tied to the output layer) stays one
    parameter: the dist parameter ``shard_fn`` put in one holder goes to the holders it left alone (Paddle 3.3.1
    makes each holder a parameter of its own, each stepped on its own gradient). A shared buffer stays one too."""
    what, tied = ("parameter", "tied weights") if kind == "_parameters" else ("buffer", "shared")
    for p, where in held.values():
        if len(where) < 2:
            continue
        now = [getattr(m, kind).get(n) for m, n, _ in where]
        made = {id(q): q for q in now if isinstance(q, DistTensor) and q is not p}
        if not made:
            continue
        first = next(iter(made.values()))
        if any(q.process_mesh != first.process_mesh or list(q.placements) != list(first.placements)
               for q in made.values()):
            raise ValueError(f"shard_layer: {[q for _, _, q in where]} are one {what} ({tied}), and "
                             f"shard_fn placed it in more than one way: "
                             f"{sorted({repr(list(q.placements)) for q in made.values()})}; place it once (a tied "
                             f"{what} is one tensor)")
        for (m, n, _), q in zip(where, now):
            if q is p or id(q) in made:
                getattr(m, kind)[n] = first


def _replicate_rest(layer: torch.nn.Module, mesh: ProcessMesh) -> None:
    done: dict = {}  # id(dense parameter or buffer) -> its dist tensor: a tied (shared) one stays one
    for mod_name, mod in layer.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            if not isinstance(p, DistTensor):
                new = done.get(id(p))
                if new is None:
                    new = done[id(p)] = shard_tensor(p, mesh, [Replicate()] * mesh.ndim,
                                                     name=f"{mod_name}.{pname}" if mod_name else pname)
                setattr(mod, pname, new)
            elif p.name is None:
                p.name = f"{mod_name}.{pname}" if mod_name else pname
        for bname, b in list(mod.named_buffers(recurse=False)):
            if b is not None and not isinstance(b, DistTensor):
                new = done.get(id(b))
                if new is None:
                    new = done[id(b)] = shard_tensor(b, mesh, [Replicate()] * mesh.ndim)
                mod._buffers[bname] = new


def shard_layer(layer: torch.nn.Module, process_mesh: ProcessMesh, shard_fn=None, input_fn=None, output_fn=None):
    """Convert every parameter and buffer of ``layer`` to a dist tensor on ``process_mesh``.

    ``shard_fn(name, sublayer, mesh)`` runs for every sub-layer (itself included) and may shard its parameters;
    whatever it leaves dense becomes Replicate. A parameter or buffer several sub-layers share stays one tensor.
    ``input_fn(inputs, mesh)`` / ``output_fn(outputs, mesh)`` run before / after ``forward``.
    """
    if not isinstance(layer, torch.nn.Module):
        raise ValueError(f"shard_layer expects an nn.Module, got {type(layer).__name__}")
    if not isinstance(process_mesh, ProcessMesh):
        raise ValueError(f"shard_layer expects a ProcessMesh, got {process_mesh!r}")
    for what, fn in (("shard_fn", shard_fn), ("input_fn", input_fn), ("output_fn", output_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"shard_layer: {what} must be callable or None, got {type(fn).__name__}")
    init_parallel_env()
    # a shard_fn that raises part way leaves the layer as it was, not half sharded
    kept = [(m, dict(m._parameters), dict(m._buffers)) for m in layer.modules()]
    try:
        if shard_fn is not None:
            held = {kind: _holders(layer, kind) for kind in ("_parameters", "_buffers")}
            for name, sub in list(layer.named_modules()):
                shard_fn(name, sub, process_mesh)
            for kind, tied in held.items():
                _keep_ties(tied, kind)
        _replicate_rest(layer, process_mesh)
    except BaseException:
        for m, params, buffers in kept:
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
        raise
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
        """Placements that shard ``p`` along the sharding axis, or None when it cannot be (Paddle's
        ``get_placement_with_sharding``: the first tensor dim no other mesh axis shards)."""
        return sharded_placements(p, self.axis, self.mesh)


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


class _ShardOptimizer(PlacedZero):
    """Wraps a torch optimizer whose parameters are dist tensors (Paddle's shard_optimizer result)."""

    def __init__(self, optimizer: torch.optim.Optimizer, shard_fn=None, gradient_accumulation_steps: int = 1):
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, Zero):
            raise ValueError(f"shard_optimizer expects a torch.optim.Optimizer (not one sharded already), got "
                             f"{type(optimizer).__name__}")
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be a positive int, got {gradient_accumulation_steps}")
        if shard_fn is not None and not isinstance(shard_fn, _ShardingStage):
            raise ValueError(f"shard_fn must be ShardingStage1/2/3, got {shard_fn!r}")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if shard_fn is not None or any(isinstance(p, DistTensor) and any(not isinstance(q, Replicate)
                                                                         for q in p.placements) for p in params):
            check_elementwise(optimizer, "shard_optimizer")
        self._inner_opt = optimizer
        self._stage = shard_fn
        self._told = False  # about a stage with nothing to shard
        # as in Paddle, only recorded: every step() updates; the training loop decides how often to call it
        self.gradient_accumulation_steps = gradient_accumulation_steps
        _place_plain(optimizer)
        if shard_fn is None:
            super().__init__(optimizer, None, reshard=reshard, place=shard_tensor)
        else:
            super().__init__(optimizer, STAGES[shard_fn.stage], shard_fn.axis, shard_fn.mesh, reshard=reshard,
                             place=shard_tensor)

    def __getattr__(self, name):
        if name == "_inner_opt":
            raise AttributeError(name)
        return getattr(self._inner_opt, name)

    @torch.no_grad()
    def step(self, closure=None):
        if self._stage is not None and not self._told:
            self._told = True
            params = [p for g in self._inner_opt.param_groups for p in g["params"]]
            if not any(isinstance(p, DistTensor) or isinstance(p.grad, DistTensor) for p in params):
                warnings.warn(f"shard_optimizer: {self._stage!r} shards the states of dist parameters (or of dense "
                              "ones whose gradients are dist, from dist inputs); every parameter and gradient here "
                              "is dense, so nothing is sharded and each rank steps its own copy", stacklevel=2)
        return super().step(closure)

    def state_dict(self):
        """This rank's states; before training they are made first (zeros, as Paddle's), so that
        ``dist.load_state_dict`` has tensors to load a checkpoint into (collective then)."""
        create_states(self, self.grad_params())
        return self._inner_opt.state_dict()

    def load_state_dict(self, sd) -> None:
        self._inner_opt.load_state_dict(sd)

    set_state_dict = load_state_dict

    def __repr__(self) -> str:
        return f"ShardOptimizer({type(self._inner_opt).__name__}, stage={self._stage!r})"


def shard_optimizer(optimizer, shard_fn=None, gradient_accumulation_steps: int = 1):
    """Make ``optimizer`` step dist parameters: Partial gradients are reduced once before the update; dense
    parameters on the CPU of a GPU rank move to its GPU (in place). With
    ``ShardingStage1/2/3(sharding_mesh_dim, mesh)`` optimizer states (then gradients, then parameters) are sharded
    along that mesh axis. ``gradient_accumulation_steps`` is recorded as Paddle records it: every ``step()``
    updates, so a loop that accumulates k micro-batches calls ``step()`` once per k."""
    return _ShardOptimizer(optimizer, shard_fn, gradient_accumulation_steps)



def _plain_optimizer_step(optimizer, args, kwargs) -> None:
    """Any torch optimizer's step, as Paddle's optimizer steps: a dense parameter whose gradient is a dist tensor
    becomes a dist parameter, Replicate on the gradient's mesh, and Partial gradients are reduced once first
    (an optimizer from shard_optimizer has done both before its inner optimizer steps)."""
    if dist_params_for_dist_grads(optimizer, shard_tensor) or any(
            isinstance(p, DistTensor) for group in optimizer.param_groups for p in group["params"]):
        grads_as_params(optimizer, reshard)


register_optimizer_step_pre_hook(_plain_optimizer_step)
