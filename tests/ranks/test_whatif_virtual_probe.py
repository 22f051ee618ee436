"""meshviz.what_if on fleet pipelines against the same function on real thread ranks: virtual stages (interleaved
schedules), every schedule at 2, 4 and 8 stages, micro-batch counts that are no multiple of the stages, layers that
do not divide evenly; each rank's events (blocks, transfers, live activation bytes), parameters and bytes held.
And the interleaved pipeline's real losses and weights against one process."""

import pytest
import torch
from torch import nn

import meshviz
from meshviz.errors import RankError
from meshviz.testing import run_ranks
from tests.ranks.test_what_if import Meter
from tests.ranks.test_what_if_probe import SteppedAdamW

H, SEED = 4, 1234


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Pair(Block):
    """Starts a (hidden, integer mask) pair: the mask crosses the stages beside the hidden state."""

    def forward(self, x):
        return torch.tanh(self.fc(x)), (x > 0).long()


class PairBlock(Block):
    def forward(self, pair):
        h, mask = pair
        return torch.tanh(self.fc(h)) * mask.to(h.dtype) + h, mask


class TP(nn.Module):
    """A column- then a row-parallel Linear: their collectives run inside the stage."""

    def __init__(self):
        super().__init__()
        from meshviz.distributed.fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear

        self.a = ColumnParallelLinear(H, 2 * H, gather_output=False, has_bias=True)
        self.b = RowParallelLinear(2 * H, H, input_is_parallel=True)

    def forward(self, x):
        return torch.tanh(self.b(torch.relu(self.a(x))))


class Taller(nn.Module):
    """Doubles the rows, but only on rank 0: a model whose description gives other shapes than its run."""

    def forward(self, x):
        import meshviz.distributed as dist

        return x if dist.get_rank() else torch.cat([x, x])


def first(pair):
    return pair[0]


def _descs(kind, n):
    from meshviz.distributed.fleet.meta_parallel import LayerDesc

    if kind == "pair":
        return [LayerDesc(Pair)] + [LayerDesc(PairBlock) for _ in range(n - 2)] + [first]
    if kind == "tp":
        return [LayerDesc(TP) for _ in range(n)]
    if kind == "mixed":  # a module built on every rank, a plain function, a LayerDesc
        return [nn.Linear(H, 2 * H), lambda x: x * 2, LayerDesc(nn.Linear, 2 * H, H)] + \
            [LayerDesc(Block) for _ in range(n - 3)]
    if kind == "taller":
        return [LayerDesc(Block), Taller(), LayerDesc(Block)] + [LayerDesc(Block) for _ in range(n - 3)]
    return [LayerDesc(Block) for _ in range(n)]


def _event(e):
    p = e.payload
    return (e.kind, e.op, e.peer, e.bytes, *(getattr(p, k, None) for k in ("phase", "stage", "micro_batch",
                                                                          "live_activation_bytes")))


def fleet_pipeline(case):
    """Two train_batch steps of ``case``'s pipeline: what the rank held and received, its events, its parameters."""
    from meshviz import trace
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer

    with trace.record() as rec:
        s = fleet.DistributedStrategy()
        s.hybrid_configs = case["hybrid"]
        s.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": case["m"],
                              "schedule_mode": case.get("mode", "1F1B")}
        fleet.init(is_collective=True, strategy=s)
        torch.manual_seed(0)
        layer = PipelineLayer(_descs(case.get("kind"), case["layers"]), loss_fn=nn.MSELoss(),
                              seg_method=case.get("seg", "uniform"), num_virtual_pipeline_stages=case.get("v"))
        opt = SteppedAdamW(layer.parameters(), lr=0.01)
        model, wrapped = fleet.distributed_model(layer), fleet.distributed_optimizer(opt)
        meter = opt.meter = Meter(layer, opt)
        meter.sample(grads=False, state=False)
        for _ in range(2):
            model.train_batch((torch.randn(2 * case["m"], H), torch.randn(2 * case["m"], H)), wrapped)
        opt.meter = None
    return {"held": meter.result(rec.events), "events": [_event(e) for e in rec.events],
            "params": sorted((n, tuple(p.shape)) for n, p in layer.named_parameters())}


