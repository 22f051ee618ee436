"""Paddle's ``dist.Strategy``: sections of options with Paddle's defaults; unknown options raise."""

from __future__ import annotations

import copy

__all__ = ["Strategy", "UnknownOption", "SECTIONS", "BASE_DEFAULTS"]


class UnknownOption(ValueError, AttributeError):
    """An option name that the section does not have (Paddle ignores these silently; meshviz raises)."""


BASE_DEFAULTS = {
    "auto_mode": "semi",
    "gradient_scale": True,
    "gradient_scale_using_allreduce_avg": False,
    "use_cache": True,
    "return_numpy": True,
    "all_ranks": False,
    "split_data": True,
    "seed": None,
    "reinit": False,
}

SECTIONS = {
    "sharding": {
        "enable": False, "stage": 1, "degree": 8, "enable_overlap": False, "param_comm_stream_num": 1,
        "grad_comm_stream_num": 1, "param_bucket_size_numel": 1, "grad_bucket_size_numel": 1,
        "enable_hierarchical_comm": False, "partition_algor": "greedy_even", "enable_tuning": False,
        "tuning_range": [], "release_gradients": False, "comm_buffer_size_MB": 256,
        "enable_tensor_fusion": False, "save_unbalanced_param": True,
    },
    "gradient_merge": {"enable": False, "k_steps": 1, "avg": True},
    "pipeline": {
        "enable": False, "schedule_mode": "1F1B", "pp_degree": 1, "vpp_degree": 1, "vpp_seg_method": "",
        "micro_batch_size": 1, "accumulate_steps": 1, "generation_batch_size": 1,
        "enable_send_recv_overlap": False, "job_schedule_profiler_start": -1, "job_schedule_profiler_stop": -1,
        "program_runtimes": [61, 72, 71, 34, 3], "memory_limit_times": -1, "split_backward": False,
        "auto_parallel_sync_shared_params": False,
    },
    "amp": {
        "enable": False, "dtype": "float16", "level": "o1", "init_loss_scaling": 32768.0,
        "incr_every_n_steps": 1000, "decr_every_n_nan_or_inf": 2, "incr_ratio": 2.0, "decr_ratio": 0.8,
        "use_dynamic_loss_scaling": True, "custom_white_list": [], "custom_black_list": [],
        "custom_black_varnames": [], "use_fp16_guard": False, "use_bf16_guard": False,
        "use_master_grad": False, "use_promote": True,
    },
    "fused_passes": {"enable": False, "gemm_epilogue": False, "dropout_add": False},
    "recompute": {
        "enable": False, "checkpoints": [], "no_recompute_segments": [], "sr": 0, "refined_ops_patterns": [],
        "enable_tuning": False,
    },
    "mp_optimization": {
        "allreduce_matmul_grad_overlapping": False, "replace_with_c_embedding": False,
        "replace_with_parallel_cross_entropy": False,
    },
    "dp_optimization": {
        "enable": False, "fuse_all_reduce_ops": True, "fuse_grad_size_in_MB": 32, "overlap_comm_cacl": True,
        "gradient_sync_after_accumulate": False,
    },
    "sp_optimization": {"enable": True},
}


# options Paddle reads as a count of steps: anything but a positive int raises when it is set
_COUNTS = {("gradient_merge", "k_steps")}


class Section:
    """One section (``strategy.sharding``, ``strategy.amp``, ...): attributes with defaults, nothing else."""

    def __init__(self, name: str, config: dict | None = None):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_values", copy.deepcopy(SECTIONS[name]))
        if config is not None:
            if not isinstance(config, dict):
                raise ValueError(f"Strategy.{name}: expected a dict, got {type(config).__name__}")
            for k, v in config.items():
                setattr(self, k, v)

    def __getattr__(self, key):
        values = object.__getattribute__(self, "_values")
        if key in values:
            return values[key]
        raise UnknownOption(self._unknown(key))

    def __setattr__(self, key, value):
        if key not in self._values:
            raise UnknownOption(self._unknown(key))
        if (self._name, key) in _COUNTS and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"Strategy.{self._name}.{key} must be a positive int, got {value!r} "
                             f"({type(value).__name__})")
        self._values[key] = value

    def _unknown(self, key) -> str:
        return f"Strategy.{self._name} has no option {key!r}; it has: {', '.join(self._values)}"

    def to_dict(self) -> dict:
        return copy.deepcopy(self._values)

    def __eq__(self, other) -> bool:
        return isinstance(other, Section) and self._name == other._name and self._values == other._values

    def __repr__(self) -> str:
        changed = {k: v for k, v in self._values.items() if v != SECTIONS[self._name][k]}
        inner = ", ".join(f"{k}={v!r}" for k, v in changed.items())
        return f"{self._name}({inner})"


