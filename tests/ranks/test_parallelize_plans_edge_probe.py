"""dist.parallelize's plans at their edges: ConvParallel (Paddle 3.3) and convolutions on split inputs, trained
against one dense process."""

import pytest
import torch
from torch import nn

from meshviz.core.placements import Partial, Replicate, Shard
from meshviz.testing import run_ranks

LR = 0.1


class ConvNet(nn.Module):
    """Paddle's ConvParallel example, grown: a padded conv (ring-convolution supported: stride 1), a strided conv
    with disjoint windows (stride == kernel, no padding), a transposed one alike, a dilated conv (not supported: left
    alone), a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 2, stride=2)
        self.convt = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.conv3 = nn.Conv2d(4, 2, 3, padding=2, dilation=2)
        self.head = nn.Linear(2, 3)

    def forward(self, x):
        h = torch.relu(self.conv1(x))
        h = torch.tanh(self.conv3(self.convt(torch.relu(self.conv2(h)))))
        return self.head(h.mean(dim=(2, 3)))


def _data(step):
    g = torch.Generator().manual_seed(40 + step)
    return torch.randn(4, 3, 6, 8, generator=g), torch.randn(4, 3, generator=g)


def _train(model, opt, place, full):
    losses = []
    for step in range(3):
        x, y = _data(step)
        loss = ((model(place(x)) - place(y)) ** 2).mean()
        loss.backward()
        losses.append(full(loss))
        opt.step()
        opt.zero_grad()
    return losses, {n: full(p) for n, p in model.named_parameters()}


def conv_parallel_rank(axes, mesh_ids, level):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    dist.auto_parallel.set_mesh(None)
    mesh = dist.ProcessMesh(mesh_ids, dim_names=axes)
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    plan = {"conv.*": dist.ConvParallel()}
    config = {"mp_config": {"parallelize_plan": plan}}
    if level is not None:
        config["dp_config"] = {"sharding_level": level}
    model, opt = dist.parallelize(model, opt, mesh=mesh, config=config)
    seen = []  # what each conv's forward gets, after the plan's hook
    for name in ("conv1", "conv2", "convt", "conv3"):
        getattr(model, name).register_forward_pre_hook(
            lambda layer, inp, name=name: seen.append((name, [repr(p) for p in inp[0].placements])))

    def place(t):
        pl = [dist.Replicate()] * mesh.ndim
        if "dp" in axes:
            pl[axes.index("dp")] = dist.Shard(0)
        return dist.shard_tensor(t, mesh, pl)

    losses, params = _train(model, opt, place, lambda t: dist.unshard_dtensor(t).detach().clone())
    dist.auto_parallel.set_mesh(None)
    return losses, params, seen[:4]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("axes, mesh_ids, level", [(["mp"], [0, 1], None), (["dp", "mp"], [[0, 1], [2, 3]], 1)])
def test_conv_parallel_splits_the_width_of_supported_convs_and_trains_as_one_process(axes, mesh_ids, level):
    """Paddle 3.3's ConvParallel: each supported Conv2d sees its input split along the width (NCHW dim 3) over mp,
    a dilated one sees it as it came; losses and parameters after 3 steps equal the dense run."""
    model = ConvNet()
    ref_losses, ref_params = _train(model, torch.optim.SGD(model.parameters(), lr=LR), lambda t: t,
                                    lambda t: t.detach().clone())
    n = 4 if len(axes) == 2 else 2
    for losses, params, seen in run_ranks(conv_parallel_rank, n, axes, mesh_ids, level, timeout=50):
        dp = ["S(0)"] if len(axes) == 2 else []
        assert seen == [("conv1", dp + ["S(3)"]), ("conv2", dp + ["S(3)"]), ("convt", dp + ["S(3)"]),
                        ("conv3", dp + ["R"])]
        for got, want in zip(losses, ref_losses):
            torch.testing.assert_close(got, want)
        for name, want in ref_params.items():
            torch.testing.assert_close(params[name], want, msg=lambda m, name=name: f"{name}: {m}")


def conv_on_split_input_rank(placements, input_grad=True):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    ids = [0, 1] if len(placements) == 1 else [[0, 1], [2, 3]]
    mesh = dist.ProcessMesh(ids, dim_names=["x", "y"][:len(placements)])
    whole = [dist.Replicate()] * len(placements)
    torch.manual_seed(3)
    conv = nn.Conv2d(4, 2, 3, padding=1)
    conv.weight = dist.shard_tensor(conv.weight, mesh, whole)
    conv.bias = dist.shard_tensor(conv.bias, mesh, whole)
    x = torch.randn(2, 4, 4, 6, generator=torch.Generator().manual_seed(5))
    xd = dist.shard_tensor(x, mesh, placements).detach().requires_grad_(input_grad)
    out = conv(xd)
    (out * out).sum().backward()
    full = dist.unshard_dtensor
    return full(out).detach(), full(conv.weight.grad), full(conv.bias.grad), full(xd.grad) if input_grad else None


SPLITS = {"R": ([Replicate()], True), "S(0)": ([Shard(0)], True), "S(1)": ([Shard(1)], True),
          "S(2)": ([Shard(2)], True), "S(3)": ([Shard(3)], True), "P": ([Partial()], True),
          # a batch split on one axis of two, the input taking no gradient (torch 2.15's strategy asserts on HEAD)
          "S(0),R no input grad": ([Shard(0), Replicate()], False),
          "S(0),S(3)": ([Shard(0), Shard(3)], True)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("split", list(SPLITS))
def test_a_convolution_of_an_input_split_along_any_dim_gives_the_dense_values(split):
    """torch DTensor's convolution handler convolves each rank's block of a split channel / height / width dim as if
    it were whole (and calls the result whole): on HEAD a width split gave a [2, 2, 4, 6] output of 3-wide halves and
    a wrong weight gradient; torch 2.11 doubles the weight gradient of a whole input. Only the batch dim stays split;
    output, weight, bias and input gradients equal the dense run."""
    placements, input_grad = SPLITS[split]
    torch.manual_seed(3)
    conv = nn.Conv2d(4, 2, 3, padding=1)
    x = torch.randn(2, 4, 4, 6, generator=torch.Generator().manual_seed(5)).requires_grad_()
    out = conv(x)
    (out * out).sum().backward()
    n = 2 ** len(placements)
    for got_out, got_w, got_b, got_x in run_ranks(conv_on_split_input_rank, n, placements, input_grad, timeout=50):
        torch.testing.assert_close(got_out, out.detach())
        torch.testing.assert_close(got_w, conv.weight.grad)
        torch.testing.assert_close(got_b, conv.bias.grad)
        if input_grad:
            torch.testing.assert_close(got_x, x.grad)


def refused_rank():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    dist.auto_parallel.set_mesh(None)
    model = ConvNet()
    before = {n: p for n, p in model.named_parameters()}
    mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
    try:
        dist.parallelize(model, None, mesh=mesh, config={"mp_config": {"parallelize_plan": {
            "conv1": dist.ConvParallel(), "head": dist.ConvParallel()}}})
    except ValueError as e:
        err = str(e)
    else:
        err = None
    dist.auto_parallel.set_mesh(None)
    untouched = all(p is before[n] for n, p in model.named_parameters()) and not model.conv1._forward_pre_hooks
    return err, untouched


def test_conv_parallel_on_a_layer_that_is_no_convolution_is_refused_on_every_rank_before_anything_changes():
    for err, untouched in run_ranks(refused_rank, 2, timeout=30):
        assert err is not None and "ConvParallel on head" in err and "Linear" in err
        assert untouched


class WithSpare(nn.Module):
    """A layer the forward never uses (a spare head, a branch not taken), held by the root as the used ones are."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(13)
        self.used, self.spare, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.used(x)))


