"""What the shards, and so every collective of the ZeRO engine, follow from: checksums of the ranks' layouts."""

from __future__ import annotations

import zlib

__all__ = ["layout_settings"]

_MODEL = ("parameter and buffer names and shapes (checksum)", "parameter and buffer dtypes (checksum)",
          "parameters that require grad (checksum)")
_OPTIMIZER = "optimizer parameter groups and order (checksum)"


def layout_settings(model=None, optimizer=None, names: dict | None = None) -> dict:
    """Checksums of ``model``'s parameters and buffers and of ``optimizer``'s parameter groups, keyed by what each
    covers, for :func:`~meshviz.runtime.agree.same_on_every_rank`; ``names``: id(parameter) -> its name. Without a
    model, the optimizer's parameters stand for it, named by their place in it. A model or optimizer that is not
    one gives placeholders (the rank that refused it raises why)."""
    keys = _MODEL + ((_OPTIMIZER,) if optimizer is not None else ())
    try:
        groups = optimizer.param_groups if optimizer is not None else []
        params = [p for g in groups for p in g["params"]]
        if model is None:
            names = {id(p): str(i) for i, p in enumerate(params)}
            tensors = [(names[id(p)], p) for p in params]
            trained = params
        else:
            names = names or {id(p): n for n, p in model.named_parameters()}
            trained = [p for _, p in model.named_parameters()]
            tensors = list(model.named_parameters()) + list(model.named_buffers())
        values = [[(n, tuple(t.shape)) for n, t in tensors], [str(t.dtype) for _, t in tensors],
                  [names.get(id(p)) for p in trained if p.requires_grad]]
        if optimizer is not None:
            values.append([(names.get(id(p)), gi) for gi, g in enumerate(groups) for p in g["params"]])
        return {k: zlib.crc32(repr(v).encode()) for k, v in zip(keys, values)}
    except (AttributeError, KeyError, TypeError):
        return dict.fromkeys(keys, 0)
