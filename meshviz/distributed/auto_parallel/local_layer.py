"""LocalLayer: a layer whose forward sees local blocks and whose outputs become dist tensors again."""

from __future__ import annotations

import torch

from ...compat import tree_flatten, tree_unflatten
from ...runtime.dtensor import DistTensor
from ..api import dtensor_from_local, dtensor_to_local

__all__ = ["LocalLayer"]


class LocalLayer(torch.nn.Module):
    """Dist inputs enter ``forward`` as this rank's blocks; output i leaves as a dist tensor with
    ``out_dist_attrs[i] = (mesh, placements)`` built from this rank's result (``dtensor_from_local``)."""

    def __init__(self, out_dist_attrs):
        super().__init__()
        self.out_dist_attrs = list(out_dist_attrs)

    def __call__(self, *inputs, **kwargs):
        inputs = [dtensor_to_local(x) if isinstance(x, DistTensor) else x for x in inputs]
        outputs = super().__call__(*inputs, **kwargs)
        flat, spec = tree_flatten(outputs)
        if len(flat) != len(self.out_dist_attrs):
            raise ValueError(f"The number of outputs ({len(flat)}) does not match the number of distribution "
                             f"attributes ({len(self.out_dist_attrs)}).")
        outs = [dtensor_from_local(o, mesh, placements) for o, (mesh, placements) in zip(flat, self.out_dist_attrs)]
        return tree_unflatten(outs, spec)