class Strategy:
    """Parallel and optimisation settings for ``dist.to_static``, sections and defaults as in Paddle 3.

    Taking effect in meshviz: ``sharding`` (enable, stage 1/2/3 -> 'os'/'os_g'/'p_g_os', degree = the
    world size; fed ``shard_dataloader``'s dist batches, each rank runs its rows and the loss is the whole batch's),
    ``gradient_merge`` (enable, k_steps, avg), ``amp`` (enable, dtype, level: 'O1' runs forward and
    loss under torch autocast; 'O2' too, on casts of the parameters to the low dtype (norm layers' kept float32, as
    Paddle's) while the float32 parameters are the master weights the optimizer steps (sharded at stages 1 and 2;
    'O2' with stage 3 is refused), the loss in float32; the loss-scaling options for float16; custom_white_list and
    custom_black_list, Paddle's op names, run those ops on their inputs cast to the low dtype or to float32 over
    autocast's own choice; ``custom_black_varnames`` and, at 'O2', ``use_promote`` False raise),
    ``fused_passes.enable`` (compiles the layer with ``torch.compile``), ``split_data``, ``return_numpy``,
    ``full_graph`` (read-only, from the dict; False: ``to_static`` returns the layer), ``pipeline`` (enable,
    schedule_mode 'FThenB' or '1F1B', accumulate_steps micro-batches, pp_degree: each feed's rows split evenly
    into the micro-batches, gradients averaged over them, one step per call; the last stage returns the
    micro-batches' values merged, the other stages None). The other options are kept and shown.
    ``Strategy({"sharding": {"enable": True, "stage": 2}})`` sets options from a dict; an option or section
    name that Paddle does not have raises ``UnknownOption`` (a ValueError).
    """

    def __init__(self, config: dict | None = None):
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"Strategy: expected a dictionary, got {type(config).__name__}")
        config = copy.deepcopy(config or {})
        object.__setattr__(self, "_base", copy.deepcopy(BASE_DEFAULTS))
        object.__setattr__(self, "_full_graph", config.pop("full_graph", True))
        for name in SECTIONS:
            object.__setattr__(self, "_" + name, Section(name, config.pop(name, None)))
        for k, v in config.items():
            setattr(self, k, v)

    @property
    def full_graph(self) -> bool:
        """Read-only, from the config (default True); False: ``to_static`` returns the layer itself, as Paddle's
        (which then runs it through ``paddle.jit.to_static(layer, full_graph=False)``)."""
        return object.__getattribute__(self, "_full_graph")

    def __getattr__(self, key):
        if key.startswith("_") and key[1:] in SECTIONS:
            raise AttributeError(key)
        if key in SECTIONS:
            return object.__getattribute__(self, "_" + key)
        base = object.__getattribute__(self, "_base")
        if key in base:
            return base[key]
        raise UnknownOption(f"Strategy has no option {key!r}; sections: {', '.join(SECTIONS)}; "
                            f"options: {', '.join(base)}")

    def __setattr__(self, key, value):
        if key == "full_graph":
            raise AttributeError("property 'full_graph' of 'Strategy' object has no setter")
        if key in SECTIONS:
            if isinstance(value, Section) and value._name == key:
                object.__setattr__(self, "_" + key, copy.deepcopy(value))
                return
            raise ValueError(f"Strategy.{key} is a section; set its options (strategy.{key}.enable = True)")
        if key not in self._base:
            raise UnknownOption(f"Strategy has no option {key!r}; sections: {', '.join(SECTIONS)}; "
                                f"options: {', '.join(self._base)}")
        self._base[key] = value

    def to_dict(self) -> dict:
        out = copy.deepcopy(self._base)
        out["full_graph"] = self.full_graph
        for name in SECTIONS:
            out[name] = getattr(self, name).to_dict()
        return out

    def __repr__(self) -> str:
        parts = [repr(getattr(self, n)) for n in SECTIONS if getattr(self, n).to_dict() != SECTIONS[n]]
        parts += [f"{k}={v!r}" for k, v in self._base.items() if v != BASE_DEFAULTS[k]]
        parts += ["full_graph=False"] if not self.full_graph else []
        return f"Strategy({', '.join(parts)})"
