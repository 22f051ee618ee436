"""ConvParallel: Paddle 3.3's plan that splits a Conv2d's input along its width over ``mp``."""

from __future__ import annotations

from torch import nn

from ....core.placements import Replicate, Shard
from .tensor_parallel import PlanBase, _as_dist, _axis, _first, _label, _move, _put_first

__all__ = ["ConvParallel"]

_W = 3  # torch's Conv2d is NCHW


def _padding_w(layer) -> int:
    pad = layer.padding
    if isinstance(pad, str):  # 'valid' pads nothing; 'same' pads half the dilated kernel
        return 0 if pad == "valid" else layer.dilation[1] * (layer.kernel_size[1] - 1) // 2
    return pad[1]


def supported(shape, layer, degree: int) -> bool:
    """Paddle's ``ConvParallel._is_supported`` for an input of ``shape``: the conditions under which its ring
    convolution can split the width (the width divisible by the degree, dilation 1; without width padding, disjoint
    windows; with it, stride 1 and a kernel no wider than twice the width)."""
    if len(shape) != 4:
        return False
    width, kernel, stride = shape[_W], layer.kernel_size[1], layer.stride[1]
    if width % degree or layer.dilation[1] != 1:
        return False
    if _padding_w(layer) == 0:
        return width % stride == 0 and stride == kernel
    return stride == 1 and kernel // 2 <= width


class ConvParallel(PlanBase):
    """Split a ``Conv2d``'s input along its width (NCHW dim 3) over ``mp`` before its forward, as Paddle's plan
    does, where Paddle's ring convolution supports the layer and input (else the input is left as it is). The
    convolution itself runs on the whole width (meshviz has no ring convolution): the op layer gathers the input
    back, so the output is whole along ``mp`` (Paddle's stays split along the width); the values are the same."""

    def __init__(self) -> None:
        super().__init__()

    def check_layer(self, layer, name: str) -> None:
        """Paddle's plan reads the layer's data format at ``parallelize``: a layer that is no convolution raises."""
        if not isinstance(layer, nn.modules.conv._ConvNd):
            raise ValueError(f"ConvParallel on {name}: it splits a Conv2d's input width; {name} is a "
                             f"{type(layer).__name__}")

    def conv_parallel_start(self, process_mesh):
        mp = _axis(process_mesh, "mp", "ConvParallel")

        def start(layer, input):
            if not isinstance(layer, (nn.Conv2d, nn.ConvTranspose2d)):  # Paddle's splits 2-D convolutions only
                return input
            target = _first(input, "ConvParallel")
            if not supported(tuple(target.shape), layer, process_mesh.shape[mp]):
                return input
            target = _as_dist(target, process_mesh)
            placements = list(target.placements) if target.process_mesh == process_mesh else \
                [Replicate()] * process_mesh.ndim
            if placements[mp] == Shard(_W):
                return input
            placements[mp] = Shard(_W)
            return _put_first(input, _move(target, process_mesh, placements, _label(layer, "input")))

        return start

    def apply(self, layer, process_mesh, shard_param_list):
        layer.register_forward_pre_hook(self.conv_parallel_start(process_mesh))
