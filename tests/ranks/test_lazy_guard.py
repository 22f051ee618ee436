"""LazyGuard: a model built without memory, then initialize()d, holds and trains as the eager build (seed 001 §7);
sharded by shard_layer or parallelize first, each rank gets its block of the eager values."""

import numpy as np
import pytest
import torch

from meshviz.testing import run_ranks

H, INNER = 16, 32


class MlpModel(torch.nn.Module):
    """The seed's MlpModel, smaller: two weights made as Paddle's create_parameter makes them (Xavier uniform)."""

    def __init__(self, hidden=H, inner=INNER):
        super().__init__()
        self.w0 = torch.nn.Parameter(torch.empty(hidden, inner))
        self.w1 = torch.nn.Parameter(torch.empty(inner, hidden))
        for w in (self.w0, self.w1):
            torch.nn.init.xavier_uniform_(w)

    def forward(self, x):
        return torch.matmul(torch.matmul(x, self.w0), self.w1)


class RandomDataset(torch.utils.data.Dataset):
    def __init__(self, seq_len, hidden, num_samples=12):
        self.seq_len, self.hidden, self.num_samples = seq_len, hidden, num_samples

    def __getitem__(self, index):
        x = np.random.uniform(size=[self.seq_len, self.hidden]).astype("float32")
        y = np.random.uniform(size=[self.seq_len, self.hidden]).astype("float32")
        return x, y

    def __len__(self):
        return self.num_samples


def _train(model, steps=3):
    """The seed's loop: BatchSampler of 4, AdamW, MSELoss; the data drawn from numpy's RNG as it iterates."""
    np.random.seed(0)
    dataset = RandomDataset(4, H)
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(dataset), batch_size=4,
                                            drop_last=False)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=0.001)
    loss_fn = torch.nn.MSELoss()
    losses = []
    for inputs, labels in loader:
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert len(losses) == steps
    return losses


def _eager(cls=MlpModel, seed=0):
    torch.manual_seed(seed)
    return cls()


def test_the_seeds_lazy_mlp_holds_and_trains_as_the_eager_one():
    from meshviz import LazyGuard

    with torch.random.fork_rng(devices=[]):
        eager = _eager()
        after_build = torch.get_rng_state()
        want = {n: p.detach().clone() for n, p in eager.named_parameters()}
        want_losses = _train(eager)

        torch.manual_seed(0)
        nothing_built = torch.get_rng_state()
        torch.manual_seed(0)
        with LazyGuard():
            model = MlpModel()
        assert torch.equal(torch.get_rng_state(), nothing_built)  # as Paddle: building drew nothing
        params = list(model.parameters())
        assert [p.device.type for p in params] == ["meta", "meta"]
        for p in model.parameters():
            p.initialize()
        # the same objects, the eager values, and the RNG where the eager build left it (as Paddle's in-order calls)
        assert all(a is b for a, b in zip(params, model.parameters()))
        assert all(type(p) is torch.nn.Parameter and p.requires_grad for p in params)
        assert {n: torch.equal(p, want[n]) for n, p in model.named_parameters()} == {"w0": True, "w1": True}
        assert torch.equal(torch.get_rng_state(), after_build)
        assert _train(model) == want_losses


def test_initialize_in_any_order_gives_the_eager_values_and_fills_buffers():
    from meshviz import LazyGuard

    class Net(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.mlp = MlpModel(width, 2 * width)
            self.fc = torch.nn.Linear(width, width)
            self.norm = torch.nn.BatchNorm1d(width)
            self.register_buffer("noise", torch.randn(width))
            self.head = torch.nn.Linear(width, width, bias=False)
            self.head.weight = self.fc.weight  # tied

        def forward(self, x):
            return self.head(self.norm(self.fc(self.mlp(x))) + self.noise)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        e1, e2 = Net(4), MlpModel()
        torch.manual_seed(5)
        e3 = Net(6)
        torch.manual_seed(0)
        with LazyGuard():
            m1, m2 = Net(4), MlpModel()  # the second starts where the first one's eager build leaves the RNG
            torch.manual_seed(5)
            m3 = Net(width=6)
        for m in (m3, m2, m1):
            for p in reversed(list(m.parameters())):
                p.initialize()
        for lazy, eager in ((m1, e1), (m2, e2), (m3, e3)):
            got = dict(lazy.state_dict())
            want = dict(eager.state_dict())
            assert list(got) == list(want)
            assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want), lazy
            assert lazy is m2 or lazy.head.weight is lazy.fc.weight
        x = torch.randn(3, 6)
        assert torch.equal(m3(x), e3(x))


def test_the_values_are_the_builds_and_a_seed_set_after_the_guard_stays():
    """Unlike Paddle, where initialize() draws from the RNG as it is then: the values are those of the build's seed,
    and the RNG, no longer where the guard left it, is not moved."""
    from meshviz import LazyGuard

    with torch.random.fork_rng(devices=[]):
        want = _eager().state_dict()
        torch.manual_seed(0)
        with LazyGuard():
            model = MlpModel()
        torch.manual_seed(7)
        seeded = torch.get_rng_state()
        for p in model.parameters():
            p.initialize()
        assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
        assert torch.equal(torch.get_rng_state(), seeded)


