"""fleet hybrid parallel (dp x mp x sharding x sep, no pipeline) against one process and Paddle's topology."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshviz.testing import run_ranks

V, D, H = 8, 4, 8
CLIP = 0.05
SPLIT = {"emb.weight": 0, "up.weight": 0, "up.bias": 0, "head.weight": 0, "head.bias": 0, "down.weight": 1}


def _batch(step, d, t=4):
    g = torch.Generator().manual_seed(1000 * step + d)
    return torch.randint(0, V, (2, t), generator=g), torch.randint(0, V, (2, t), generator=g)


class _Ref(nn.Module):
    """The dense model: a branch (``extra``) only some batches take, a frozen layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb, self.up, self.down = nn.Embedding(V, D), nn.Linear(D, H), nn.Linear(H, D)
        self.head, self.extra, self.frozen = nn.Linear(D, V), nn.Linear(D, D), nn.Linear(D, D)
        self.frozen.requires_grad_(False)

    def hidden(self, ids, use_extra):
        h = self.down(torch.relu(self.up(self.frozen(self.emb(ids)))))
        return h + self.extra(h) if use_extra else h

    def forward(self, ids, lab, use_extra):
        return F.cross_entropy(self.head(self.hidden(ids, use_extra)).reshape(-1, V), lab.reshape(-1))


class _MP(_Ref):
    """``_Ref`` with Paddle's tensor-parallel layers, holding mp rank ``r``'s blocks of its weights."""

    def __init__(self, r, n):
        from meshviz.distributed.fleet import meta_parallel as mpu

        super().__init__()
        ref = _Ref()
        self.emb = mpu.VocabParallelEmbedding(V, D)
        self.up = mpu.ColumnParallelLinear(D, H, has_bias=True, gather_output=False)
        self.down = mpu.RowParallelLinear(H, D, input_is_parallel=True)
        self.head = mpu.ColumnParallelLinear(D, V, has_bias=True, gather_output=False)
        self.ce = mpu.ParallelCrossEntropy()
        self.load_state_dict(_blocks(ref.state_dict(), r, n))

    def forward(self, ids, lab, use_extra, total=None):
        loss = self.ce(self.head(self.hidden(ids, use_extra)), lab)
        return loss.mean() if total is None else loss.sum() / total


def _blocks(state, r, n):
    return {k: v.chunk(n, SPLIT[k])[r] if k in SPLIT else v for k, v in state.items()}


def _optimizer(model, clip):
    import meshviz.nn as mnn

    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for k, p in named if "bias" not in k], "weight_decay": 0.1},
                             {"params": [p for k, p in named if "bias" in k], "weight_decay": 0.0, "lr": 0.02}],
                            lr=0.05)
    if clip:
        opt._grad_clip = mnn.ClipGradByGlobalNorm(clip)
    return opt


def _dense(n_data, steps=3, extra=True, clip=CLIP):
    """One process on every data rank's batch: (losses, state)."""
    import meshviz.nn as mnn

    ref = _Ref()
    opt = _optimizer(ref, None)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for step in range(steps):
        loss = sum(ref(*_batch(step, d), extra and d == 0) for d in range(n_data)) / n_data
        loss.backward()
        if clip:
            mnn.ClipGradByGlobalNorm(clip)([p for p in ref.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
        sched.step()
    return {k: v.clone() for k, v in ref.state_dict().items()}


def _init(hybrid):
    import meshviz.distributed as dist
    from meshviz.distributed import fleet

    dist.init_parallel_env()
    s = fleet.DistributedStrategy()
    s.hybrid_configs = hybrid
    fleet.init(is_collective=True, strategy=s)
    return fleet, fleet.get_hybrid_communicate_group()


def _data_index(h):
    return h.get_data_parallel_rank() * h.get_sharding_parallel_world_size() + h.get_sharding_parallel_rank()


# -- a parameter with a gradient on some ranks only, under sharding ----------------------------------------------

def _hybrid_train(hybrid, steps=3):
    fleet, h = _init(hybrid)
    n, r = h.get_model_parallel_world_size(), h.get_model_parallel_rank()
    model = _MP(r, n)
    opt = _optimizer(model, CLIP)
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    d = _data_index(h)
    for step in range(steps):
        model(*_batch(step, d), d == 0).backward()  # only data rank 0 takes the extra branch
        opt.step()
        opt.clear_grad()
        sched.step()
    return n, r, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hybrid,world", [({"dp_degree": 1, "mp_degree": 2, "sharding_degree": 2}, 4),
                                          ({"dp_degree": 2, "mp_degree": 2, "sharding_degree": 2}, 8),
                                          ({"dp_degree": 2, "sharding_degree": 2}, 4)],
                         ids=["mp2-sharding2", "dp2-mp2-sharding2", "dp2-sharding2"])
