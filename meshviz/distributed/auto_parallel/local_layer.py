"""LocalLayer: a layer whose forward sees local blocks and whose outputs become dist tensors again."""

from __future__ import annotations

import torch

from ...compat import tree_flatten, tree_unflatten
from ...runtime.dtensor import DistTensor
from ..api import dtensor_from_local, dtensor_to_local

__all__ = ["LocalLayer"]


class LocalLayer(torch.nn.Module):
    """Dist inputs enter ``forward`` as this rank's blocks; output i leaves as a dist tensor with
    ``out_dist_attrs[i] = (mesh, placements)`` built from this rank's result (``dtensor_from_local``).

    ``grad_dist_attrs``: one entry per positional input, as in Paddle: ``(mesh, placements)``, the layout of the
    gradient flowing back into that dist input (``dtensor_to_local``'s), or None for the input's own. Paddle requires
    it; left out here, every input's gradient lies as the input does.
    """

    def __init__(self, out_dist_attrs, grad_dist_attrs=None):
        super().__init__()
        self.out_dist_attrs = list(out_dist_attrs)
        if grad_dist_attrs is not None:
            grad_dist_attrs = list(grad_dist_attrs)
            for i, a in enumerate(grad_dist_attrs):
                if a is not None and not (isinstance(a, (list, tuple)) and len(a) == 2):
                    raise ValueError(f"grad_dist_attrs[{i}] must be None or a (mesh, placements) pair, got {a!r}")
        self.grad_dist_attrs = grad_dist_attrs

    def __call__(self, *inputs, **kwargs):
        attrs = self.grad_dist_attrs
        if attrs is None:
            attrs = [None] * len(inputs)
        elif len(inputs) != len(attrs):
            raise ValueError(f"The number of inputs ({len(inputs)}) does not match the number of grad_dist_attrs "
                             f"({len(attrs)}).")
        inputs = [(dtensor_to_local(x) if a is None else dtensor_to_local(x, a[0], a[1]))
                  if isinstance(x, DistTensor) else x for x, a in zip(inputs, attrs)]
        outputs = super().__call__(*inputs, **kwargs)
        flat, spec = tree_flatten(outputs)
        if len(flat) != len(self.out_dist_attrs):
            raise ValueError(f"The number of outputs ({len(flat)}) does not match the number of distribution "
                             f"attributes ({len(self.out_dist_attrs)}).")
        outs = [dtensor_from_local(o, mesh, placements) for o, (mesh, placements) in zip(flat, self.out_dist_attrs)]
        return tree_unflatten(outs, spec)
