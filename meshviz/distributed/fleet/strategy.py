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
    "order": ["dp", "pp", "sharding", "mp"],
    "pp_configs": {},
    "mp_configs": {},
    "dp_configs": {},
    "sharding_configs": {},
}

_PIPELINE_DEFAULTS = {
    "micro_batch_size": 1,
    "accumulate_steps": 1,
    "schedule_mode": "1F1B",
    "p2p_cache_shape": True,
    "enable_partial_send_recv": True,
}

_TENSOR_PARALLEL_DEFAULTS = {"tensor_parallel_degree": 1, "tensor_init_seed": -1}


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

    Reading ``hybrid_configs`` (or ``pipeline_configs``) gives a copy, as in Paddle: change it by assigning.
    """

    def __init__(self):
        self._hybrid = copy.deepcopy(_HYBRID_DEFAULTS)
        self._pipeline = copy.deepcopy(_PIPELINE_DEFAULTS)
        self._tensor_parallel = copy.deepcopy(_TENSOR_PARALLEL_DEFAULTS)
        self.find_unused_parameters = False
        self.fuse_grad_size_in_MB = 32
        self.last_comm_group_size_MB = 1
        self.fuse_all_reduce_ops = True
        self.sharding = False
        self.tensor_parallel = False
        self.pipeline = False
        self.amp = False
        self.recompute = False
        self.gradient_merge = False

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
        order = list(merged["order"])
        known = {"dp", "pp", "sharding", "mp", "sep"}
        if len(set(order)) != len(order) or not set(order) <= known or not {"dp", "pp", "sharding", "mp"} <= set(order):
            raise ValueError(f"hybrid_configs['order'] must order dp, pp, sharding, mp (and optionally sep) once "
                             f"each, got {order}")
        merged["order"] = order
        self._hybrid = merged

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
