"""Paddle's AMP for DistModel: autocast with Paddle's custom op lists, and level 'O2' on low-precision copies."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from ... import compat

__all__ = ["PureLowPrecision", "amp_dtype", "pure_low_precision", "autocast", "OpLists", "check_lists", "LossScaling"]

# Paddle's op names (legacy and current) -> the names of the torch functions that run that op
_ALIASES = {
    "matmul": ("matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "linear"),
    "matmul_v2": "matmul", "mul": "matmul", "fused_gemm_epilogue": "matmul", "linear": ("linear",),
    "elementwise_add": "add", "add": ("add", "__add__", "__radd__"),
    "elementwise_sub": "subtract", "subtract": ("sub", "subtract", "__sub__", "__rsub__"),
    "elementwise_mul": "multiply", "multiply": ("mul", "multiply", "__mul__", "__rmul__"),
    "elementwise_div": "divide", "divide": ("div", "divide", "true_divide", "__truediv__", "__rtruediv__"),
    "reduce_sum": "sum", "reduce_mean": "mean", "reduce_prod": "prod", "pow": ("pow", "__pow__", "__rpow__"),
    "lookup_table": "embedding", "lookup_table_v2": "embedding", "softmax_with_cross_entropy": "cross_entropy",
    "cross_entropy2": "cross_entropy", "c_softmax_with_cross_entropy": "cross_entropy",
}


def _torch_names(op: str) -> tuple:
    got = _ALIASES.get(op, (op,))
    return _torch_names(got) if isinstance(got, str) else got


def check_lists(amp) -> None:
    """ValueError where the custom lists are not lists of op names or name one op in both (as Paddle's), and
    for what meshviz cannot apply: custom_black_varnames, use_promote False at 'O2'."""
    for key in ("custom_white_list", "custom_black_list"):
        v = getattr(amp, key)
        if isinstance(v, str) or not isinstance(v, (list, tuple, set, frozenset)) or \
                not all(isinstance(o, str) for o in v):
            raise ValueError(f"to_static: amp.{key} must be a list of Paddle op names, got {v!r}")
    both = sorted(set(amp.custom_white_list) & set(amp.custom_black_list))
    if both:
        raise ValueError(f"to_static: Custom white list overlap custom black list: {both}")
    if amp.custom_black_varnames:
        raise ValueError(f"to_static: amp.custom_black_varnames ({amp.custom_black_varnames!r}) names variables of a "
                         f"static program, which meshviz does not build (Paddle's PIR to_static does not read it "
                         f"either); keep ops in float32 with amp.custom_black_list (op names)")
    if not amp.use_promote and str(amp.level).lower() == "o2":
        raise ValueError("to_static: amp.use_promote False is not supported: at 'O2' meshviz runs torch autocast, "
                         "which runs an op off its lists with any float32 input in float32 (Paddle's use_promote True)")


class OpLists(TorchFunctionMode):
    """Paddle's ``custom_white_list`` / ``custom_black_list`` over torch autocast: a white-listed op runs on its
    floating inputs cast to the low dtype, a black-listed one on them cast to float32 (autocast off inside it)."""

    def __init__(self, device_type: str, dtype: torch.dtype, white, black):
        super().__init__()
        self.device_type = device_type
        self.to = {n: dtype for op in white for n in _torch_names(op)}
        self.to.update({n: torch.float32 for op in black for n in _torch_names(op)})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtype = self.to.get(getattr(func, "__name__", None))
        if dtype is None:
            return func(*args, **kwargs)

        def cast(x):
            return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        args, kwargs = compat.tree_map(cast, (tuple(args), kwargs))
        with torch.autocast(self.device_type, enabled=False):
            return func(*args, **kwargs)


@contextlib.contextmanager
def autocast(amp, device_type: str):
    """The context a step's forward and loss run under: torch autocast at O1 and O2, with the custom lists."""
    if not amp.enable or str(amp.level).lower() == "o0":
        with torch.autocast(device_type, enabled=False):
            yield
        return
    dtype = amp_dtype(amp.dtype)
    lists = amp.custom_white_list or amp.custom_black_list
    with torch.autocast(device_type, dtype=dtype), \
            OpLists(device_type, dtype, amp.custom_white_list, amp.custom_black_list) if lists else \
            contextlib.nullcontext():
        yield


# Paddle's ``need_keep_fp32``: batch norms keep float32 parameters; layer and instance norms too under float16
_KEEP_ALWAYS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_KEEP_FP16 = (nn.LayerNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def amp_dtype(name) -> torch.dtype:
    return torch.float16 if str(name) == "float16" else torch.bfloat16


def pure_low_precision(strategy, optimizer) -> bool:
    """Whether ``strategy`` asks for O2; ValueError where meshviz cannot run it."""
    amp = strategy.amp
    o2 = bool(amp.enable) and str(amp.level).lower() == "o2"
    if o2 and strategy.sharding.enable and optimizer is not None and strategy.sharding.stage == 3:
        raise ValueError("to_static: amp level 'O2' with sharding stage 3 is not supported (its parameters are "
                         "gathered by torch FSDP inside the forward); use stage 1 or 2, or level 'O1'")
    return o2


class PureLowPrecision:
    """O2: the layer's parameters stay float32 (the master weights the optimizer steps, as Paddle's
    multi-precision optimizer); every forward runs on their casts to the low dtype (norm layers' kept float32,
    as Paddle's), and the casts' gradients reach the float32 parameters as float32 gradients."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype, compiled: bool = False):
        self.dtype = dtype
        self._call = torch.compile(self._functional) if compiled else self._functional
        keep: set = set()
        for mname, m in layer.named_modules():
            if isinstance(m, _KEEP_ALWAYS) or (dtype == torch.float16 and isinstance(m, _KEEP_FP16)):
                pre = f"{mname}." if mname else ""
                keep |= {pre + n for n, _ in m.named_parameters(recurse=False)}
        self.params = [n for n, p in layer.named_parameters() if n not in keep and p.is_floating_point()]

    def copies(self, layer: nn.Module) -> dict:
        """This step's low-precision casts of the parameters: their gradients reach the float32 parameters as
        float32 gradients in the same backward (through the parameters' own gradient hooks, which a sharded
        optimizer reduces by). Buffers stay as they are: the forward may write them (running statistics)."""
        params = dict(layer.named_parameters())
        return {n: params[n].to(self.dtype) for n in self.params}

    def run(self, layer: nn.Module, inputs, eager: bool = False):
        """The layer's forward on this step's copies (compiled with fused_passes unless ``eager``)."""
        return (self._functional if eager else self._call)(layer, self.copies(layer), tuple(inputs))

    @staticmethod
    def _functional(layer, params, inputs):
        return torch.func.functional_call(layer, params, inputs)


class LossScaling:
    """How DistModel's float16 loss scale moves, as Paddle's ``update_loss_scaling``: times ``decr_ratio`` (not below
    1) after ``decr_every_n_nan_or_inf`` steps in a row that saw inf/nan, times ``incr_ratio`` (while finite) after
    ``incr_every_n_steps`` clean steps in a row. Torch's GradScaler backs off at every such step. The scale and the
    counters are tensors under Paddle's names (``tensors()``): a checkpoint loaded into them in place
    (``dist.load_state_dict``) reaches the scaler at the next step."""

    KEYS = ("loss_scaling_0", "num_good_steps_0", "num_bad_steps_0")  # Paddle's names for them

    def __init__(self, amp):
        self.incr, self.decr = float(amp.incr_ratio), float(amp.decr_ratio)
        self.every, self.decr_every = int(amp.incr_every_n_steps), int(amp.decr_every_n_nan_or_inf)
        self.scale = torch.tensor([float(amp.init_loss_scaling)], dtype=torch.float32)
        self.good = torch.zeros(1, dtype=torch.int32)
        self.bad = torch.zeros(1, dtype=torch.int32)

    def tensors(self) -> dict:
        return dict(zip(self.KEYS, (self.scale, self.good, self.bad)))

    @staticmethod
    def value_of(key, v):
        """``v`` (a one-element tensor, dist tensor, array or number) as a number; ValueError naming ``key``
        otherwise."""
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        elif not torch.is_tensor(v) and hasattr(v, "__array__"):  # numpy, as Paddle's program takes
            v = torch.as_tensor(v)
        if torch.is_tensor(v) and v.numel() == 1:
            v = v.item()
        scale = key == "loss_scaling_0"
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
                (v <= 0 if scale else (v != int(v) or v < 0)):
            what = "positive number" if scale else "count"
            raise ValueError(f"set_state_dict: {key} takes one {what} (a tensor of shape [1], as state_dict gives), "
                             f"got {v!r}")
        return v

    def load(self, values: dict, scaler) -> None:
        """Set the scale and counters from ``values`` (as ``value_of`` gives them) and the scaler's scale."""
        for key, t in self.tensors().items():
            if key in values:
                t.fill_(values[key])
        self.sync(scaler)

    def sync(self, scaler) -> None:
        """The scaler's scale set to ``self.scale`` where they differ (a checkpoint was loaded into it)."""
        want = float(self.scale)
        if scaler.get_scale() != want:
            state = scaler.state_dict()
            state["scale"] = want
            scaler.load_state_dict(state)

    def step(self, scaler, optimizer) -> None:
        """``scaler.step(optimizer)`` (skipped on inf/nan, agreed over the ranks), then the scale's update."""
        scaler.step(optimizer)
        found = any(bool(v.item()) for st in scaler._per_optimizer_states.values()
                    for v in st["found_inf_per_device"].values())
        scale, good, bad = scaler.get_scale(), int(self.good), int(self.bad)
        if found:
            good, bad = 0, bad + 1
            if bad == self.decr_every:
                scale, bad = max(scale * self.decr, 1.0), 0
        else:
            good, bad = good + 1, 0
            if good == self.every:
                grown, good = scale * self.incr, 0
                scale = grown if math.isfinite(grown) else scale
        scaler.update(float(scale))
        self.scale.fill_(scale)
        self.good.fill_(good)
        self.bad.fill_(bad)
