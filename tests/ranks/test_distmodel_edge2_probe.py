"""DistModel's state against one dense process: unknown optimizer states refused, float16's loss scale resumed."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from meshviz.distributed.auto_parallel import Strategy, to_static
from meshviz.testing import run_ranks
from tests.ranks.test_to_static import Net, data

WORLD = 2


def _full(v):
    return (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()


# -- set_state_dict: a state the optimizer does not hold raises (Paddle: NotFound), nothing written ----------------
def _unknown_state(how):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    net = Net()
    strategy = {"sharding": {"enable": True, "stage": 2, "degree": WORLD}} if how == "sharding" else {}
    dm = to_static(net, None, nn.MSELoss(), torch.optim.Adam(net.parameters(), lr=0.1), Strategy(strategy))
    dm(*data(0, dist.get_rank()))
    before = {k: _full(v) for k, v in dm.state_dict().items()}
    bad = {"linear_0.weight": torch.ones(16, 16), "linear_0.weight.exp_avg": torch.ones(16, 16),
           "linear_0.weight.exp_avg_sqq": torch.ones(16, 16)}
    with pytest.raises(ValueError, match="unknown key 'linear_0.weight.exp_avg_sqq'.*exp_avg_sq") as e:
        dm.set_state_dict(bad)
    after = dm.state_dict()
    dist.barrier()  # no rank left inside a collective
    return str(e.value), sorted(after), all(torch.equal(_full(after[k]), v) for k, v in before.items())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["data_parallel", "sharding"])
def test_set_state_dict_of_a_state_the_optimizer_does_not_hold_raises_on_every_rank_before_writing(how):
    got = run_ranks(_unknown_state, WORLD, how, timeout=50)
    for message, keys, unchanged in got:
        assert message == got[0][0] and unchanged
        assert "linear_0.weight.exp_avg_sqq" not in keys


# -- float16's loss scale and its counters are in state_dict under Paddle's names, and resume ----------------------
AMP = {"enable": True, "dtype": "float16", "level": "O1", "init_loss_scaling": 2.0**40, "decr_ratio": 2.0**-15,
       "decr_every_n_nan_or_inf": 2, "incr_ratio": 2.0, "incr_every_n_steps": 2}
# the scale after each step: overflows at 2**40 and 2**25 (two in a row per back-off), then clean steps grow it
SCALES = [2.0**40, 2.0**25, 2.0**25, 2.0**10, 2.0**10, 2.0**11]


def _batch(step, rank, how):
    if how != "dist":  # each rank its own rows
        return data(step, rank)
    parts = [data(step, r) for r in range(WORLD)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _make(how):
    import meshviz.distributed as dist

    net = Net()
    if how == "dist":
        mesh = dist.ProcessMesh(list(range(WORLD)), dim_names=["x"])
        net.linear_0.weight = dist.shard_tensor(net.linear_0.weight, mesh, [dist.Shard(0)])
    strategy = {"amp": AMP}
    if how == "sharding":
        strategy["sharding"] = {"enable": True, "stage": 2, "degree": WORLD}
    return net, to_static(net, None, nn.MSELoss(), torch.optim.AdamW(net.parameters(), lr=0.01), Strategy(strategy))


def _resume(how, split, path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    rank = dist.get_rank()
    batch = _batch
    _, whole = _make(how)
    want = [(float(whole(*batch(s, rank, how))), whole._scaler.get_scale()) for s in range(len(SCALES))]
    _, first = _make(how)
    for s in range(split):
        first(*batch(s, rank, how))
    sd = first.state_dict()
    kinds = {k: (sd[k].dtype, list(sd[k].shape)) for k in ("loss_scaling_0", "num_good_steps_0", "num_bad_steps_0")}
    counts = (float(sd["loss_scaling_0"]), int(sd["num_good_steps_0"]), int(sd["num_bad_steps_0"]))
    if path is None:
        net, resumed = _make(how)
        resumed.set_state_dict(sd)
    else:  # Paddle's checkpoint: save, then load into a fresh model's state_dict() in place
        dist.save_state_dict(sd, path)
        net, resumed = _make(how)
        fresh = resumed.state_dict()
        dist.load_state_dict(fresh, path)
        if how == "sharding":  # its optimizer's states come back as copies: Paddle's set_state_dict after the load
            resumed.set_state_dict(fresh)
    got = [(float(resumed(*batch(s, rank, how))), resumed._scaler.get_scale()) for s in range(split, len(SCALES))]
    return want, got, kinds, counts, {k: _full(v) for k, v in net.state_dict().items()}, \
        {k: _full(v) for k, v in whole._layer.state_dict().items()}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how, split, saved", [
    ("data_parallel", 3, False),  # one overflow counted: the next one backs off
    ("data_parallel", 5, True),  # one clean step counted: the next one grows the scale
    ("sharding", 3, True),
    ("dist", 1, False),
])
def test_float16_loss_scale_and_counters_resume_as_the_uninterrupted_run(how, split, saved, tmp_path):
    path = str(tmp_path / "ckpt") if saved else None
    for want, got, kinds, counts, params, whole in run_ranks(_resume, WORLD, how, split, path, timeout=80):
        assert [s for _, s in want] == SCALES  # the overflows happen where the case says
        assert kinds == {"loss_scaling_0": (torch.float32, [1]), "num_good_steps_0": (torch.int32, [1]),
                         "num_bad_steps_0": (torch.int32, [1])}
        assert counts == {3: (2.0**25, 0, 1), 5: (2.0**10, 1, 0), 1: (2.0**40, 0, 1)}[split]
        assert got == want[split:]
        for k, v in whole.items():
            torch.testing.assert_close(params[k], v, rtol=0, atol=0)


def test_the_loss_scale_is_an_optimizer_state_only_under_float16_dynamic_scaling():
    net = Net()
    dm = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1), Strategy({"amp": AMP}))
    assert set(dm.state_dict("opt")) == {"loss_scaling_0", "num_good_steps_0", "num_bad_steps_0", "learning_rate_0"}
    assert not set(dm.state_dict("param")) & {"loss_scaling_0", "num_good_steps_0", "num_bad_steps_0"}
    bf16 = to_static(net, None, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1),
                     Strategy({"amp": dict(AMP, dtype="bfloat16")}))
    assert "loss_scaling_0" not in bf16.state_dict()
    with pytest.raises(ValueError, match="loss_scaling_0.*loss scaling"):
        bf16.set_state_dict({"loss_scaling_0": torch.tensor([4.0])})
    w = net.linear_0.weight.detach().clone()
    for bad in (torch.tensor([0.0]), torch.tensor([1.0, 2.0]), "x"):
        with pytest.raises(ValueError, match="loss_scaling_0 takes one positive number"):
            dm.set_state_dict({"linear_0.weight": w + 1, "loss_scaling_0": bad})
    with pytest.raises(ValueError, match="num_bad_steps_0 takes one count"):
        dm.set_state_dict({"num_bad_steps_0": torch.tensor([-1], dtype=torch.int32)})
    assert torch.equal(net.linear_0.weight, w)  # nothing written
    dm.set_state_dict({"loss_scaling_0": np.array([8.0], dtype=np.float32), "num_good_steps_0": torch.tensor([1])})
    assert dm._scaler.get_scale() == 8.0
    dm(*data(0))  # a clean step: the second in a row grows the scale
    assert dm._scaler.get_scale() == 16.0 and int(dm.state_dict()["num_good_steps_0"]) == 0
    np.testing.assert_equal(float(dm.state_dict()["loss_scaling_0"]), 16.0)


def _pipeline_resume(split):
    from tests.ranks.test_to_static_pipeline import LR, _staged, strategy
    from tests.ranks.test_to_static_pipeline import data as pp_data

    def make():
        dist, net, first, last = _staged()
        s = strategy("1F1B", 2)
        for k, v in AMP.items():
            setattr(s.amp, k, v)
        return to_static(net, None, nn.MSELoss(), torch.optim.Adam(net.parameters(), lr=LR), s), dist, first, last

    def run(dm, steps):
        out = []
        for s in steps:
            x, y = pp_data(s)
            loss = dm(dist.shard_tensor(x, first, [dist.Replicate()]), dist.shard_tensor(y, last, [dist.Replicate()]))
            out.append((None if loss is None else float(np.mean(loss)), dm._scaler.get_scale()))
        return out

    whole, dist, first, last = make()
    want = run(whole, range(len(SCALES)))
    first_dm = make()[0]
    run(first_dm, range(split))
    resumed = make()[0]
    resumed.set_state_dict(first_dm.state_dict())
    return want, run(resumed, range(split, len(SCALES)))


@pytest.mark.timeout(90)
def test_float16_loss_scale_resumes_on_every_pipeline_stage():
    for rank, (want, got) in enumerate(run_ranks(_pipeline_resume, WORLD, 3, timeout=80)):
        assert [s for _, s in want] == SCALES and got == want[3:]
        assert all(loss is not None for loss, _ in want) == (rank == WORLD - 1)


# -- the loss takes the model's outputs spread, as Paddle's loss(*outputs, *labels); a tuple loss raises clearly ----
class TwoOut(Net):
    def forward(self, x):
        out = super().forward(x)
        return out, out.sum(dim=1)


def two_out_loss(out, total, y):
    return F.mse_loss(out, y) + F.mse_loss(total, y.sum(dim=1))


def _two_outputs(how):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    net = TwoOut()
    strategy = {"sharding": {"enable": True, "stage": 1, "degree": WORLD}} if how == "sharding" else {}
    dm = to_static(net, None, two_out_loss, torch.optim.SGD(net.parameters(), lr=0.1), Strategy(strategy))
    losses = [float(dm(*data(s, dist.get_rank()))) for s in range(3)]
    dm.eval()
    evals = float(dm(*data(3, dist.get_rank())))
    program = dm.serial_main_program("train")
    return losses, evals, program.graph is not None, {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["data_parallel", "sharding"])
def test_a_model_with_two_outputs_gives_both_to_the_loss_and_trains_as_one_process(how):
    net = TwoOut()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    want = []
    for s in range(4):
        x = torch.cat([data(s, r)[0] for r in range(WORLD)])
        y = torch.cat([data(s, r)[1] for r in range(WORLD)])
        loss = two_out_loss(*net(x), y)
        want.append(float(loss.detach()))
        if s < 3:
            loss.backward()
            opt.step()
            opt.zero_grad()
    for losses, evals, traced, params in run_ranks(_two_outputs, WORLD, how, timeout=50):
        np.testing.assert_allclose(losses + [evals], want, rtol=1e-5)
        assert traced
        for k, v in net.state_dict().items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6)


def _tuple_loss(mode):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    net = Net()
    before = {k: v.detach().clone() for k, v in net.state_dict().items()}

    def loss(out, y):
        mse = F.mse_loss(out, y)
        return mse, mse.detach()

    dm = to_static(net, None, loss, torch.optim.SGD(net.parameters(), lr=0.1))
    getattr(dm, mode)()
    with pytest.raises(ValueError, match="the loss must return one tensor.*got a tuple of 2"):
        dm(*data(0, dist.get_rank()))
    dist.barrier()  # no rank left inside a collective
    return all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_loss_that_returns_a_tuple_raises_clearly_on_every_rank(mode):
    assert all(run_ranks(_tuple_loss, WORLD, mode, timeout=50))