def _world(case) -> int:
    n = 1
    for d in case["hybrid"].values():
        n *= d
    return n


CASES = {
    # virtual stages: rank 0's later chunks take their inputs from the last pipe rank, simulated after it
    "vpp_p2": {"hybrid": {"pp_degree": 2}, "v": 2, "m": 2, "layers": 4},
    "vpp_p4_uneven": {"hybrid": {"pp_degree": 4}, "v": 2, "m": 6, "layers": 9, "mode": "VPP"},
    "vpp_p4_fthenb": {"hybrid": {"pp_degree": 4}, "v": 2, "m": 5, "layers": 8, "mode": "FThenB"},
    "vpp_p4_zbh1": {"hybrid": {"pp_degree": 4}, "v": 2, "m": 4, "layers": 8, "mode": "ZBH1"},
    "vpp_p8": {"hybrid": {"pp_degree": 8}, "v": 2, "m": 12, "layers": 17, "mode": "VPP"},
    "vpp_v3_seg": {"hybrid": {"pp_degree": 2}, "v": 3, "m": 2, "layers": 7, "seg": [0, 1, 3, 4, 5, 6]},
    "vpp_dp": {"hybrid": {"dp_degree": 2, "pp_degree": 2}, "v": 2, "m": 2, "layers": 4},
    "vpp_tp": {"hybrid": {"pp_degree": 2, "mp_degree": 2}, "v": 2, "m": 2, "layers": 4, "kind": "tp"},
    "vpp_pair": {"hybrid": {"pp_degree": 2}, "v": 2, "m": 2, "layers": 5, "kind": "pair"},
    "vpp_mixed": {"hybrid": {"pp_degree": 2}, "v": 2, "m": 3, "layers": 6, "kind": "mixed"},
    # one chunk a rank: the live activation bytes each block reports
    "1f1b_p4_uneven": {"hybrid": {"pp_degree": 4}, "m": 6, "layers": 6},
    "1f1b_p8_few": {"hybrid": {"pp_degree": 8}, "m": 3, "layers": 8},
    "fthenb_p4": {"hybrid": {"pp_degree": 4}, "m": 5, "layers": 5, "mode": "FThenB"},
    "zbh1_p4": {"hybrid": {"pp_degree": 4}, "m": 6, "layers": 4, "mode": "ZBH1"},
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_what_if_on_pipelines_equals_real_run(name):
    case = CASES[name]
    n = _world(case)
    real = run_ranks(fleet_pipeline, n, case, ranks="threads", timeout=240)
    est = meshviz.what_if(fleet_pipeline, n, case, timeout=240)
    for r in range(n):
        got = est.values[est.like[r]]
        assert got["params"] == real[r]["params"], r
        assert [tuple(e) for e in got["events"]] == [tuple(e) for e in real[r]["events"]], r
        assert got["held"] == real[r]["held"], r
        if case.get("kind") != "mixed":  # there every rank holds the module built on each (the meter counts a stage's)
            assert {k: est.per_rank[r][k] for k in ("params", "grads", "optimizer", "comm_bytes")} == real[r]["held"]
    blocks = [e for e in real[0]["events"] if e[0] == "compute"]
    assert len(blocks) == 2 * case["m"] * case.get("v", 1) * (3 if case.get("mode") == "ZBH1" else 2)
    assert max(e[7] for e in blocks) > 0  # activations are held between a block's forward and its backward
    if _world(case) == case["hybrid"]["pp_degree"]:  # each rank holds its own chunks' layers, none twice
        held = [name for r in range(n) for name, _ in real[r]["params"]]
        assert len(held) == len(set(held))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("v", [None, 2])
def test_a_pipelines_data_parallel_replicas_share_a_simulation(v):
    """dp 4 x pp 2: a stage's replicas that take the data-parallel broadcast share one run (the broadcast's root,
    rank 0 or 1, holds what it sends: a class of its own), each standing for its replicas, transfers to its own
    stage's next rank included."""
    case = {"hybrid": {"dp_degree": 4, "pp_degree": 2}, "v": v, "m": 2, "layers": 4}
    real = run_ranks(fleet_pipeline, 8, case, ranks="threads", timeout=240)
    est = meshviz.what_if(fleet_pipeline, 8, case, timeout=240)
    assert est.simulated == [0, 1, 2, 3] and not est.alone
    assert est.like == {0: 0, 1: 1, 2: 2, 3: 3, 4: 2, 5: 3, 6: 2, 7: 3}
    for r in range(8):
        rep = est.like[r]
        got = est.values[rep]
        assert got["params"] == real[r]["params"] and got["held"] == real[r]["held"], r
        assert {k: est.per_rank[r][k] for k in ("params", "grads", "optimizer", "comm_bytes")} == real[r]["held"], r
        # a replica's peers are its own pipeline's: the same stage's, one replica over (rank + 2 per replica)
        shift = lambda e, d: tuple(x + d if i == 2 and x is not None else x for i, x in enumerate(e))  # noqa: E731
        assert [shift(tuple(e), r - rep) for e in got["events"]] == [tuple(e) for e in real[r]["events"]], r


@pytest.mark.timeout(120)
def test_what_if_names_a_description_that_gives_other_shapes():
    """A layer whose output's shape depends on the rank that runs it: the first rank's later chunks take their
    inputs from the model's description; the last rank finds it outputs other shapes and says so."""
    case = {"hybrid": {"pp_degree": 2}, "v": 2, "m": 2, "layers": 4, "kind": "taller"}
    with pytest.raises(RankError, match=r"what_if: stage 2 \(rank 0, simulated before this one\) took its inputs "
                                        r"to be \(shape, stride, dtype, requires_grad\) \[\(\(4, 4\)"):
        meshviz.what_if(fleet_pipeline, 2, case, timeout=60)


# -- the real interleaved run against one process ---------------------------------------------------------------
def _trained(p, v, m, layers, mode):
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer

    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"pp_degree": p}
    s.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": m, "schedule_mode": mode}
    fleet.init(is_collective=True, strategy=s)
    layer = PipelineLayer(_descs("blocks", layers), loss_fn=nn.MSELoss(), num_virtual_pipeline_stages=v)
    model = fleet.distributed_model(layer)
    opt = fleet.distributed_optimizer(torch.optim.SGD(layer.parameters(), lr=0.5))
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(2 * m, H, generator=g), torch.randn(2 * m, H, generator=g)) for _ in range(2)]
    losses = [float(model.train_batch(b, opt)) for b in batches]
    return losses, {n: t.detach().clone() for n, t in layer.named_parameters()}, layer.segment_parts


