"""dtensor_to_local's mesh/placements and LocalLayer's grad_dist_attrs lay out the gradient: against one process."""

import pytest
import torch

from meshviz.testing import run_ranks

COEFF = torch.tensor([1.0, 10.0, 100.0, 1000.0])


def _dense_rank_scaled_grad(x, nranks, coeff):
    """The dense gradient of ``(cat([x * (r + 1) for each rank r]) * coeff).sum()`` with respect to ``x``."""
    x = x.clone().requires_grad_()
    (torch.cat([x * (r + 1) for r in range(nranks)]) * coeff).sum().backward()
    return x.grad


def _block_fed_per_rank(how):
    """Paddle's case: each rank's block of a Replicate x feeds its own computation (Partial gradient)."""
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    x = dist.shard_tensor(torch.tensor([1.0, 2.0]), mesh, [dist.Replicate()]).requires_grad_()
    coeff = dist.shard_tensor(COEFF, mesh, [dist.Replicate()])
    if how == "to_local":
        loc = dist.dtensor_to_local(x, mesh, [dist.Partial()])
        out = dist.dtensor_from_local(loc * (r + 1), mesh, [dist.Shard(0)])
    else:
        class Scale(dist.LocalLayer):
            def forward(self, t):
                return t * (dist.get_rank() + 1)

        out = Scale([(mesh, [dist.Shard(0)])], [(mesh, [dist.Partial()])])(x)
    (out * coeff).sum().backward()
    full = dist.reshard(x.grad, mesh, [dist.Replicate()])._local_value()
    return x.grad.placements, x.grad._local_value().clone(), full.clone()


@pytest.mark.parametrize("how", ["to_local", "local_layer"])
def test_partial_gradient_placements_give_the_dense_gradient(how):
    from meshviz.core.placements import Partial

    want = _dense_rank_scaled_grad(torch.tensor([1.0, 2.0]), 2, COEFF)
    assert want.tolist() == [201.0, 2010.0]
    res = run_ranks(_block_fed_per_rank, 2, how)
    for r, (pl, local, full) in enumerate(res):
        assert pl == [Partial()]
        torch.testing.assert_close(local, COEFF[2 * r:2 * r + 2] * (r + 1))  # Paddle's blocks: [1, 10], [200, 2000]
        torch.testing.assert_close(full, want)


def _two_d(_):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["a", "b"])
    x = dist.shard_tensor(torch.arange(8.0).reshape(4, 2), mesh, [dist.Shard(0)]).requires_grad_()  # [S(0), R]
    coeff = dist.shard_tensor(torch.arange(16.0).reshape(4, 4) ** 2, mesh, [dist.Replicate()])
    loc = dist.dtensor_to_local(x, mesh, [dist.Shard(0), dist.Partial()])
    out = dist.dtensor_from_local(loc * (r + 1), mesh, [dist.Shard(0), dist.Shard(1)])
    (out * coeff).sum().backward()
    full = dist.reshard(x.grad, mesh, [dist.Replicate(), dist.Replicate()])._local_value()
    return x.grad.placements, full.clone()


def test_two_d_mesh_shard_and_partial_gradient():
    from meshviz.core.placements import Partial, Shard

    x = torch.arange(8.0).reshape(4, 2).requires_grad_()
    # rank (i, j) holds rows 2i..2i+1 of x, and out's block (i, j) of [4, 4] is that times rank + 1
    out = torch.cat([torch.cat([x[2 * i:2 * i + 2] * (2 * i + j + 1) for j in range(2)], 1) for i in range(2)])
    (out * torch.arange(16.0).reshape(4, 4) ** 2).sum().backward()
    for pl, full in run_ranks(_two_d, 4, None):
        assert pl == [Shard(0), Partial()]
        torch.testing.assert_close(full, x.grad)


def _default_and_mixed(_):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    out = {}
    for name, args in (("none", ()), ("nones", (None, None)), ("same", (mesh, [dist.Shard(0)])),
                       ("other_names", (dist.ProcessMesh([0, 1], dim_names=["y"]), [dist.Shard(0)]))):
        x = dist.shard_tensor(torch.arange(4.0), mesh, [dist.Shard(0)]).requires_grad_()
        (dist.dtensor_to_local(x, *args) * (r + 1)).sum().backward()
        out[name] = (x.grad.placements, x.grad._local_value().clone())
    # x used twice: once through its block with a Partial gradient, once as itself (a Replicate gradient)
    x = dist.shard_tensor(torch.tensor([1.0, 2.0]), mesh, [dist.Replicate()]).requires_grad_()
    loc = dist.dtensor_to_local(x, mesh, [dist.Partial()])
    y = dist.dtensor_from_local(loc * (r + 1), mesh, [dist.Shard(0)])
    coeff = dist.shard_tensor(COEFF, mesh, [dist.Replicate()])
    ((y * coeff).sum() + (x * x).sum()).backward()
    out["mixed"] = dist.reshard(x.grad, mesh, [dist.Replicate()])._local_value().clone()
    return out


