"""Paddle's ``HybridParallelOptimizer``: a torch optimizer whose step first averages what Paddle averages."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as tdist

from ...runtime.agree import same_on_every_rank
from ...runtime.devices import device
from ...runtime.zero import OwnerZero, ShardingGroup, Zero, layout_settings
from .state import current
from .topology import ParallelMode
from .utils.hybrid_parallel_util import sync_dp_sep_grads

__all__ = ["HybridParallelOptimizer", "check_sharding_layout"]


def check_sharding_layout(who: str, hcg, model=None, optimizer=None) -> None:
    """With sharding > 1: raise ValueError on every rank of each sharding group, then of each data-parallel group,
    where their ranks' parameters (names, shapes, dtypes, which require grad) or the optimizer's parameter groups
    and order differ, as ``group_sharded_parallel`` checks them: the owners, and so every reduce and broadcast,
    follow from them."""
    if hcg is None or hcg.get_sharding_parallel_world_size() < 2:
        return
    settings = layout_settings(model, optimizer)
    groups = [hcg.get_sharding_parallel_group()]
    if hcg.get_data_parallel_world_size() > 1:
        groups.append(hcg.get_data_parallel_group())
    for g in groups:
        same_on_every_rank(who, settings, g.process_group, g.ranks)


def _agree_grads(sharding) -> None:
    """Give a zero gradient to every parameter that has none here but has one on another rank of the sharding
    group (a branch only some ranks' data took), as one process on the whole batch counts it: the reduce to the
    owner then runs on every rank for the same parameters. One small all-reduce of has-a-gradient flags."""
    params = [p for p in sharding.params if p.requires_grad or p.grad is not None]
    if not params:
        return
    flags = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=device())
    sharding._group.all_reduce(flags, op=tdist.ReduceOp.MAX)
    for p, somewhere in zip(params, flags.tolist()):
        if somewhere and p.grad is None:
            p.grad = torch.zeros_like(p)


def _model_of(optimizer):
    """The model ``fleet.distributed_model`` got last where it holds every parameter of ``optimizer`` (None
    elsewhere): its names say which parameter stands where."""
    ref = current()._model
    model = ref() if ref is not None else None
    try:
        held = {id(p) for p in model.parameters()} if model is not None else set()
        return model if all(id(p) in held for g in optimizer.param_groups for p in g["params"]) else None
    except (AttributeError, KeyError, TypeError):
        return None


class HybridParallelOptimizer(Zero):
    """Wraps a torch optimizer: ``step()`` first averages what Paddle averages, then steps.

    With mp, sharding or pp > 1 and dp > 1, the gradients are averaged over the data-parallel group (in pure
    data parallel, ``DataParallel`` already did it during backward); with sep > 1 they are summed over the sep
    group too, as Paddle's ``fused_allreduce_gradients`` (each sep rank's loss is its part of the sequence's).
    With sharding > 1 it is Paddle's stage 1 (``DygraphShardingOptimizer``, the ZeRO engine's
    :class:`~meshviz.runtime.zero.OwnerZero`): each parameter's gradient is averaged into its one owner in the
    sharding group, which alone keeps its optimizer state and steps it, then broadcasts it (a gradient that only
    some ranks have counts zero on the others, as in one process); ``owner`` maps a parameter to its owner's index
    in the sharding group.

    With sharding, a torch ``GradScaler`` (one not passed through ``fleet.distributed_scaler`` too) gives the
    values of one process: it hands itself to ``step`` on every rank (``_step_supports_amp_scaling``), where every
    gradient is unscaled, not only those of the parameters this rank steps, and the inf/nan check agrees over every
    rank, so all skip a step together and the scaler's ``update`` backs off on all alike.
    """

    def __init__(self, optimizer, hcg, strategy):
        super().__init__(optimizer, None)
        self._hcg = hcg
        self._strategy = strategy
        self._sharding = None
        if hcg is not None and hcg.get_sharding_parallel_world_size() > 1:
            check_sharding_layout("fleet.distributed_optimizer", hcg, _model_of(optimizer), optimizer)
            self._sharding = OwnerZero(optimizer, ShardingGroup(hcg.get_sharding_parallel_group()))
            self.level = self._sharding.level
            self._step_supports_amp_scaling = True  # torch's GradScaler then passes itself to step, on every rank
            # torch warns that the scaler will stop passing itself; until it does, that is what makes its check agree
            warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself",
                                    category=FutureWarning)

    @property
    def owner(self) -> dict | None:
        """id(parameter) -> the sharding-group index of the rank that steps it (None without sharding)."""
        return None if self._sharding is None else dict(self._sharding.owner)

    def _params(self):
        if self._sharding is not None:
            return list(self._sharding.params)
        return [p for g in self._inner_opt.param_groups for p in g["params"]]

    def grad_params(self) -> list:
        return self._params()

    def step(self, closure=None, grad_scaler=None):
        """Paddle's step (see the class); ``grad_scaler``: the torch ``GradScaler`` whose ``step`` called this one,
        which leaves the unscaling and the inf/nan check to it."""
        from ..shard_scaler import unscale_for_step

        if grad_scaler is not None and unscale_for_step(self, grad_scaler):
            return None
        return super().step(closure)

    def _sync_grads(self):
        hcg = self._hcg
        if hcg is None:
            return
        params = self._params()
        if self._sharding is not None:
            _agree_grads(self._sharding)
            self._sharding._sync_grads()
            params = self._sharding.owned()
        if hcg.get_parallel_mode() != ParallelMode.DATA_PARALLEL:
            sync_dp_sep_grads(params, hcg)

    def _clip(self):
        """Paddle's ``HybridParallelClipGrad`` for a ``ClipGradByGlobalNorm`` grad clip (``opt._grad_clip`` or the
        inner optimizer's): the global norm over every rank's gradients, the model-parallel shards added over the
        mp group, every gradient over the pipeline and sharding groups (each rank clips what it steps)."""
        from torch.distributed.tensor import DTensor

        from ...nn import ClipGradByGlobalNorm
        from ...runtime.dtensor import DistTensor

        clip = self.__dict__.get("_grad_clip") or getattr(self._inner_opt, "_grad_clip", None)
        if clip is None:
            return None
        params = self._params() if self._sharding is None else self._sharding.owned()
        params = [p for p in params if p.grad is not None and getattr(p, "need_clip", True)]
        hcg = self._hcg
        if (not isinstance(clip, ClipGradByGlobalNorm) or hcg is None
                or any(isinstance(p.grad, (DistTensor, DTensor)) for p in params)):
            return clip(params)
        # a weight shared across pipeline stages holds one summed gradient on each: counted on its first stage only
        again = [p.grad for p in params if getattr(p, "is_firstly_shared", None) is False]
        params = [p for p in params if getattr(p, "is_firstly_shared", None) is not False]
        # ``is True``: a torch tensor's own ``is_distributed`` is a method
        split = [p.grad for p in params if getattr(p, "is_distributed", False) is True]
        whole = [p.grad for p in params if getattr(p, "is_distributed", False) is not True]
        mp = [hcg.get_model_parallel_group()] if hcg.get_model_parallel_world_size() > 1 else []
        rest = [g for n, g in ((hcg.get_pipe_parallel_world_size(), hcg.get_pipe_parallel_group()),
                               (hcg.get_sharding_parallel_world_size(), hcg.get_sharding_parallel_group())) if n > 1]
        return clip.clip_hybrid([(split, mp + rest), (whole, rest), (again, None)])

    def _gather(self):
        if self._sharding is not None:
            self._sharding._gather()

    def zero_grad(self, set_to_none=True):
        if self._sharding is not None:
            self._sharding.zero_grad(set_to_none)
        else:
            self._inner_opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self._inner_opt.state_dict()

    def set_state_dict(self, state_dict):
        """Load ``state_dict()``'s output; with sharding also the whole model's optimizer state (a one-process
        optimizer's ``state_dict()``), of which this rank loads its own parameters' part, as Paddle's."""
        if self._sharding is not None:
            state_dict = self._sharding.local_state(state_dict)
        return self._inner_opt.load_state_dict(state_dict)

    load_state_dict = set_state_dict

    def __getattr__(self, name):
        if name.startswith("__") or name == "_inner_opt":
            raise AttributeError(name)
        return getattr(self._inner_opt, name)

    def __repr__(self) -> str:
        return f"HybridParallelOptimizer({type(self._inner_opt).__name__})"