def test_sharding_counts_a_gradient_only_some_ranks_have_as_one_process_does(hybrid, world):
    # the branch only data rank 0 took has no gradient on the other ranks: one process on the whole batch still
    # trains it (its gradient is rank 0's share); the owner's reduce ran on some ranks only and stopped them
    want = _dense(hybrid["dp_degree"] * hybrid["sharding_degree"])
    for n, r, got in run_ranks(_hybrid_train, world, hybrid, timeout=100):
        for k, v in _blocks(want, r, n).items():
            torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5, msg=k)


def _scaled_train(hybrid, steps=4):
    import meshviz.distributed as dist

    fleet, h = _init(hybrid)
    n, r = h.get_model_parallel_world_size(), h.get_model_parallel_rank()
    model = fleet.distributed_model(_MP(r, n))
    opt = fleet.distributed_optimizer(_optimizer(model, CLIP))
    scaler = fleet.distributed_scaler(torch.amp.GradScaler("cpu", init_scale=256.0))
    d = _data_index(h)
    for step in range(steps):
        scaler.scale(model(*_batch(step, d), d == 0)).backward()
        if step == 1 and dist.get_rank() == 1:  # one rank sees nan: every rank skips the step
            model.up.weight.grad[0, 0] = float("nan")
        scaler.step(opt)
        scaler.update()
        opt.clear_grad()
    return n, r, scaler.get_scale(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _dense_scaled(n_data, steps=4):
    import meshviz.nn as mnn

    ref = _Ref()
    opt = _optimizer(ref, None)
    for step in range(steps):
        (sum(ref(*_batch(step, d), d == 0) for d in range(n_data)) / n_data).backward()
        mnn.ClipGradByGlobalNorm(CLIP)([p for p in ref.parameters() if p.grad is not None])
        if step != 1:
            opt.step()
        opt.zero_grad()
    return ref.state_dict()


@pytest.mark.timeout(120)
def test_scaler_and_clip_under_mp_and_sharding_skip_the_nan_step_on_every_rank():
    # with the branch only data rank 0 takes (its reduce stopped the ranks before)
    want = _dense_scaled(2)
    for n, r, scale, got in run_ranks(_scaled_train, 4, {"dp_degree": 1, "mp_degree": 2, "sharding_degree": 2},
                                      timeout=100):
        assert scale == 128.0  # backed off once, on every rank
        for k, v in _blocks(want, r, n).items():
            torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5, msg=k)


# -- sep: each rank a part of the sequence ----------------------------------------------------------------------

