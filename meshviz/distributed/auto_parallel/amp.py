"""Paddle's AMP level 'O2' for DistModel: each step runs on low-precision copies of the float32 parameters."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["PureLowPrecision", "amp_dtype", "pure_low_precision"]

# Paddle's ``need_keep_fp32``: batch norms keep float32 parameters; layer and instance norms too under float16
_KEEP_ALWAYS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_KEEP_FP16 = (nn.LayerNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def amp_dtype(name) -> torch.dtype:
    return torch.float16 if str(name) == "float16" else torch.bfloat16


def pure_low_precision(strategy, optimizer) -> bool:
    """Whether ``strategy`` asks for O2; ValueError where meshviz cannot run it."""
    amp = strategy.amp
    o2 = bool(amp.enable) and str(amp.level).lower() == "o2"
    if o2 and ((strategy.sharding.enable and optimizer is not None) or strategy.fused_passes.enable):
        raise ValueError("to_static: amp level 'O2' with strategy.sharding or strategy.fused_passes is not "
                         "supported; use level 'O1' there")
    return o2


class PureLowPrecision:
    """O2: the layer's parameters stay float32 (the master weights the optimizer steps, as Paddle's
    multi-precision optimizer); every forward runs on their casts to the low dtype (norm layers' kept float32,
    as Paddle's), and the casts' gradients reach the float32 parameters as float32 gradients."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        keep: set = set()
        for mname, m in layer.named_modules():
            if isinstance(m, _KEEP_ALWAYS) or (dtype == torch.float16 and isinstance(m, _KEEP_FP16)):
                pre = f"{mname}." if mname else ""
                keep |= {pre + n for n, _ in m.named_parameters(recurse=False)}
        self.params = [n for n, p in layer.named_parameters() if n not in keep and p.is_floating_point()]
        self._copies: dict = {}

    def copies(self, layer: nn.Module) -> dict:
        """The low-precision stand-ins of this step (leaves that collect the gradients). Buffers stay as they are:
        the forward may write them (running statistics)."""
        params = dict(layer.named_parameters())
        out = {}
        for n in self.params:
            p = params[n]
            c = p.detach().to(self.dtype)
            out[n] = c.requires_grad_() if p.requires_grad else c
        return out

    def run(self, layer: nn.Module, inputs):
        """The layer's forward on this step's copies."""
        self._copies = self.copies(layer)
        return torch.func.functional_call(layer, self._copies, tuple(inputs))

    def master_grads(self, layer: nn.Module) -> None:
        """Add the copies' gradients, as float32, to the parameters' (summed over gradient-merge steps)."""
        params = dict(layer.named_parameters())
        with torch.no_grad():
            for n in self.params:
                g = self._copies[n].grad
                if g is None:
                    continue
                p = params[n]
                g = g.to(p.dtype)
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        self._copies = {}
