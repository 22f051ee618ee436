"""Paddle's DistributedStrategy: hybrid_configs, pipeline_configs and the data-parallel knobs."""

from __future__ import annotations

import copy

__all__ = ["DistributedStrategy"]

_HYBRID_DEFAULTS = {
    "dp_degree": -1,  # -1: whatever the world size leaves over
    "mp_degree": 1,
    "pp_degree": 1,
    "sharding_degree": 1,
    "sep_degree": 1,
    "order": ["dp", "pp", "sharding", "sep", "cp", "mp"],  # Paddle's hybrid_parallel_order
    "pp_configs": {},
    "mp_configs": {"need_broadcast_data": True},
    "dp_configs": {},
    "sharding_configs": {},
    # Paddle's other keys, kept so that code setting them runs: the switches have no effect here, and the
    # context, expert and moe-sharding degrees must stay 1 (those parallelisms do not exist here)
    "enable_optimizer_timer": False, "split_norm_comm": False,
    "cp_degree": 1, "cp_sharding_degree": 1, "ep_degree": 1, "moe_sharding_degree": 1,
    **{k: {} for k in ("sep_configs", "dp_sep_configs", "pp_tp_configs", "ep_configs", "moe_sharding_configs",
                       "default_comm_group_configs", "cp_configs", "cp_sharding_configs", "dp_cp_configs",
                       "cp_mp_configs")},
}

_UNSUPPORTED_DEGREES = ("cp_degree", "cp_sharding_degree", "ep_degree", "moe_sharding_degree")

_PIPELINE_DEFAULTS = {
    "micro_batch_size": 1,
    "accumulate_steps": 1,
    "schedule_mode": "1F1B",
    "p2p_cache_shape": True,
    "enable_partial_send_recv": True,
}

_TENSOR_PARALLEL_DEFAULTS = {"tensor_parallel_degree": 1, "tensor_init_seed": -1}

# Paddle's defaults for the configs meshviz keeps but does not act on (fleet's amp, recompute and gradient merge
# are the user's torch code here)
_OTHER_DEFAULTS = {
    "amp_configs": {
        "init_loss_scaling": 32768.0, "incr_every_n_steps": 1000, "decr_every_n_nan_or_inf": 2, "incr_ratio": 2.0,
        "decr_ratio": 0.8, "use_dynamic_loss_scaling": True, "custom_white_list": [], "custom_black_list": [],
        "custom_black_varnames": [], "use_pure_fp16": False, "use_fp16_guard": True, "use_optimizer_fp16": False,
        "use_pure_bf16": False,
    },
    "recompute_configs": {"checkpoints": [], "enable_offload": False, "checkpoint_shape": [], "enable_tuning": False,
                          "refined_ops_patterns": []},
    "gradient_merge_configs": {"k_steps": 1, "avg": True},
}

# Paddle's switches that have no effect here; kept so that code setting them runs (their Paddle defaults)
_PLAIN_DEFAULTS = {
    "find_unused_parameters": False, "fuse_grad_size_in_MB": 32, "last_comm_group_size_MB": 1,
    "fuse_all_reduce_ops": True, "sharding": False, "tensor_parallel": False, "pipeline": False, "amp": False,
    "recompute": False, "gradient_merge": False, "a_sync": True, "sync_nccl_allreduce": True, "nccl_comm_num": 1,
    "use_hierarchical_allreduce": False, "sync_batch_norm": False, "lars": False, "lamb": False, "dgc": False,
    "localsgd": False, "heter_ccl_mode": False,
}


def _checked_order(name: str, order) -> list[str]:
    """``order`` as a list, or ValueError unless it names dp, pp, sharding, mp (and optionally sep, cp) once each."""
    names = list(order) if isinstance(order, (list, tuple)) else None
    known = {"dp", "pp", "sharding", "mp", "sep", "cp"}
    if (names is None or len(set(names)) != len(names) or not set(names) <= known
            or not {"dp", "pp", "sharding", "mp"} <= set(names)):
        raise ValueError(f"{name} must order dp, pp, sharding, mp (and optionally sep, cp) once each, got {order!r}")
    return names


def _merge(name: str, current: dict, update) -> dict:
    if not isinstance(update, dict):
        raise TypeError(f"{name} must be a dict, got {type(update).__name__}")
    unknown = sorted(set(update) - set(current))
    if unknown:
        raise ValueError(f"{name}: unknown keys {unknown}; known: {sorted(current)}")
    out = copy.deepcopy(current)
    for k, v in update.items():
        if isinstance(out[k], dict) and isinstance(v, dict):
            out[k] = {**out[k], **v}
        else:
            out[k] = copy.deepcopy(v)
    return out


