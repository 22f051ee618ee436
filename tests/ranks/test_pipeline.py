"""Pipeline parallelism: seed 001 4.3 across meshes, fleet PipelineLayer with every schedule, events, bubbles, the
module a hybrid run's collectives name."""

import dataclasses
from collections import Counter

import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks

MBS, M, LR = 2, 4, 0.1


class Block(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _descs(n=8):
    from meshviz.distributed.fleet.meta_parallel import LayerDesc

    return [LayerDesc(Block, 4) for _ in range(n)]


def _data(rows=MBS * M, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 4, generator=g)


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of every gradient it stepped with (train_batch clears them afterwards)."""

    def __init__(self, named, lr):
        named = list(named)
        super().__init__([p for _, p in named], lr=lr)
        self.names = {id(p): n for n, p in named}
        self.seen = []

    def step(self, closure=None):
        self.seen.append({self.names[id(p)]: p.grad.detach().clone() for g in self.param_groups for p in g["params"]
                          if p.grad is not None})
        return super().step(closure)


def _reference(descs, loss_fn, batches, m):
    """One process, Paddle's rule: each micro loss / m, backward, then SGD; batches = list of (x, y) per step,
    each x possibly holding several data-parallel replicas' rows (then the replicas' mean is taken)."""
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer

    layer = PipelineLayer(descs, num_stages=1, loss_fn=loss_fn)
    opt = RecordingSGD(layer.named_parameters(), LR)
    losses = []
    for x, y in batches:
        n = x.shape[0] // (m * MBS)  # replicas
        total = 0.0
        for xc, yc in zip(x.split(MBS), y.split(MBS)):
            loss = loss_fn(layer(xc), yc) / (m * n)
            loss.backward()
            total += loss.item() * n
        losses.append(total / n)
        opt.step()
        opt.zero_grad()
    return losses, opt.seen, {k: v.detach().clone() for k, v in layer.state_dict().items()}


def textbook_order(mode, p, m, v, d):
    """Blocks (phase, virtual stage, micro-batch) of pipe position d, from the schedules' definitions."""
    if mode == "FThenB":
        return [("F", d, i) for i in range(m)] + [("B", d, i) for i in range(m)]
    if mode == "1F1B":
        warm = min(p - d - 1, m)
        out = [("F", d, i) for i in range(warm)]
        for i in range(warm, m):
            out += [("F", d, i), ("B", d, i - warm)]
        return out + [("B", d, i) for i in range(m - warm, m)]
    if mode == "VPP":  # Megatron's interleaved 1F1B, m a multiple of p

        def unit(k, forward):
            c = (k // p) % v
            return ((c if forward else v - 1 - c) * p + d, (k // (p * v)) * p + k % p)

        total, warm = m * v, min((p - d - 1) * 2 + (v - 1) * p, m * v)
        out = [("F", *unit(k, True)) for k in range(warm)]
        for k in range(warm, total):
            out += [("F", *unit(k, True)), ("B", *unit(k - warm, False))]
        return out + [("B", *unit(k, False)) for k in range(total - warm, total)]
    raise ValueError(mode)


# -- fleet: every schedule on 4 pipe stages ----------------------------------------------------------


def _train(model, layer, steps=2):
    from meshviz import trace

    opt = RecordingSGD(layer.named_parameters(), LR)
    losses = []
    x, y = _data()
    with trace.record() as mem:
        for _ in range(steps):
            losses.append(float(model.train_batch((x, y), opt)))
    ev = [e.to_dict() for e in mem.events]
    eval_loss = float(model.eval_batch((x, y), compute_loss=True))
    outs = model.eval_batch((x, y), compute_loss=False)
    state = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    return {"losses": losses, "grads": opt.seen, "state": state,
            "events": ev, "order": model.schedule_order(), "eval_loss": eval_loss,
            "eval_out": torch.cat(outs).detach() if len(outs) else None}


def fleet_schedules():
    import copy

    import meshviz.distributed as dist
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer, PipelineParallel

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "pp_degree": 4}
    strategy.pipeline_configs = {"micro_batch_size": MBS, "accumulate_steps": M}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    out = {}
    for mode, v in [("1F1B", 1), ("FThenB", 1), ("VPP", 2), ("ZBH1", 1)]:
        layer = PipelineLayer(_descs(), loss_fn=nn.MSELoss(), num_virtual_pipeline_stages=v)
        if mode == "1F1B":
            model = fleet.distributed_model(layer)  # the default schedule, through fleet's hook
        else:
            s = copy.deepcopy(strategy)
            s.pipeline_configs = {"schedule_mode": mode}
            model = PipelineParallel(layer, hcg, s)
        assert isinstance(model, PipelineParallel) and model.schedule_mode == mode
        out[mode] = _train(model, layer)

    # wrong configurations: a ValueError on every rank, before any communication (the collective after them
    # would hang or mismatch otherwise)
    errors = []

    def expect(fn, pattern):
        with pytest.raises(ValueError, match=pattern):
            fn()
        errors.append(pattern)

    layer = PipelineLayer(_descs(), loss_fn=nn.MSELoss())
    model = PipelineParallel(layer, hcg, strategy)
    opt = torch.optim.SGD(layer.parameters(), lr=LR)
    x, y = _data(rows=7)
    expect(lambda: model.train_batch((x, y), opt), r"batch size 7 != micro_batch_size \(2\) \* accumulate_steps")
    expect(lambda: model.train_batch(x, opt), r"data must be \(inputs, labels\)")
    small = copy.deepcopy(strategy)
    small.pipeline_configs = {"accumulate_steps": 2, "schedule_mode": "VPP"}
    vl = PipelineLayer(_descs(), loss_fn=nn.MSELoss(), num_virtual_pipeline_stages=2)
    expect(lambda: PipelineParallel(vl, hcg, small), r"accumulate_steps \(2\) must be >= pp_degree \(4\)")
    vpp1 = copy.deepcopy(strategy)
    vpp1.pipeline_configs = {"schedule_mode": "VPP"}
    expect(lambda: PipelineParallel(layer, hcg, vpp1), "num_virtual_pipeline_stages")
    bad = copy.deepcopy(strategy)
    bad.pipeline_configs = {"schedule_mode": "2F2B"}
    expect(lambda: PipelineParallel(layer, hcg, bad), "schedule_mode")
    expect(lambda: PipelineLayer(_descs(), num_stages=2), r"num_stages=2 but the hybrid topology has pp_degree=4")
    expect(lambda: PipelineLayer(_descs(3)), "3 layers cannot fill 4")
    t = torch.ones(1) * dist.get_rank()
    dist.all_reduce(t)
    assert t.item() == 6
    out["errors"] = errors
    return out


@pytest.mark.timeout(300)
def test_fleet_schedules_match_single_process_with_their_orders_and_transfers():
    x, y = _data()
    ref_losses, ref_grads, ref_state = _reference(_descs(), nn.MSELoss(), [(x, y), (x, y)], M)
    res = run_ranks(fleet_schedules, 4, timeout=280)
    p = 4
    for mode in ("1F1B", "FThenB", "VPP", "ZBH1"):
        v = 2 if mode == "VPP" else 1
        seen = set()
        for d, r in enumerate(res):
            out = r[mode]
            # loss: the mean of the micro losses, on every stage
            torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
            for step in range(2):
                for name, g in out["grads"][step].items():
                    torch.testing.assert_close(g, ref_grads[step][name], rtol=1e-5, atol=1e-6, msg=f"{mode} {name}")
                    seen.add(name)
            for name, w in out["state"].items():
                torch.testing.assert_close(w, ref_state[name], rtol=1e-5, atol=1e-6)
            # eval after the two steps: same loss on every stage as the single process's next loss
            ev = out["events"]
            order = textbook_order(mode, p, M, v, d) if mode != "ZBH1" else out["order"]
            assert out["order"] == order, (mode, d)
            for step in range(2):
                ran = [(e["payload"]["phase"], e["payload"]["stage"], e["payload"]["micro_batch"])
                       for e in sorted(ev, key=lambda e: (e["start"], e["seq"]))
                       if e["kind"] == "compute" and e["payload"]["step"] == step]
                assert ran == order, (mode, d, step)
            if mode == "ZBH1":  # every micro-batch's backward split into B then W
                for i in range(M):
                    assert order.index(("B", d, i)) < order.index(("W", d, i))
        assert seen == set(ref_grads[0]), mode  # the stages together hold every parameter
        # events cover every transfer: each activation/gradient send has its recv on the peer
        sends = {e["payload"]["transfer"]: e for r in res for e in r[mode]["events"] if e["kind"] == "send"}
        recvs = {e["payload"]["transfer"]: e for r in res for e in r[mode]["events"] if e["kind"] == "recv"}
        stages = p * v
        assert len(sends) == len(recvs) == 2 * 2 * M * (stages - 1), mode  # 2 steps, F and B, every boundary
        assert set(sends) == set(recvs)
        for k, s in sends.items():
            r = recvs[k]
            # each event reports what its rank receives: the receiver the micro-batch, the sender nothing
            assert s["peer"] == r["rank"] and r["peer"] == s["rank"] and s["bytes"] == 0 and r["bytes"] == MBS * 4 * 4
            assert r["end"] >= s["start"]
        last = res[-1][mode]
        assert all(r[mode]["eval_loss"] == last["eval_loss"] for r in res)
    # the next loss after two steps, and the outputs, from the single process
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer

    ref = PipelineLayer(_descs(), num_stages=1, loss_fn=nn.MSELoss())
    ref.load_state_dict(ref_state)
    with torch.no_grad():
        out = ref(x)
        ref_eval = sum(nn.MSELoss()(ref(xc), yc).item() for xc, yc in zip(x.split(MBS), y.split(MBS))) / M
    for mode in ("1F1B", "FThenB", "VPP", "ZBH1"):
        assert res[0][mode]["eval_out"] is None
        torch.testing.assert_close(res[-1][mode]["eval_out"], out, rtol=1e-5, atol=1e-6)
        assert abs(res[0][mode]["eval_loss"] - ref_eval) < 1e-5
    assert all(len(r["errors"]) == 7 for r in res)


# -- fleet: pp 2 x dp 2, a weight shared by the first and last stage, recompute ------------------------


def tied_forward(layer, x):
    return torch.matmul(x, layer.weight.t())  # the last stage reuses the first stage's weight


def _shared_descs():
    from meshviz.distributed.fleet.meta_parallel import LayerDesc, SharedLayerDesc

    return [SharedLayerDesc("tied", nn.Linear, None, "weight", 4, 4), LayerDesc(Block, 4), LayerDesc(Block, 4),
            SharedLayerDesc("tied", nn.Linear, tied_forward, "weight", 4, 4)]


def shared_dp():
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 2, "pp_degree": 2}
    strategy.pipeline_configs = {"micro_batch_size": MBS, "accumulate_steps": M}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    layer = PipelineLayer(_shared_descs(), loss_fn=nn.MSELoss(), recompute_interval=1)
    model = fleet.distributed_model(layer)
    opt = fleet.distributed_optimizer(torch.optim.SGD(layer.parameters(), lr=LR))
    inner = RecordingSGD(layer.named_parameters(), LR)
    opt._inner_opt = inner
    x, y = _data(rows=2 * MBS * M, seed=1)
    dp = hcg.get_data_parallel_rank()
    rows = slice(dp * MBS * M, (dp + 1) * MBS * M)
    losses = [float(model.train_batch((x[rows], y[rows]), opt)) for _ in range(2)]
    return {"dp": dp, "stage": hcg.get_stage_id(), "losses": losses, "grads": inner.seen,
            "state": {k: v.detach().clone() for k, v in layer.state_dict().items()}}


@pytest.mark.timeout(200)
def test_shared_layer_desc_with_data_parallel_and_recompute_matches_single_process():
    x, y = _data(rows=2 * MBS * M, seed=1)
    _, ref_grads, ref_state = _reference(_shared_descs(), nn.MSELoss(), [(x, y), (x, y)], M)
    res = run_ranks(shared_dp, 4, timeout=180)
    for r in res:
        # grads averaged over the two replicas; the tied weight's grad summed over its two stages
        for step in range(2):
            for name, g in r["grads"][step].items():
                key = "shared_layers.tied.weight" if name.startswith("shared_layers.tied.weight") else name
                if name == "shared_layers.tied.bias" and r["stage"] == 1:
                    continue  # the last stage uses the weight only
                torch.testing.assert_close(g, ref_grads[step][key], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(r["state"]["shared_layers.tied.weight"], ref_state["shared_layers.tied.weight"],
                                   rtol=1e-5, atol=1e-6)
    # each replica reports the mean loss of its own rows, identically on both of its stages
    by_dp = {}
    for r in res:
        by_dp.setdefault(r["dp"], set()).add(tuple(round(v, 6) for v in r["losses"]))
    assert all(len(s) == 1 for s in by_dp.values()) and by_dp[0] != by_dp[1]


# -- seed 001 section 4.3: layers on two meshes of 4 ranks, reshard across them --------------------------


def _seed43_weights():
    g = torch.Generator().manual_seed(5)
    return torch.randn(6, 8, generator=g) * 0.5, torch.randn(8, 6, generator=g) * 0.5, torch.randn(3, 4, 6, generator=g)


def seed_43(steps=2):
    import meshviz.distributed as dist
    from meshviz import trace

    dist.init_parallel_env()
    mesh0 = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    mesh1 = dist.ProcessMesh([4, 5, 6, 7], dim_names=["x"])
    w0, w1, data = _seed43_weights()

    class MlpModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.w0 = dist.shard_tensor(nn.Parameter(w0.clone()), mesh0, [dist.Replicate()])
            self.w1 = dist.shard_tensor(nn.Parameter(w1.clone()), mesh1, [dist.Replicate()])

        def forward(self, x):
            y = torch.matmul(x, self.w0)
            y = dist.reshard(y, mesh1, [dist.Replicate()])  # stage 0's activations go to stage 1
            return torch.matmul(y, self.w1)

    model = MlpModel()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    with trace.record() as mem:
        for step in range(steps):
            x = dist.shard_tensor(data[step], mesh0, [dist.Replicate()])
            loss = model(x).mean()
            loss.backward()
            r = dist.get_rank()
            grads.append(dist.unshard_dtensor(model.w0.grad if r < 4 else model.w1.grad).detach().clone())
            opt.step()
            opt.zero_grad()
            losses.append(float(dist.unshard_dtensor(loss).detach()) if r >= 4 else None)
    steps_ev = [e.to_dict() for e in mem.events if e.kind == "reshard_step" and e.op == "send_recv"]
    return {"losses": losses, "grads": grads, "xfer": steps_ev}


@pytest.mark.timeout(300)
def test_seed_43_two_meshes_of_four_matches_single_process():
    w0, w1, data = _seed43_weights()
    p0, p1 = nn.Parameter(w0.clone()), nn.Parameter(w1.clone())
    opt = torch.optim.SGD([p0, p1], lr=LR)
    ref_losses, ref_grads = [], []
    for step in range(2):
        loss = (data[step] @ p0 @ p1).mean()
        loss.backward()
        ref_losses.append(loss.item())
        ref_grads.append((p0.grad.clone(), p1.grad.clone()))
        opt.step()
        opt.zero_grad()
    res = run_ranks(seed_43, 8, timeout=280)
    for r, out in enumerate(res):
        for step in range(2):
            torch.testing.assert_close(out["grads"][step], ref_grads[step][0 if r < 4 else 1], rtol=1e-5, atol=1e-6)
        if r >= 4:
            torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        # every step moves activations forward (rank r -> r+4) and gradients back (r+4 -> r), and says so
        pairs = [tuple(map(tuple, e["group"])) for e in out["xfer"]]
        mine = r if r < 4 else r - 4
        fwd = [g for g in pairs if (mine, mine + 4) in g]
        bwd = [g for g in pairs if (mine + 4, mine) in g]
        assert len(fwd) == len(bwd) == 2, pairs  # per step one forward transfer and one backward


# -- pure: formula, measured bubble, segmentation ----------------------------------------------------


def test_bubble_formula_and_measured_bubble_on_ideal_timelines():
    from meshviz.distributed.pipeline import bubble_formula, measured_bubble, segment_layers
    from meshviz.widgets.pipeline_view import synthetic_schedule

    assert bubble_formula(4, 8) == pytest.approx(3 / 11)
    assert bubble_formula(2, 4) == pytest.approx(1 / 5)
    assert bubble_formula(4, 8, 2) == pytest.approx(3 / 19)
    with pytest.raises(ValueError):
        bubble_formula(0, 4)
    for p, m in [(2, 4), (4, 8), (4, 4)]:
        for sched in ("1F1B", "FThenB"):
            ev = synthetic_schedule(p, m, sched, forward=1.0, backward=2.0)
            for e in ev:
                e.payload = dataclasses.replace(e.payload, step=0)
            assert measured_bubble(ev) == pytest.approx(bubble_formula(p, m), abs=1e-9), (p, m, sched)
    with pytest.raises(ValueError, match="no pipeline compute events"):
        measured_bubble([])
    # Paddle's uniform cut: remainders go one each to the last parts
    assert segment_layers(list(range(10)), 4) == [0, 2, 4, 7, 10]
    assert segment_layers(list(range(8)), 4) == [0, 2, 4, 6, 8]
    assert segment_layers([Block(), nn.Tanh(), Block(), nn.Tanh()], 2, "layer:Block") == [0, 1, 4]  # as Paddle
    with pytest.raises(ValueError, match="do not split"):
        segment_layers([Block(), Block(), Block()], 2, "layer:Block")


# -- a hybrid run's backward collectives name their module, however many micro-batches FThenB holds ----------------


class TPBlock(nn.Module):
    def __init__(self, width=4):
        from meshviz.distributed.fleet import meta_parallel as mpu

        super().__init__()
        self.up = mpu.ColumnParallelLinear(width, 2 * width, has_bias=True, gather_output=False)  # backward all-reduces
        self.down = mpu.RowParallelLinear(2 * width, width, input_is_parallel=True)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def fthenb_many_micro_batches(m):
    from meshviz import trace
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 2, "pp_degree": 2}
    strategy.pipeline_configs = {"micro_batch_size": 1, "accumulate_steps": m, "schedule_mode": "FThenB"}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    layer = PipelineLayer([LayerDesc(TPBlock, 4) for _ in range(2)], loss_fn=nn.MSELoss())
    model = fleet.distributed_model(layer)
    x, y = _data(rows=m)
    opt = torch.optim.SGD(layer.parameters(), lr=LR)
    model.train_batch((x, y), opt)  # the first step also runs a forward to learn the shapes
    with trace.record() as mem:
        model.train_batch((x, y), opt)
    mine = [(e.op, e.payload) for e in mem.events if e.kind == "collective" and e.rank == hcg.get_global_rank()]
    return {"stage": hcg.get_stage_id(), "backward": [(op, c.module) for op, c in mine if c.backward],
            "forward": [(op, c.module) for op, c in mine if not c.backward]}


@pytest.mark.timeout(300)
def test_fthenb_backward_collectives_name_their_module_past_many_micro_batches():
    m = 40  # the last stage makes 2 * m outermost module calls (its block's and the loss's) before any backward
    res = run_ranks(fthenb_many_micro_batches, 4, m, timeout=240)
    for r in res:
        # each micro-batch's RowParallelLinear all-reduces in the forward, its ColumnParallelLinear in the backward
        # where its input needs a gradient: on the second stage (the first stage's input is the data)
        assert Counter(r["forward"]) == {("all_reduce", "_Chunk.0.down"): m, ("broadcast", None): 1}  # the loss's
        assert Counter(r["backward"]) == ({("all_reduce", "_Chunk.0.up"): m} if r["stage"] == 1 else {})


class _SeqBlock(nn.Module):
    def __init__(self, w=4):
        super().__init__()
        self.lin = nn.Linear(w, w)

    def forward(self, x):  # [B, T, H]: any sequence length
        return torch.tanh(self.lin(x)) + x


def _mean_t(x):
    return x.mean(1)


def _seq_batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, t, 4, generator=g), torch.randn(4, 4, generator=g)) for t in (3, 5, 3, 2)]


