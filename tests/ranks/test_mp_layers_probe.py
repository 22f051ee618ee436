"""fleet tensor parallelism against the dense truth: out-of-vocabulary ids, layers on a one-rank mp group, Paddle's
``mp_ops`` names, the sharding check group, the sep fused groups and the hybrid group's asserting getters."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshviz.testing import run_ranks

V, D = 8, 3


def _init(**hybrid):
    from meshviz.distributed import fleet

    s = fleet.DistributedStrategy()
    s.hybrid_configs = hybrid
    fleet.init(is_collective=True, strategy=s)
    return fleet.get_hybrid_communicate_group()


def _outcome(fn):
    try:
        return fn()
    except (IndexError, TypeError, ValueError, AssertionError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"


def embedding_lookup(mp, ids):
    from meshviz.distributed.fleet import meta_parallel as mpu

    r = _init(dp_degree=1, mp_degree=mp).get_model_parallel_rank()
    torch.manual_seed(3)
    emb = mpu.VocabParallelEmbedding(V, D)

    def run():
        y = emb(ids)
        (y * y).sum().backward()
        return y.detach(), emb.weight.grad

    return r, _outcome(run)


@pytest.mark.parametrize("bad", [V, -1])
def test_vocab_parallel_embedding_rejects_ids_outside_the_vocabulary_on_every_rank(bad):
    with pytest.raises(IndexError):
        nn.Embedding(V, D)(torch.tensor([1, bad]))
    for _, out in run_ranks(embedding_lookup, 2, 2, torch.tensor([1, bad]), timeout=120):
        assert out == f"IndexError: id {bad} is out of bounds for a vocabulary of {V} (ids must be in [0, {V}))"


@pytest.mark.parametrize("mp", [2, 4])
def test_vocab_parallel_embedding_edges_and_int32_3d_ids_match_nn_embedding(mp):
    ids = torch.tensor([[[0, V // 2 - 1], [V // 2, V - 1]], [[1, 1], [6, 3]]], dtype=torch.int32)
    torch.manual_seed(3)
    dense = nn.Embedding(V, D)
    y = dense(ids)
    (y * y).sum().backward()
    for r, (got, grad) in run_ranks(embedding_lookup, mp, mp, ids, timeout=120):
        torch.testing.assert_close(got, y.detach())
        torch.testing.assert_close(grad, dense.weight.grad.chunk(mp, 0)[r])


def one_rank_mp_group():
    from meshviz.distributed.fleet import meta_parallel as mpu

    _init(dp_degree=2, mp_degree=1)
    torch.manual_seed(5)
    col = mpu.ColumnParallelLinear(4, 6, has_bias=True, gather_output=False)
    row = mpu.RowParallelLinear(6, 4, input_is_parallel=True)
    emb = mpu.VocabParallelEmbedding(V, 4)
    x = torch.arange(8.0).reshape(2, 4) / 8
    marks = [(p.is_distributed, hasattr(p, "split_axis")) for p in (col.weight, col.bias, row.weight, emb.weight)]
    bad_attr = _outcome(lambda: mpu.VocabParallelEmbedding(V, 4, weight_attr="normal"))
    return (col.is_mp, row.is_mp, emb.is_mp), marks, row(col(x)).detach(), emb(torch.tensor([0, 7])).detach(), \
        _outcome(lambda: emb(torch.tensor([V]))), bad_attr


def test_layers_on_a_one_rank_mp_group_are_plain_unmarked_layers():
    torch.manual_seed(5)
    col, row, emb = nn.Linear(4, 6), nn.Linear(6, 4), nn.Embedding(V, 4)
    x = torch.arange(8.0).reshape(2, 4) / 8
    for is_mp, marks, y, e, oob, bad_attr in run_ranks(one_rank_mp_group, 2, timeout=120):
        assert is_mp == (False, False, False)
        assert marks == [(False, False)] * 4  # Paddle: is_distributed False, no split_axis, when mp is 1
        torch.testing.assert_close(y, row(col(x)).detach())
        torch.testing.assert_close(e, emb(torch.tensor([0, 7])).detach())
        assert oob.startswith("IndexError")
        assert bad_attr == "TypeError: weight_attr must be None or an init function taking the full weight tensor"


def marks_under_mp():
    from meshviz.distributed.fleet import meta_parallel as mpu

    _init(dp_degree=1, mp_degree=2)
    col = mpu.ColumnParallelLinear(4, 6, has_bias=True)
    row = mpu.RowParallelLinear(6, 4)
    emb = mpu.VocabParallelEmbedding(V, 4)
    return [(p.is_distributed, getattr(p, "split_axis", None)) for p in (col.weight, col.bias, row.weight,
                                                                         emb.weight)], \
        (col.is_mp, row.is_mp, emb.is_mp), hasattr(row.bias, "split_axis")


def test_layers_under_mp_mark_their_split_parameters():
    for marks, is_mp, row_bias_split in run_ranks(marks_under_mp, 2, timeout=120):
        assert marks == [(True, 0), (True, 0), (True, 1), (True, 0)] and is_mp == (True, True, True)
        assert not row_bias_split


G = torch.Generator().manual_seed(7)
X = torch.randn(3, 8, generator=G)
GY = torch.randn(3, 8, generator=G)
TABLE = torch.randn(V, D, generator=G)
LOGITS = torch.randn(2, 3, 8, generator=G) * 3
LABELS = torch.tensor([[0, 7, -100], [3, 4, 5]])


def paddle_named_ops():
    from meshviz.distributed.fleet.meta_parallel import mp_ops

    hcg = _init(dp_degree=1, mp_degree=2)
    r, group = hcg.get_model_parallel_rank(), hcg.get_model_parallel_group()
    out = {}
    x = X.clone().requires_grad_()
    y = mp_ops._c_concat(mp_ops._c_identity(x, group=group)[:, 4 * r:4 * r + 4] * 2, group=group)
    (y * GY).sum().backward()  # every rank the same upstream gradient, as after a gathered output
    out["identity_concat"] = (y.detach(), x.grad)
    x = X.clone().requires_grad_()
    y = mp_ops._mp_allreduce(mp_ops._c_split(x, group=group) ** 2, group=group)
    (y * GY[:, :4]).sum().backward()
    out["split_allreduce"] = (y.detach(), x.grad)
    table = TABLE[4 * r:4 * r + 4].clone().requires_grad_()
    ids = torch.tensor([0, 3, 4, 7, 4])
    part = mp_ops._c_lookup_table(table, ids, start_index=4 * r, vocab_size=V)
    part.sum().backward()
    out["lookup"] = (mp_ops._mp_allreduce(part.detach(), group=group), table.grad)
    out["lookup_oob"] = _outcome(lambda: mp_ops._c_lookup_table(table, torch.tensor([8]), 4 * r, vocab_size=V))
    out["lookup_unchecked"] = mp_ops._c_lookup_table(table.detach(), torch.tensor([8, -1, 4 * r]), 4 * r)
    logits = LOGITS[..., 4 * r:4 * r + 4].clone().requires_grad_()
    loss, softmax = mp_ops._c_softmax_with_cross_entropy(logits, LABELS, group=group, return_softmax=True)
    kept = softmax.clone()
    softmax.zero_()  # the caller's own tensor: the backward does not read it
    loss.sum().backward()
    out["ce"] = (loss.detach(), kept, logits.grad, softmax.requires_grad)
    out["allreduce_max"] = _outcome(lambda: mp_ops._mp_allreduce(X, op="max", group=group))
    out["float_label"] = _outcome(lambda: mp_ops._c_softmax_with_cross_entropy(logits, LABELS.clamp(min=0) + 0.7))
    return r, out


def test_paddles_mp_ops_names_against_the_dense_ops():
    r_out = run_ranks(paddle_named_ops, 2, timeout=120)
    x = X.clone().requires_grad_()
    y = x * 2
    (y * GY).sum().backward()
    gx_concat = x.grad
    table_grad = torch.zeros(V, D)
    table_grad.index_add_(0, torch.tensor([0, 3, 4, 7, 4]), torch.ones(5, D))
    logits = LOGITS.clone().requires_grad_()
    want_loss = F.cross_entropy(logits.reshape(-1, 8), LABELS.reshape(-1), reduction="none").reshape(2, 3, 1)
    want_loss.sum().backward()
    for r, out in r_out:
        cols = slice(4 * r, 4 * r + 4)
        y, gx = out["identity_concat"]
        torch.testing.assert_close(y, X * 2)
        torch.testing.assert_close(gx, gx_concat)  # c_identity's backward sums the ranks' column blocks' gradients
        y, gx = out["split_allreduce"]
        torch.testing.assert_close(y, X[:, :4] ** 2 + X[:, 4:] ** 2)
        want_gx = torch.zeros(3, 8)
        want_gx[:, :4], want_gx[:, 4:] = 2 * X[:, :4] * GY[:, :4], 2 * X[:, 4:] * GY[:, :4]
        torch.testing.assert_close(gx, want_gx)  # c_split's backward gathers every rank's block
        looked, tgrad = out["lookup"]
        torch.testing.assert_close(looked, TABLE[[0, 3, 4, 7, 4]])
        torch.testing.assert_close(tgrad, table_grad[cols])
        assert out["lookup_oob"] == f"IndexError: id 8 is out of bounds for a vocabulary of {V} (ids must be in " \
                                    f"[0, {V}))"
        torch.testing.assert_close(out["lookup_unchecked"], torch.stack([torch.zeros(D), torch.zeros(D),
                                                                         TABLE[4 * r]]))
        loss, softmax, glogits, sm_grad = out["ce"]
        torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(softmax, LOGITS.softmax(-1)[..., cols], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(glogits, logits.grad[..., cols], rtol=1e-5, atol=1e-6)
        assert sm_grad is False
        assert out["allreduce_max"] == "ValueError: _mp_allreduce: only ReduceOp.SUM is supported, got max"
        assert out["float_label"] == "TypeError: label must hold integer class ids (int32 or int64), got torch.float32"


def hybrid_groups(hybrid):
    hcg = _init(**hybrid)
    ranks = {}
    for name, get in [("check", hcg.get_check_parallel_group), ("sep", hcg.get_sep_parallel_group),
                      ("dp_sep", hcg.get_dp_sep_parallel_group), ("pp_mp", hcg.get_pp_mp_parallel_group),
                      ("sharding_check", lambda: hcg.get_check_parallel_group(sharding=True)),
                      ("next", hcg._get_p2p_next_rank)]:
        got = _outcome(get)
        ranks[name] = got if isinstance(got, (str, int)) else list(got.ranks)
    ranks["sep_src"] = _outcome(hcg.get_sep_parallel_group_src_rank)
    ranks["fused_lines"] = getattr(hcg, "_dp_sep_group", None), getattr(hcg, "_pp_mp_group", None)
    return ranks


def _mine(lines, r):
    return next(line for line in lines if r in line)


# expected rank lists: Paddle 3.3.1's CommunicateTopology (get_axis_list / get_fused_ranks, sorted as its
# create_fuse_group sorts them) for the same names and degrees
CASES = {
    "dp2_sep2_mp2_sep_outermost": (
        {"dp_degree": 2, "sep_degree": 2, "mp_degree": 2, "order": ["sep", "dp", "pp", "sharding", "mp"]},
        {"check": [[0, 1, 4, 5], [2, 3, 6, 7]], "dp_sep": [[0, 4, 2, 6], [1, 5, 3, 7]],
         "pp_mp": [[0, 1], [2, 3], [4, 5], [6, 7]], "sep": [[0, 4], [1, 5], [2, 6], [3, 7]]}),
    "pp2_sep2_mp2": (
        {"dp_degree": 1, "pp_degree": 2, "sep_degree": 2, "mp_degree": 2},
        {"check": [list(range(8))], "dp_sep": [[0, 2], [1, 3], [4, 6], [5, 7]],
         "pp_mp": [[0, 1, 4, 5], [2, 3, 6, 7]], "sep": [[0, 2], [1, 3], [4, 6], [5, 7]]}),
    "sharding2_sep2_mp2": (
        {"dp_degree": 1, "sharding_degree": 2, "sep_degree": 2, "mp_degree": 2},
        {"check": [list(range(8))], "sharding_check": [[0, 1, 2, 3], [4, 5, 6, 7]],
         "sep": [[0, 2], [1, 3], [4, 6], [5, 7]]}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_check_and_fused_groups_are_paddles(case):
    hybrid, want = CASES[case]
    for r, got in enumerate(run_ranks(hybrid_groups, 8, hybrid, timeout=200)):
        for name, lines in want.items():  # a group's ranks are sorted (Paddle's new_group sorts them)
            assert got[name] == sorted(_mine(lines, r)), (r, name)
        if "dp_sep" in want:  # the rank lists themselves keep Paddle's fused order
            assert got["fused_lines"] == (_mine(want["dp_sep"], r), _mine(want["pp_mp"], r))
        assert got["sep_src"] == _mine(want["sep"], r)[0]
        if "sharding_check" not in want:
            assert got["sharding_check"] == "AttributeError: no sharding check group: sharding_degree is 1"
        if "pp2" not in case:
            assert got["next"] == "AssertionError: next_rank has not been inited (pp_degree is 1: no pipeline " \
                                  "neighbours)"


def test_sep_getters_assert_when_there_is_no_sep_axis():
    for r, got in enumerate(run_ranks(hybrid_groups, 2, {"dp_degree": 2}, timeout=120)):
        for name in ("sep", "dp_sep", "pp_mp", "sep_src"):
            assert got[name] == "AssertionError: sep not exist (sep_degree is 1)"
        assert got["check"] == [r]  # the ranks with this rank's dp index


class MPNet(nn.Module):
    def __init__(self, bias):
        from meshviz.distributed.fleet import meta_parallel as mpu

        super().__init__()
        torch.manual_seed(0)
        self.emb = mpu.VocabParallelEmbedding(12, 4)
        self.up = mpu.ColumnParallelLinear(4, 8, has_bias=bias, gather_output=False)
        self.down = mpu.RowParallelLinear(8, 4, has_bias=bias, input_is_parallel=True)
        self.head = mpu.ColumnParallelLinear(4, 12, has_bias=True, gather_output=False)
        self.ce = mpu.ParallelCrossEntropy()

    def forward(self, ids, labels):
        return self.ce(self.head(self.down(torch.tanh(self.up(self.emb(ids))))), labels)


class DenseNet(nn.Module):
    def __init__(self, bias):
        super().__init__()
        torch.manual_seed(0)  # the same draws as MPNet's full weights
        self.emb, self.up = nn.Embedding(12, 4), nn.Linear(4, 8, bias=bias)
        self.down, self.head = nn.Linear(8, 4, bias=bias), nn.Linear(4, 12)

    def forward(self, ids, labels):
        logits = self.head(self.down(torch.tanh(self.up(self.emb(ids)))))
        loss = F.cross_entropy(logits.reshape(-1, 12), labels.reshape(-1), reduction="none")
        return loss.reshape(labels.shape + (1,))


SPLIT = {"emb.weight": 0, "up.weight": 0, "up.bias": 0, "down.weight": 1, "head.weight": 0, "head.bias": 0}


def _batch(step, dp_rank):
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    ids, labels = torch.randint(0, 12, (2, 5), generator=g), torch.randint(0, 12, (2, 5), generator=g)
    ids[1] = torch.tensor([0, 2, 3, 6, 11])  # the shard edges of 12 over 4 ranks
    labels[0, 0] = -100
    return ids, labels


def mp_training(hybrid, bias):
    from meshviz.distributed import fleet

    hcg = _init(**hybrid)
    model = fleet.distributed_model(MPNet(bias))
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    for step in range(3):
        model(*_batch(step, hcg.get_data_parallel_rank())).mean().backward()
        opt.step()
        opt.clear_grad()
    return hcg.get_model_parallel_rank(), {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("hybrid,world", [({"dp_degree": 1, "mp_degree": 4}, 4),
                                          ({"dp_degree": 2, "mp_degree": 2}, 4)], ids=["mp4", "dp2xmp2"])
@pytest.mark.parametrize("bias", [True, False])
def test_three_adam_steps_match_the_dense_model(hybrid, world, bias):
    dp, mp = hybrid["dp_degree"], hybrid["mp_degree"]
    dense = DenseNet(bias)
    opt = torch.optim.Adam(dense.parameters(), lr=0.1)
    for step in range(3):
        (sum(dense(*_batch(step, d)).mean() for d in range(dp)) / dp).backward()
        opt.step()
        opt.zero_grad()
    for mp_rank, state in run_ranks(mp_training, world, hybrid, bias, timeout=200):
        assert set(state) == set(dense.state_dict())
        for name, full in dense.state_dict().items():
            want = full if name not in SPLIT else full.chunk(mp, SPLIT[name])[mp_rank]
            torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def tracker_dropout_masks():
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import get_rng_state_tracker

    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 2, "mp_degree": 2}
    s.tensor_parallel_configs = {"tensor_init_seed": 77}
    fleet.init(is_collective=True, strategy=s)
    hcg = fleet.get_hybrid_communicate_group()
    x = torch.ones(64)
    dense = F.dropout(x, 0.5)
    with get_rng_state_tracker().rng_state():
        local = F.dropout(x, 0.5)
    return hcg.get_data_parallel_rank(), hcg.get_model_parallel_rank(), dense, local


def test_tracker_dropout_differs_over_mp_and_agrees_over_dp():
    outs = run_ranks(tracker_dropout_masks, 4, timeout=120)
    for _, mp, dense, local in outs:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(77)  # the global seed, the same on every rank
            torch.testing.assert_close(dense, F.dropout(torch.ones(64), 0.5))
            torch.manual_seed(77 + 1 + mp)  # model_parallel_rng: seed + 1 + mp_rank * pp_size + pp_rank
            torch.testing.assert_close(local, F.dropout(torch.ones(64), 0.5))
    by_coord = {(dp, mp): local for dp, mp, _, local in outs}
    assert torch.equal(by_coord[0, 0], by_coord[1, 0]) and not torch.equal(by_coord[0, 0], by_coord[0, 1])