class DistributedStrategy:
    """Settings for ``fleet.init``/``distributed_model``. Assigning a config dict merges it into the current one.

    Reading ``hybrid_configs`` (or any ``*_configs``) gives a copy, as in Paddle: change it by assigning. As in
    Paddle, setting an attribute the strategy does not have (a typo such as ``hybrid_config``) raises TypeError.
    """

    def __init__(self):
        d = self.__dict__  # before the lock below: plain stores
        d["_hybrid"] = copy.deepcopy(_HYBRID_DEFAULTS)
        d["_pipeline"] = copy.deepcopy(_PIPELINE_DEFAULTS)
        d["_tensor_parallel"] = copy.deepcopy(_TENSOR_PARALLEL_DEFAULTS)
        d["_other"] = copy.deepcopy(_OTHER_DEFAULTS)
        d.update(copy.deepcopy(_PLAIN_DEFAULTS))

    def __setattr__(self, name, value):
        if name not in self.__dict__ and not isinstance(getattr(type(self), name, None), property):
            raise TypeError(f"{name} is not a attribute of {type(self).__name__}")
        object.__setattr__(self, name, value)

    def _config(self, name: str) -> dict:
        return copy.deepcopy(self._other[name])

    def _set_config(self, name: str, configs) -> None:
        self._other[name] = _merge(name, self._other[name], configs)

    amp_configs = property(lambda self: self._config("amp_configs"),
                           lambda self, c: self._set_config("amp_configs", c))
    recompute_configs = property(lambda self: self._config("recompute_configs"),
                                 lambda self, c: self._set_config("recompute_configs", c))
    gradient_merge_configs = property(lambda self: self._config("gradient_merge_configs"),
                                      lambda self, c: self._set_config("gradient_merge_configs", c))

    @property
    def hybrid_configs(self) -> dict:
        return copy.deepcopy(self._hybrid)

    @hybrid_configs.setter
    def hybrid_configs(self, configs):
        merged = _merge("hybrid_configs", self._hybrid, configs)
        for k in ("dp_degree", "mp_degree", "pp_degree", "sharding_degree", "sep_degree"):
            v = merged[k]
            if isinstance(v, bool) or not isinstance(v, int) or (v < 1 and not (k == "dp_degree" and v == -1)):
                raise ValueError(f"hybrid_configs[{k!r}] must be a positive int (dp_degree may be -1), got {v!r}")
        for k in _UNSUPPORTED_DEGREES:
            if merged[k] not in (0, 1) or isinstance(merged[k], bool):
                raise ValueError(f"hybrid_configs[{k!r}] = {merged[k]!r}: only 1 is supported (that parallelism "
                                 f"does not exist here)")
        merged["order"] = _checked_order("hybrid_configs['order']", merged["order"])
        self._hybrid = merged

    @property
    def hybrid_parallel_order(self) -> list[str]:
        """The axes' order in ``fleet.init``'s topology, outermost first (Paddle's attribute; ``hybrid_configs``'
        ``'order'`` sets it too)."""
        return list(self._hybrid["order"])

    @hybrid_parallel_order.setter
    def hybrid_parallel_order(self, order):
        self._hybrid["order"] = _checked_order("hybrid_parallel_order", order)

    @property
    def pipeline_configs(self) -> dict:
        return copy.deepcopy(self._pipeline)

    @pipeline_configs.setter
    def pipeline_configs(self, configs):
        merged = _merge("pipeline_configs", self._pipeline, configs)
        for k in ("micro_batch_size", "accumulate_steps"):
            if isinstance(merged[k], bool) or not isinstance(merged[k], int) or merged[k] < 1:
                raise ValueError(f"pipeline_configs[{k!r}] must be a positive int, got {merged[k]!r}")
        self._pipeline = merged

    @property
    def tensor_parallel_configs(self) -> dict:
        return copy.deepcopy(self._tensor_parallel)

    @tensor_parallel_configs.setter
    def tensor_parallel_configs(self, configs):
        self._tensor_parallel = _merge("tensor_parallel_configs", self._tensor_parallel, configs)

    def __repr__(self) -> str:
        h = self._hybrid
        return (f"DistributedStrategy(dp={h['dp_degree']}, mp={h['mp_degree']}, pp={h['pp_degree']}, "
                f"sharding={h['sharding_degree']}, order={h['order']})")
