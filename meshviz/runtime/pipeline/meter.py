"""What a pipeline step keeps per micro-batch: live activation bytes, and each micro loss scaled for accumulation."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ActivationMeter", "MicroLoss"]


class ActivationMeter:
    """Bytes saved for backward per (virtual stage, micro-batch), live from its forward until its backward.

    Parameters saved by autograd are not counted; a tensor saved twice in one micro-batch is counted once. Storages
    are told apart by their identity, not their address: a simulated rank's tensors have no address.
    """

    def __init__(self):
        self.live = 0
        self.peak = 0
        self._held: dict = {}
        self._params: set = set()

    def watch(self, module: nn.Module) -> None:
        self._params |= {p.untyped_storage()._cdata for p in module.parameters()}

    def hooks(self, key):
        seen: set = set()
        total = [0]

        def pack(t):
            try:
                base = t.untyped_storage()._cdata
                key = (base, t.storage_offset(), t.numel())
            except Exception:
                return t
            if base not in self._params and key not in seen:
                seen.add(key)
                total[0] += t.numel() * t.element_size()
            return t

        def done():
            self._held[key] = total[0]
            self.live += total[0]
            self.peak = max(self.peak, self.live)

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), done

    def release(self, key) -> None:
        self.live -= self._held.pop(key, 0)

    def reset(self) -> None:
        self.live = self.peak = 0
        self._held.clear()


class MicroLoss:
    """torch's loss_fn(output, target): the target is the micro-batch index; the label is looked up here.

    ``loss_fns``: one loss function or, as Paddle's PipelineLayer takes, a list of them: each is computed and kept,
    only ``loss_fns[index]`` is backpropagated. Each micro loss is divided by the number of micro-batches before its
    backward, as Paddle does, so the gradients accumulated over the micro-batches are those of the mean loss; the
    values before the scaler's scaling are kept for the returned loss.
    """

    def __init__(self, loss_fns, n: int):
        self.loss_fns = list(loss_fns) if isinstance(loss_fns, (list, tuple)) else [loss_fns]
        self.n = n
        self.index = 0
        self.labels = None
        self.scaler = None
        # micro-batch -> each loss function's loss (torch may call once more to infer shapes on a first step)
        self.values: dict = {}

    def __call__(self, output, index):
        k = int(index.reshape(-1)[0])
        many = len(self.loss_fns) > 1
        kept, out = [], None
        for i, fn in enumerate(self.loss_fns):
            name = f"loss_fn[{i}]" if many else "loss_fn"
            loss = fn(output, self.labels[k])
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"the pipeline's {name} returned a {type(loss).__name__}: it must return one tensor "
                                f"(as Paddle's pipeline requires), the loss of micro-batch {k}")
            if loss.numel() != 1:
                raise ValueError(f"the pipeline's {name} returned a tensor of shape {list(loss.shape)} for "
                                 f"micro-batch {k}: it must return one value (reduce a per-sample loss, e.g. with "
                                 f".mean())")
            loss = loss / self.n
            kept.append(loss.detach().reshape(()))
            if i == self.index:
                out = loss
        self.values[k] = kept
        return self.scaler.scale(out) if self.scaler is not None else out
