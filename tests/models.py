"""Small models the seeds use, shared by the tests (the examples keep their own copies, to stand alone)."""

import torch
from torch import nn


class LinearNet(nn.Module):
    """Seeds 000 and 004: two Linear layers, 10 -> 10 -> 1."""

    def __init__(self):
        super().__init__()
        self._linear1 = nn.Linear(10, 10)
        self._linear2 = nn.Linear(10, 1)

    def forward(self, x):
        return self._linear2(self._linear1(x))


class CusTanh(torch.autograd.Function):
    """Seed 000's PyLayer, as a torch autograd Function."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return dy * (1 - torch.square(y))


class SimpleNet(nn.Module):
    """Seed 000's PyLayer example network."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, inputs):
        return self.linear(CusTanh.apply(inputs))