@pytest.mark.timeout(180)
@pytest.mark.parametrize("p,m,layers,mode", [(2, 2, 4, "VPP"), (2, 3, 5, "FThenB"), (4, 4, 8, "VPP"),
                                             (4, 6, 9, "VPP"), (4, 4, 8, "ZBH1")])
def test_interleaved_run_matches_one_process(p, m, layers, mode):
    """v = 2: the losses of two steps and every weight after them, as one process training the same layers."""
    res = run_ranks(_trained, p, p, 2, m, layers, mode, timeout=150)
    built = []
    for i in range(layers):
        torch.manual_seed(SEED + i)
        built.append(Block())
    dense = nn.Sequential(*built)
    opt = torch.optim.SGD(dense.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(7)
    want = []
    for _ in range(2):
        x, y = torch.randn(2 * m, H, generator=g), torch.randn(2 * m, H, generator=g)
        loss = nn.functional.mse_loss(dense(x), y)
        want.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    ref = {f"{i}.{k}": t for i, b in enumerate(built) for k, t in b.named_parameters()}
    seen = set()
    for r, (losses, state, parts) in enumerate(res):
        assert losses == pytest.approx(want, rel=1e-5, abs=1e-6), r
        for name, t in state.items():
            torch.testing.assert_close(t, ref[name].detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda s: f"rank {r} {name}: {s}")
        mine = {int(k.split(".")[0]) for k in state}
        assert mine == {i for c in range(2) for i in range(parts[r + c * p], parts[r + c * p + 1])}, r
        seen |= set(state)
    assert seen == set(ref)
