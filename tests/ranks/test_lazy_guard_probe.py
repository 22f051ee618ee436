"""LazyGuard against the eager build: parameters made from given values, buffers, tied weights, containers, dtype
casts and optimizers made before initialize(), on one rank and sharded on two."""

import pytest
import torch

from meshviz.testing import run_ranks
from tests.ranks.test_lazy_guard import made_lazily


class FromValues(torch.nn.Module):
    """A parameter and a buffer made from a tensor the constructor is given, beside a Linear drawn from the RNG."""

    def __init__(self, n, w, scale=2.0):
        super().__init__()
        self.fc = torch.nn.Linear(n, n)
        self.w = torch.nn.Parameter(w.clone() * scale)
        self.register_buffer("total", w.sum(0))


def _state(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _same(got, want):
    return list(got) == list(want) and all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype
                                           for k in want)


def test_a_parameter_made_from_given_values_initializes_too():
    from meshviz import LazyGuard

    w = torch.arange(9, dtype=torch.float32).reshape(3, 3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        want = _state(FromValues(3, w, scale=3.0))
        torch.manual_seed(2)
        with LazyGuard():
            model = FromValues(3, w, scale=3.0)
        assert model.fc.weight.device.type == "meta" and model.w.device.type == "cpu"
        for p in model.parameters():
            p.initialize()  # each parameter built in the guard has initialize(), as in Paddle
        assert _same(_state(model), want)


class Tied(torch.nn.Module):
    def __init__(self, vocab=10, d=4):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.norm = torch.nn.BatchNorm1d(d)
        self.out = torch.nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(self.norm(self.emb(ids)))


def _two_adamw_steps(model, opt, ids):
    for _ in range(2):
        model(ids).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_containers_casts_and_an_adamw_made_before_initialize_match_the_eager_build():
    from meshviz import LazyGuard

    def build():
        head = torch.nn.Sequential(torch.nn.Linear(10, 6), torch.nn.ReLU(), torch.nn.BatchNorm1d(6))
        return torch.nn.Sequential(Tied(), head)

    ids = torch.arange(8) % 10
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        eager = build()
        built = _state(eager)
        _two_adamw_steps(eager, torch.optim.AdamW(eager.parameters(), lr=0.01), ids)
        torch.manual_seed(3)
        with LazyGuard():
            model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        for p in reversed(list(model.parameters())):
            p.initialize()
        assert model[0].out.weight is model[0].emb.weight
        assert _same(_state(model), built)
        _two_adamw_steps(model, opt, ids)
        assert _same(_state(model), _state(eager))

        torch.manual_seed(3)
        half = build().to(torch.float16)
        torch.manual_seed(3)
        with LazyGuard():
            model = build()
        model = model.to(torch.float16)
        for p in model.parameters():
            p.initialize()
        assert _same(_state(model), _state(half))


def sharded_tied(lazy):
    """Tied on 2 ranks, the embedding split by rows by shard_layer (buffers replicated), AdamW made before
    initialize(): every rank's blocks after two steps."""
    import meshviz.distributed as dist

    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    torch.manual_seed(0)
    model = made_lazily(Tied, lazy)

    def shard_fn(name, layer, mesh):
        if name == "emb":
            layer.weight = dist.shard_tensor(layer.weight, mesh, [dist.Shard(0)])

    model = dist.shard_layer(model, mesh, shard_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if lazy:
        for p in model.parameters():
            p.initialize()
    ids = dist.shard_tensor(torch.arange(8) % 10, mesh, [dist.Replicate()])
    _two_adamw_steps(model, opt, ids)
    return {k: dist.dtensor_to_local(v).detach().clone() for k, v in model.state_dict().items()}


def test_a_lazy_model_sharded_with_buffers_steps_as_the_eager_one():
    for got, want in zip(run_ranks(sharded_tied, 2, True), run_ranks(sharded_tied, 2, False)):
        assert _same(got, want)


def test_a_parameter_made_from_a_tensor_created_in_the_guard_says_it_has_no_values():
    from meshviz import LazyGuard

    with LazyGuard():
        w = torch.ones(3, 3)  # on the meta device, as everything created in the guard
        model = FromValues(3, w)
    model.fc.weight.initialize()
    with pytest.raises(RuntimeError, match=r"initialize\(\): FromValues built again gives no values for 'w': it is "
                                           r"made from a tensor created inside the LazyGuard \(on the meta device\)"):
        model.w.initialize()


def test_models_of_two_guards_follow_each_other_unless_seeded_between_even_to_the_same_seed():
    """As the eager builds: a second guard's model starts where the first one's leaves the RNG (Paddle's in-order
    initialize() gives the same); a seed set between, even the same seed again, starts it from that seed."""
    from meshviz import LazyGuard

    def lin():
        return torch.nn.Linear(3, 3)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        want = [_state(lin()), _state(lin())]
        after = torch.get_rng_state()
        for order in ((0, 1), (1, 0)):
            torch.manual_seed(4)
            with LazyGuard():
                models = [lin()]
            with LazyGuard():
                models.append(lin())
            for i in order:
                for p in models[i].parameters():
                    p.initialize()
            assert [_same(_state(m), w) for m, w in zip(models, want)] == [True, True], order
            assert torch.equal(torch.get_rng_state(), after), order

        torch.manual_seed(4)
        want = _state(lin())
        torch.manual_seed(4)
        with LazyGuard():
            first = lin()
            torch.manual_seed(4)
            second = lin()
        torch.manual_seed(4)
        with LazyGuard():
            third = lin()  # a cell run again
        models = (first, second, third)
        for m in reversed(models):
            for p in m.parameters():
                p.initialize()
        assert [_same(_state(m), want) for m in models] == [True] * 3
