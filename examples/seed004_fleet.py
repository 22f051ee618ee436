"""Seed 004: the fleet data-parallel quick start (fleet.init, distributed_optimizer, distributed_model).

Run with ``python examples/seed004_fleet.py`` (spawns 2 ranks) or
``python -m meshviz.launch --nproc_per_node 2 examples/seed004_fleet.py`` (``fleetrun --gpus=0,1 ...`` too).
"""

import os

import torch
from torch import nn

import meshviz.distributed as dist
from meshviz.distributed import fleet


class LinearNet(nn.Module):
    def __init__(self):
        super().__init__()
        self._linear1 = nn.Linear(10, 10)
        self._linear2 = nn.Linear(10, 1)

    def forward(self, x):
        return self._linear2(self._linear1(x))


def main(steps=20):
    # distributed step 2: initialise fleet
    fleet.init(is_collective=True)

    torch.manual_seed(2020)
    layer = LinearNet()
    loss_fn = nn.MSELoss()
    adam = torch.optim.Adam(layer.parameters(), lr=0.001)

    # distributed step 3: distributed optimizer and model
    strategy = fleet.DistributedStrategy()
    adam = fleet.distributed_optimizer(adam, strategy=strategy)
    dp_layer = fleet.distributed_model(layer)

    data = torch.Generator().manual_seed(fleet.worker_index())  # each worker its own batches
    for step in range(steps):
        inputs = torch.randn(10, 10, generator=data)
        outputs = dp_layer(inputs)
        labels = torch.randn(10, 1, generator=data).to(outputs.device)  # on a GPU rank the outputs are there
        loss = loss_fn(outputs, labels)
        print(f"step:{step}\tloss:[{loss.item():.7f}]", flush=True)
        loss.backward()
        adam.step()
        adam.clear_grad()


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:
        dist.spawn(main, nprocs=2)