def _sep_train(hybrid, by_hand, steps=3):
    import meshviz.distributed as dist
    from meshviz.distributed.fleet.utils import fused_allreduce_gradients

    fleet, h = _init(hybrid)
    n, r = h.get_model_parallel_world_size(), h.get_model_parallel_rank()
    model = _MP(r, n)
    if h.get_sep_parallel_rank() == 1:  # distributed_model makes it the sep group's first rank's
        torch.manual_seed(dist.get_rank())
        with torch.no_grad():
            model.extra.weight.normal_()
    inner = _optimizer(model, None if by_hand else CLIP)
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(inner)
    sep, s = h.get_sep_parallel_world_size(), h.get_sep_parallel_rank()
    for step in range(steps):
        ids, lab = _batch(step, _data_index(h))
        t = ids.shape[1] // sep
        model(ids[:, s * t:(s + 1) * t], lab[:, s * t:(s + 1) * t], True, total=lab.numel()).backward()
        if by_hand:
            fused_allreduce_gradients(list(model.parameters()), h)
            inner.step()
            inner.zero_grad()
        else:
            opt.step()
            opt.clear_grad()
    return n, r, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _dense_sep(n_data, clip, steps=3):
    import meshviz.nn as mnn

    ref = _Ref()
    opt = _optimizer(ref, None)
    for step in range(steps):
        (sum(ref(*_batch(step, d), True) for d in range(n_data)) / n_data).backward()
        if clip:
            mnn.ClipGradByGlobalNorm(clip)([p for p in ref.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
    return ref.state_dict()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hybrid,world,by_hand", [({"dp_degree": 2, "sep_degree": 2}, 4, False),
                                                  ({"dp_degree": 1, "sep_degree": 2, "mp_degree": 2}, 4, False),
                                                  ({"dp_degree": 1, "sep_degree": 2, "sharding_degree": 2}, 4, False),
                                                  ({"dp_degree": 2, "sep_degree": 2}, 4, True)],
                         ids=["dp2-sep2", "sep2-mp2", "sep2-sharding2", "fused_allreduce_gradients"])
def test_sep_sums_the_gradients_over_the_sep_group_as_paddle(hybrid, world, by_hand):
    # Paddle: distributed_model broadcasts the parameters over the sep group, and the optimizer's step (or
    # fused_allreduce_gradients) sums the gradients over it (averaging over dp): each sep rank's loss is its part
    # of the sequence's. Nothing was synced over sep: the sep ranks trained apart on half the gradient
    want = _dense_sep(hybrid["dp_degree"] * hybrid.get("sharding_degree", 1), None if by_hand else CLIP)
    for n, r, got in run_ranks(_sep_train, world, hybrid, by_hand, timeout=100):
        for k, v in _blocks(want, r, n).items():
            torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5, msg=k)


# -- the hybrid group's values against Paddle 3.3.1's -----------------------------------------------------------