def test_a_lazy_parameter_used_before_initialize_says_so():
    from meshviz import LazyGuard

    with LazyGuard():
        model = MlpModel()
    with pytest.raises(RuntimeError, match=r"parameter 'w0' of MlpModel is not initialized: the model was built "
                                           r"under LazyGuard .* p\.initialize\(\)"):
        model(torch.ones(2, H))
    model.w0.initialize()
    with pytest.raises(RuntimeError, match=r"parameter 'w1' of MlpModel is not initialized"):
        model(torch.ones(2, H))
    model.w1.initialize()
    assert model(torch.ones(2, H)).shape == (2, H)
    with pytest.raises(RuntimeError, match=r"initialized already \(initialize\(\) runs once per tensor"):
        model.w0.initialize()
    assert not hasattr(torch.nn.Linear(2, 2).weight, "initialize")  # built outside a guard: nothing to do


def _dense_step(w0, w1, x):
    """One SGD step of the MLP in one process: the loss and the weights after."""
    w0, w1 = (torch.nn.Parameter(w.clone()) for w in (w0, w1))
    loss = torch.matmul(torch.matmul(x, w0), w1).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for w in (w0, w1):
            w -= 0.1 * w.grad
    return loss.item(), w0.detach(), w1.detach()


def _x():
    return torch.arange(2 * H, dtype=torch.float32).reshape(2, H) / (2 * H)


def lazy_shard_layer():
    """The seed's MLP built lazily, shard_layer splitting w0's columns (w1 left Replicate), then initialize()."""
    import meshviz.distributed as dist
    from meshviz import LazyGuard

    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    torch.manual_seed(0)
    with LazyGuard():
        model = MlpModel()

    def shard_fn(name, layer, mesh):
        if name == "":
            layer.w0 = dist.shard_tensor(layer.w0, mesh, [dist.Shard(1)])

    model = dist.shard_layer(model, mesh, shard_fn)
    x = dist.shard_tensor(_x(), mesh, [dist.Replicate()])
    try:
        model(x)
        unready = None
    except RuntimeError as e:
        unready = str(e)
    params = list(model.parameters())
    for p in params:
        p.initialize()
    kept = all(a is b for a, b in zip(params, model.parameters()))
    blocks = [dist.dtensor_to_local(p).detach().clone() for p in params]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    after = [dist.dtensor_to_local(p).detach().clone() for p in params]
    return unready, kept, [repr(p.placements) for p in params], blocks, dist.unshard_dtensor(loss).item(), after


def test_shard_layer_of_a_lazy_model_gives_each_rank_its_block_of_the_eager_values():
    eager = _eager()
    w0, w1 = eager.w0.detach(), eager.w1.detach()
    loss, w0_after, w1_after = _dense_step(w0, w1, _x())
    for r, (unready, kept, pl, blocks, got_loss, after) in enumerate(run_ranks(lazy_shard_layer, 2)):
        assert "parameter 'w0' of MlpModel is not initialized" in unready
        assert kept and pl == ["[S(1)]", "[R]"]
        assert torch.equal(blocks[0], w0.chunk(2, 1)[r]) and torch.equal(blocks[1], w1)
        assert got_loss == pytest.approx(loss, rel=1e-6)
        torch.testing.assert_close(after[0], w0_after.chunk(2, 1)[r])
        torch.testing.assert_close(after[1], w1_after)


def lazy_shard_tensor():
    """shard_tensor of a lazy parameter kept apart from its module: initialize() gives it its block too."""
    import meshviz.distributed as dist
    from meshviz import LazyGuard

    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    torch.manual_seed(0)
    with LazyGuard():
        model = MlpModel()
    w = dist.shard_tensor(model.w0, mesh, [dist.Shard(0)])
    w.initialize()
    return dist.dtensor_to_local(w).detach().clone()


def test_shard_tensor_of_a_lazy_parameter_gets_its_block_of_the_eager_value():
    w0 = _eager().w0.detach()
    for r, block in enumerate(run_ranks(lazy_shard_tensor, 2)):
        assert torch.equal(block, w0.chunk(2, 0)[r])


def lazy_stage1():
    """shard_optimizer with ShardingStage1 made before initialize() (its shadow of each parameter moves off the meta
    device at the first step): two AdamW steps as on the eager model."""
    import meshviz.distributed as dist
    from meshviz import LazyGuard

    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    torch.manual_seed(0)
    with LazyGuard():
        model = MlpModel()
    for name in ("w0", "w1"):
        setattr(model, name, dist.shard_tensor(getattr(model, name), mesh, [dist.Replicate()]))
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), dist.ShardingStage1("dp", mesh))
    seen = []
    model.w0.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))
    for p in model.parameters():
        p.initialize()
    x = dist.shard_tensor(_x(), mesh, [dist.Replicate()])
    for _ in range(2):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.clear_grad()
    return [dist.unshard_dtensor(p).detach().clone() for p in model.parameters()], seen


