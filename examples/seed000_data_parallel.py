"""Seed 000: DataParallel training, then the PyLayer case with no_sync + fused_allreduce_gradients.

Run with ``python examples/seed000_data_parallel.py`` (spawns 2 ranks) or
``python -m meshviz.launch --nproc_per_node 2 examples/seed000_data_parallel.py``.
"""

import os

import torch
from torch import nn

import meshviz.distributed as dist
from meshviz.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients


class LinearNet(nn.Module):
    def __init__(self):
        super().__init__()
        self._linear1 = nn.Linear(10, 10)
        self._linear2 = nn.Linear(10, 1)

    def forward(self, x):
        return self._linear2(self._linear1(x))


class cus_tanh(torch.autograd.Function):  # Paddle's PyLayer
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
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, inputs):
        return self.linear(cus_tanh.apply(inputs))


def train():
    # 1. initialize parallel environment
    dist.init_parallel_env()
    rank = dist.get_rank()
    torch.manual_seed(rank)  # different per rank on purpose: DataParallel broadcasts rank 0's parameters

    # 2. create data parallel layer & optimizer
    layer = LinearNet()
    dp_layer = dist.DataParallel(layer)
    loss_fn = nn.MSELoss()
    adam = torch.optim.Adam(dp_layer.parameters(), lr=0.001)

    # 3. run layer
    for step in range(3):
        inputs = torch.randn(10, 10)
        outputs = dp_layer(inputs)
        labels = torch.randn(10, 1).to(outputs.device)  # on a GPU rank the outputs are there
        loss = loss_fn(outputs, labels)
        loss.backward()
        adam.step()
        adam.zero_grad()
        print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)

    # the PyLayer case: no_sync, then average the gradients by hand before the optimizer
    model = dist.DataParallel(SimpleNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(10):
        x = torch.randn(2, 2, requires_grad=True)
        with model.no_sync():
            loss = model(x).mean()
            loss.backward()
        fused_allreduce_gradients(list(model.parameters()), None)
        opt.step()
        opt.zero_grad()
    w = model.state_dict()["linear.weight"]
    print(f"rank {rank} pylayer weight sum {w.sum().item():.6f}", flush=True)


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by meshviz.launch / torchrun
        train()
    else:
        dist.spawn(train, nprocs=2)