def _spare_train(model, opt, place, full):
    losses = []
    for step in range(2):
        g = torch.Generator().manual_seed(60 + step)
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
        loss = ((model(place(x)) - place(y)) ** 2).mean()
        loss.backward()
        losses.append(full(loss))
        spare_grad = model.spare.weight.grad
        opt.step()
        opt.zero_grad()
    return losses, {n: full(p) for n, p in model.named_parameters()}, spare_grad


def spare_rank(level):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    dist.auto_parallel.set_mesh(None)
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = WithSpare()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    model, opt = dist.parallelize(model, opt, mesh=mesh, config={"dp_config": {"sharding_level": level}})
    out = _spare_train(model, opt, lambda t: dist.shard_tensor(t, mesh, [dist.Shard(0)]),
                       lambda t: dist.unshard_dtensor(t).detach().clone())
    dist.auto_parallel.set_mesh(None)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", [1, 3])
def test_a_parameter_the_forward_never_uses_takes_no_gradient_at_every_sharding_level(level):
    """At sharding level 3 each layer group's parameters are gathered in one autograd op; on HEAD a parameter the
    forward never used got autograd's plain zeros as its gradient, and the step raised AttributeError ('Tensor' has
    no 'placements') on every rank. As in one process, it takes no gradient, and AdamW leaves it alone."""
    model = WithSpare()
    ref_losses, ref_params, ref_grad = _spare_train(
        model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5), lambda t: t,
        lambda t: t.detach().clone())
    assert ref_grad is None
    for losses, params, spare_grad in run_ranks(spare_rank, 2, level, timeout=50):
        assert spare_grad is None
        for got, want in zip(losses, ref_losses):
            torch.testing.assert_close(got, want)
        for name, want in ref_params.items():
            torch.testing.assert_close(params[name], want, msg=lambda m, name=name: f"{name}: {m}")