def _seq_descs():
    from meshviz.distributed.fleet.meta_parallel import LayerDesc

    return [LayerDesc(_SeqBlock), LayerDesc(_SeqBlock), LayerDesc(_SeqBlock), _mean_t]


def later_stages_given_no_inputs():
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import PipelineLayer

    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"pp_degree": 2}
    s.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 2}
    fleet.init(is_collective=True, strategy=s)
    first = fleet.get_hybrid_communicate_group().get_stage_id() == 0
    layer = PipelineLayer(_seq_descs(), loss_fn=nn.MSELoss())
    model = fleet.distributed_model(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    # as in Paddle, only the first stage needs the inputs: the sequence length changes from step to step
    losses = [float(model.train_batch((x if first else None, y), opt)) for x, y in _seq_batches()]
    x, y = _seq_batches()[1]
    return losses, float(model.eval_batch((x if first else None, y), compute_loss=True))


def test_later_stages_given_no_inputs_follow_the_first_stages_shapes():
    from meshviz.distributed.pipeline.layers import BASE_SEED

    blocks = []
    for i, d in enumerate(_seq_descs()[:3]):  # layer i built under seed BASE_SEED + i, as Paddle's PipelineLayer
        torch.manual_seed(BASE_SEED + i)
        blocks.append(d.build_layer())
    opt = torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=0.1)

    def run(x):
        for b in blocks:
            x = b(x)
        return _mean_t(x)

    want = []
    for x, y in _seq_batches():  # micro-batches of 2 rows, each loss / 2: the mean loss's gradients
        loss = nn.functional.mse_loss(run(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    x, y = _seq_batches()[1]
    with torch.no_grad():
        evaluated = nn.functional.mse_loss(run(x), y).item()
    for losses, ev in run_ranks(later_stages_given_no_inputs, 2, timeout=60):
        assert losses == pytest.approx(want, rel=1e-5) and ev == pytest.approx(evaluated, rel=1e-5)