def test_a_stage_1_optimizer_made_before_initialize_steps_the_eager_values():
    eager = _eager()
    opt = torch.optim.AdamW(eager.parameters(), lr=0.01)
    for _ in range(2):
        eager(_x()).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for got, seen in run_ranks(lazy_stage1, 2):
        assert seen == [True, True]  # a hook registered before initialize() stays
        for g, want in zip(got, eager.parameters()):
            torch.testing.assert_close(g, want.detach())


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(H, INNER)
        self.fc2 = torch.nn.Linear(INNER, H)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def made_lazily(make, lazy: bool):
    """``make()`` under a LazyGuard (``lazy``: its parameters wait for ``initialize()``), or eagerly."""
    from meshviz import LazyGuard

    if not lazy:
        return make()
    with LazyGuard():
        return make()


def lazy_parallelize(lazy):
    """TwoLinears on mp 2, fc1 ColWise and fc2 RowWise, the optimizer passed to parallelize; built lazily and
    initialize()d after parallelize, or built eagerly."""
    import meshviz.distributed as dist

    mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
    dist.auto_parallel.set_mesh(mesh)
    torch.manual_seed(0)
    model = made_lazily(TwoLinears, lazy)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    plan = {"fc1": dist.ColWiseParallel(), "fc2": dist.RowWiseParallel()}
    model, opt = dist.parallelize(model, opt, config={"mp_config": {"parallelize_plan": plan}})
    if lazy:
        for p in model.parameters():
            p.initialize()
    names = [n for n, _ in model.named_parameters()]
    blocks = [dist.dtensor_to_local(p).detach().clone() for p in model.parameters()]
    placements = [repr(p.placements) for p in model.parameters()]
    x = dist.shard_tensor(_x(), mesh, [dist.Replicate()])
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    after = [dist.dtensor_to_local(p).detach().clone() for p in model.parameters()]
    return names, placements, blocks, dist.unshard_dtensor(loss).item(), after


def test_parallelize_of_a_lazy_model_gives_each_rank_its_block_of_the_eager_values():
    torch.manual_seed(0)
    dense = TwoLinears()
    want = dict(dense.named_parameters())
    opt = torch.optim.AdamW(dense.parameters(), lr=0.01)
    full = {n: p.detach().clone() for n, p in want.items()}
    dense_loss = dense(_x()).pow(2).mean()
    dense_loss.backward()
    opt.step()
    split = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}  # torch's [out, in]: ColWise splits out, RowWise in
    lazy, eager = run_ranks(lazy_parallelize, 2, True), run_ranks(lazy_parallelize, 2, False)
    for r in range(2):
        names, pl, blocks, loss, after = lazy[r]
        assert names == list(want) and pl == eager[r][1] == ["[S(0)]", "[S(0)]", "[S(1)]", "[R]"]
        for name, block, eager_block, new in zip(names, blocks, eager[r][2], after):
            cut = (lambda t: t.chunk(2, split[name])[r]) if name in split else (lambda t: t)
            assert torch.equal(block, cut(full[name])) and torch.equal(block, eager_block), name
            torch.testing.assert_close(new, cut(want[name].detach()))
        assert loss == eager[r][3] == pytest.approx(dense_loss.item(), rel=1e-6)


def lazy_llama_pp(lazy):
    """The tiny Llama on pp 2 x mp 2 (Paddle's plan), built lazily and initialize()d after parallelize, or built
    eagerly: every rank's blocks (empty off its stage) and the logits."""
    import meshviz.distributed as dist
    from tests.models import LlamaForCausalLM
    from tests.ranks.test_parallelize import _plan

    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "mp"])
    dist.auto_parallel.set_mesh(mesh)
    torch.manual_seed(0)
    model = made_lazily(lambda: LlamaForCausalLM(num_layers=2), lazy)
    config = {"mp_config": {"parallelize_plan": _plan(False)}, "pp_config": {"split_spec": "llama.layers"}}
    model, _ = dist.parallelize(model, None, config=config)
    if lazy:
        for p in model.parameters():
            p.initialize()
    blocks = {n: dist.dtensor_to_local(p).detach().clone() for n, p in model.named_parameters()}
    ids = dist.shard_tensor(torch.arange(16).reshape(4, 4) % 16, mesh.get_mesh_with_dim("pp", 0), [dist.Replicate()])
    return blocks, dist.unshard_dtensor(model(ids)).detach()


def test_a_lazy_llama_on_pp_x_mp_holds_the_eager_blocks_on_every_stage():
    lazy, eager = run_ranks(lazy_llama_pp, 4, True), run_ranks(lazy_llama_pp, 4, False)
    for (got, got_logits), (want, want_logits) in zip(lazy, eager):
        assert list(got) == list(want) and any(b.numel() == 0 for b in got.values())  # off-stage blocks are empty
        assert all(torch.equal(got[n], want[n]) for n in want)
        assert torch.equal(got_logits, want_logits)