def test_no_placements_keep_the_inputs_layout_and_gradients_accumulate():
    from meshviz.core.placements import Shard

    want = _dense_rank_scaled_grad(torch.tensor([1.0, 2.0]), 2, COEFF) + 2 * torch.tensor([1.0, 2.0])
    for r, out in enumerate(run_ranks(_default_and_mixed, 2, None)):
        for name in ("none", "nones", "same", "other_names"):  # Paddle's LocalLayer passes the input's own
            assert out[name][0] == [Shard(0)], name
            torch.testing.assert_close(out[name][1], torch.full((2,), r + 1.0))
        torch.testing.assert_close(out["mixed"], want)


def _refusals(_):
    import meshviz.distributed as dist
    from meshviz import trace

    dist.init_parallel_env()
    sink = trace.MemorySink()
    trace.add_sink(sink)
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    x = dist.dtensor_from_local(torch.arange(4.0), mesh, [dist.Shard(0)]).requires_grad_()
    errs = []
    for args in ((dist.ProcessMesh([1, 0], dim_names=["x"]), [dist.Shard(0)]),  # another mesh
                 (dist.ProcessMesh([0], dim_names=["x"]), [dist.Replicate()]),
                 (mesh, [dist.Partial()]),  # blocks of 8 where x's are 4
                 (mesh, [dist.Replicate()]),
                 ("mesh", [dist.Shard(0)]),
                 (mesh, [dist.Shard(0), dist.Shard(0)])):
        try:
            dist.dtensor_to_local(x, *args)
            errs.append(None)
        except ValueError as e:
            errs.append(str(e))
    sent = [e.kind for e in sink.events if e.kind != "placed"]
    # no gradient can flow: the gradient's layout is not used (Paddle's own LocalLayer example passes these)
    with torch.no_grad():
        nograd = dist.dtensor_to_local(x, mesh, [dist.Partial()]).clone()
    plain = dist.dtensor_to_local(x.detach(), mesh, [dist.Partial()]).clone()
    trace.remove_sink(sink)
    return errs, sent, nograd, plain


def test_bad_gradient_layouts_raise_on_every_rank_before_communicating():
    res = run_ranks(_refusals, 2, None)
    for errs, sent, nograd, plain in res:
        assert errs == res[0][0]  # the same on every rank
        assert "the gradient's mesh" in errs[0] and "is not the tensor's" in errs[0]
        assert "the gradient's mesh" in errs[1]
        assert errs[2] == ("dtensor_to_local: the gradient's placements [P(sum)] give rank 0 a block of shape [8] of "
                           "the global shape [8], but its block of the tensor ([S(0)]) has shape [4]: a rank's "
                           "gradient is its block's")
        assert "placements [R] give rank 0 a block of shape [8]" in errs[3]
        assert "mesh must be a ProcessMesh" in errs[4]
        assert "at most one per mesh axis" in errs[5]
        assert sent == []
        torch.testing.assert_close(nograd, torch.arange(4.0))  # its own block, as plain as x's
        torch.testing.assert_close(plain, torch.arange(4.0))


def _local_layers(_):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    attrs = [(mesh, [dist.Partial()])]

    class SumSq(dist.LocalLayer):
        def forward(self, t, scale=1.0):
            return (t * t).sum() * scale

    def x_():
        return dist.dtensor_from_local(torch.arange(4.0) + 10 * r, mesh, [dist.Shard(0)])

    out = {}
    # Paddle's docstring form: the same attrs for outputs and gradients; nothing asks for a gradient
    y = SumSq(attrs, attrs)(x_())
    out["doc"] = (y.placements, y._local_value().item())
    for name, layer in (("one_arg", SumSq(attrs)), ("none", SumSq(attrs, [None])),
                        ("given", SumSq(attrs, [(mesh, [dist.Shard(0)])]))):
        x = x_().requires_grad_()
        layer(x, scale=3.0).backward()  # keyword inputs are not counted, as in Paddle
        out[name] = (x.grad.placements, x.grad._local_value().clone())
    errs = []
    for make in (lambda: SumSq(attrs, [None, None])(x_()), lambda: SumSq(attrs, [mesh])(x_()),
                 lambda: SumSq(attrs, attrs)(x_().requires_grad_())):
        try:
            make()
        except ValueError as e:
            errs.append(str(e))
    out["errs"] = errs
    return out


def test_local_layer_takes_paddles_grad_dist_attrs():
    from meshviz.core.placements import Partial, Shard

    for r, out in enumerate(run_ranks(_local_layers, 2, None)):
        assert out["doc"] == ([Partial()], float(((torch.arange(4.0) + 10 * r) ** 2).sum()))
        for name in ("one_arg", "none", "given"):
            # d(3 * sum of every rank's x^2)/dx: 6x, each rank its block
            assert out[name][0] == [Shard(0)], name
            torch.testing.assert_close(out[name][1], 6 * (torch.arange(4.0) + 10 * r))
        errs = out["errs"]
        assert errs[0] == "The number of inputs (1) does not match the number of grad_dist_attrs (2)."
        assert "grad_dist_attrs[0] must be None or a (mesh, placements) pair" in errs[1]
        assert "placements [P(sum)] give rank 0 a block of shape [8]" in errs[2]