PADDLE_NAMES = ["data", "pipe", "sharding", "sep", "context", "model"]
# per config: its topology's names, the groups of more than one rank along each axis, then per rank
# (dp, mp, sharding, sep) ranks and its check group, all as Paddle 3.3.1's fleet.init gives them on 8 ranks
PADDLE_HCG = [
    ({"dp_degree": 2, "mp_degree": 2, "sharding_degree": 2}, PADDLE_NAMES,
     {"data": [[0, 4], [1, 5], [2, 6], [3, 7]], "sharding": [[0, 2], [1, 3], [4, 6], [5, 7]],
      "model": [[0, 1], [2, 3], [4, 5], [6, 7]]},
     [(0, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 1, 1, 0), (1, 0, 0, 0), (1, 1, 0, 0), (1, 0, 1, 0), (1, 1, 1, 0)]),
    ({"dp_degree": 2, "mp_degree": 2, "sep_degree": 2}, PADDLE_NAMES,
     {"data": [[0, 4], [1, 5], [2, 6], [3, 7]], "sep": [[0, 2], [1, 3], [4, 6], [5, 7]],
      "model": [[0, 1], [2, 3], [4, 5], [6, 7]]},
     [(0, 0, 0, 0), (0, 1, 0, 0), (0, 0, 0, 1), (0, 1, 0, 1), (1, 0, 0, 0), (1, 1, 0, 0), (1, 0, 0, 1), (1, 1, 0, 1)]),
    ({"dp_degree": 2, "mp_degree": 2, "sharding_degree": 2, "order": ["sharding", "mp", "sep", "cp", "dp", "pp"]},
     ["sharding", "model", "sep", "context", "data", "pipe"],
     {"sharding": [[0, 4], [1, 5], [2, 6], [3, 7]], "model": [[0, 2], [1, 3], [4, 6], [5, 7]],
      "data": [[0, 1], [2, 3], [4, 5], [6, 7]]},
     [(0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (1, 1, 0, 0), (0, 0, 1, 0), (1, 0, 1, 0), (0, 1, 1, 0), (1, 1, 1, 0)]),
]


def _hcg_values(hybrid):
    fleet, h = _init(hybrid)
    topo = h.topology()
    names = topo.get_hybrid_group_names()
    coord = topo.get_coord(h.get_global_rank())
    sep = h.get_sep_parallel_world_size() > 1
    return {
        "names": list(names), "dims": [topo.get_dim(n) for n in names],
        "comm": {n: topo.get_comm_list(n) for n in names},
        "ranks": (h.get_data_parallel_rank(), h.get_model_parallel_rank(), h.get_sharding_parallel_rank(),
                  h.get_sep_parallel_rank()),
        "sizes": (h.get_data_parallel_world_size(), h.get_model_parallel_world_size(),
                  h.get_sharding_parallel_world_size(), h.get_sep_parallel_world_size(),
                  h.get_pipe_parallel_world_size(), h.get_stage_id()),
        "groups": (list(h.get_data_parallel_group().ranks), list(h.get_model_parallel_group().ranks),
                   list(h.get_sharding_parallel_group().ranks), h.get_data_parallel_group_src_rank(),
                   h.get_model_parallel_group_src_rank(), h.get_sharding_parallel_group_src_rank()),
        "sep_groups": (list(h.get_sep_parallel_group().ranks), list(h.get_dp_sep_parallel_group().ranks),
                       list(h.get_pp_mp_parallel_group().ranks)) if sep else None,
        "check": list(h.get_check_parallel_group().ranks),
        "rank_back": topo.get_rank(**coord._asdict()),  # every name, as Paddle's code passes them
        "mode": h.get_parallel_mode(),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", range(len(PADDLE_HCG)), ids=["dp2-mp2-sharding2", "dp2-mp2-sep2", "order"])
def test_hybrid_group_getters_and_topology_are_paddles(case):
    # Paddle's topology always has the sep and context axes (size 1 unless set): its names, coordinates and
    # comm lists name them, and its get_rank takes them; the topology had left them out
    hybrid, names, lines, per_rank = PADDLE_HCG[case]
    for rank, got in enumerate(run_ranks(_hcg_values, 8, hybrid, timeout=100)):
        dp = per_rank[rank][0]
        assert got["names"] == names and got["rank_back"] == rank
        for n in names:
            assert got["comm"][n] == lines.get(n, [[r] for r in range(8)]), n
        assert got["ranks"] == per_rank[rank]
        want_sizes = tuple(2 if any(len(x) > 1 for x in lines.get(a, [])) else 1
                           for a in ("data", "model", "sharding", "sep"))
        assert got["sizes"] == want_sizes + (1, 0) and got["mode"] == 1
        mine = {a: next(x for x in lines.get(a, [[rank]]) if rank in x) for a in ("data", "model", "sharding")}
        assert got["groups"] == (mine["data"], mine["model"], mine["sharding"], mine["data"][0], mine["model"][0],
                                 mine["sharding"][0])
        assert got["check"] == [r for r in range(8) if per_rank[r][0] == dp]  # the ranks of its dp index
        assert got["dims"] == [2 if n in lines else 1 for n in names]
        if case == 1:  # Paddle: sep [0, 2] ...; dp+sep fused [0, 2, 4, 6] / [1, 3, 5, 7]; pp+mp = the mp group
            assert got["sep_groups"] == ([r for r in (rank % 2, rank % 2 + 2, rank % 2 + 4, rank % 2 + 6)
                                          if (r >= 4) == (rank >= 4)],
                                         [rank % 2, rank % 2 + 2, rank % 2 + 4, rank % 2 + 6], mine["model"])


def test_strategy_takes_paddles_other_hybrid_configs_keys():
    from meshviz.distributed import fleet

    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"enable_optimizer_timer": False, "split_norm_comm": True, "sep_configs": {},
                        "cp_degree": 1, "ep_degree": 1, "order": ["dp", "pp", "sharding", "sep", "cp", "mp"]}
    assert s.hybrid_configs["split_norm_comm"] is True and s.hybrid_configs["moe_sharding_degree"] == 1
    with pytest.raises(ValueError, match="ep_degree.*only 1 is supported"):
        s.hybrid_configs = {"ep_degree": 2}


def test_strategy_hybrid_parallel_order_is_paddles():
    from meshviz.distributed import fleet

    s = fleet.DistributedStrategy()
    assert s.hybrid_parallel_order == ["dp", "pp", "sharding", "sep", "cp", "mp"]  # Paddle 3.3.1's default
    s.hybrid_parallel_order = ("mp", "pp", "sharding", "sep", "cp", "dp")
    assert s.hybrid_parallel_order == ["mp", "pp", "sharding", "sep", "cp", "dp"]
    assert s.hybrid_configs["order"] == s.hybrid_parallel_order  # one setting: the topology's order
    s.hybrid_configs = {"dp_degree": 2}  # no 'order': the attribute's stays
    assert s.hybrid_parallel_order == ["mp", "pp", "sharding", "sep", "cp", "dp"]
    s.hybrid_configs = {"mp_degree": 2, "order": ["mp", "dp", "pp", "sharding"]}  # as in Paddle, sets it
    assert s.hybrid_parallel_order == ["mp", "dp", "pp", "sharding"]
    for bad in (["dp", "mp"], ["dp", "dp", "pp", "sharding", "mp"], ["dp", "pp", "sharding", "mp", "ep"], "dp", 5):
        with pytest.raises(ValueError, match=r"hybrid_parallel_order must order dp, pp, sharding, mp"):
            s.hybrid_parallel_order = bad
    assert s.hybrid_parallel_order == ["mp", "dp", "pp", "sharding"]


def _init_with_order(order):
    import meshviz.distributed as dist
    from meshviz.distributed import fleet

    dist.init_parallel_env()
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"mp_degree": 2}  # dp_degree -1 -> 2
    if order is not None:
        s.hybrid_parallel_order = order
    fleet.init(is_collective=True, strategy=s)
    h = fleet.get_hybrid_communicate_group()
    return (list(h.topology().get_hybrid_group_names()), list(h.get_data_parallel_group().ranks),
            list(h.get_model_parallel_group().ranks))


@pytest.mark.timeout(120)
def test_fleet_init_lays_ranks_out_in_hybrid_parallel_order():
    # Paddle 3.3.1 (4 processes, dp 2, mp 2, this order): names [model, pipe, sharding, sep, context, data]; rank 1:
    # dp group [0, 1], mp group [1, 3]; rank 3: [2, 3], [1, 3]
    for r, got in enumerate(run_ranks(_init_with_order, 4, ["mp", "pp", "sharding", "sep", "cp", "dp"])):
        assert got == (["model", "pipe", "sharding", "sep", "context", "data"], [r // 2 * 2, r // 2 * 2 + 1],
                       [r % 2, r % 2 + 2])
    for r, got in enumerate(run_ranks(_init_with_order, 4, None)):  # the default: mp innermost
        assert got == (["data", "pipe", "sharding", "sep", "context", "model"], [r % 2, r % 2 + 2],
                       [r // 2 * 2, r // 2 * 2 + 1])
