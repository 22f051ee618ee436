"""Checkpoint audit fixes: tuples saved element by element, rank-varying plain tensors refused, Paddle's keywords."""

import collections
import os

import pytest
import torch

from meshviz.testing import run_ranks

Pair = collections.namedtuple("Pair", "w n")
FULL = torch.arange(12.0).reshape(6, 2)


def _save_tuples(path, named):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1])
    if named:
        sd = {"nt": Pair(dist.shard_tensor(FULL, mesh, [dist.Shard(0)]), 4)}
    else:
        sd = {"tup": (dist.shard_tensor(FULL, mesh, [dist.Shard(0)]), torch.ones(2) * 5), "meta": ("a", 1),
              "deep": [(torch.full((2,), 7.0),)]}
    dist.save_state_dict(sd, path)


def _load_tuples(path, named):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1])
    target, plain = dist.shard_tensor(torch.zeros(6, 2), mesh, [dist.Replicate()]), torch.zeros(2)
    if named:
        sd = {"nt": Pair(target, 0)}
        dist.load_state_dict(sd, path)
        return type(sd["nt"]), sd["nt"].w is target, target._local_value().clone(), sd["nt"].n
    sd = {"tup": (target, plain), "meta": None, "deep": [(torch.zeros(2),)]}
    dist.load_state_dict(sd, path)
    t = sd["tup"]
    return {"tup": (type(t), t[0] is target, t[1] is plain, target._local_value().clone(), plain.clone()),
            "meta": sd["meta"], "deep": (type(sd["deep"][0]), sd["deep"][0][0].clone())}


@pytest.mark.timeout(120)
def test_tuple_holding_a_dist_tensor_is_saved_element_by_element_and_loaded_in_place(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(_save_tuples, 2, path, False)
    for out in run_ranks(_load_tuples, 2, path, False):
        kind, same, same_plain, block, plain = out["tup"]
        assert kind is tuple and same and same_plain
        assert torch.equal(block, FULL) and torch.equal(plain, torch.ones(2) * 5)  # the Replicate target: all rows
        assert out["meta"] == ("a", 1)  # a tuple without tensors is one value
        assert out["deep"][0] is tuple and torch.equal(out["deep"][1], torch.full((2,), 7.0))


@pytest.mark.timeout(120)
def test_namedtuple_holding_a_dist_tensor_is_saved_and_given_back_as_one(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(_save_tuples, 2, path, True)
    for kind, same, block, n in run_ranks(_load_tuples, 2, path, True):
        assert kind is Pair and same and torch.equal(block, FULL) and n == 4


def _save_varying(path, same_shape):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    sd = {"same": torch.ones(2), "v": torch.full((3,) if same_shape else (3 + r,), float(r))}
    with pytest.raises(ValueError, match="differ across ranks") as info:
        dist.save_state_dict(sd, path)
    return str(info.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("same_shape", [True, False])
def test_plain_tensor_differing_across_ranks_is_refused(tmp_path, same_shape):
    path = str(tmp_path / "ck")
    msgs = run_ranks(_save_varying, 2, path, same_shape)
    assert msgs[0] == msgs[1] and "'v'" in msgs[0] and "'same'" not in msgs[0] and "torch.save" in msgs[0]
    assert ("[3] on rank 0, [4] on rank 1" in msgs[0]) != same_shape
    assert not os.path.exists(path)  # nothing written


def _group_sharded_os(path):
    import torch.nn.functional as F

    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel

    dist.init_parallel_env()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model, opt, _ = group_sharded_parallel(model, torch.optim.AdamW(model.parameters(), lr=0.1), "os")
    F.mse_loss(model(torch.full((2, 3), float(dist.get_rank()))), torch.zeros(2, 2)).backward()
    opt.step()
    with pytest.raises(ValueError, match="differ across ranks") as info:
        dist.save_state_dict(opt.state_dict(), path)
    return str(info.value)


@pytest.mark.timeout(120)
def test_group_sharded_optimizer_states_are_refused(tmp_path):
    path = str(tmp_path / "ck")
    msgs = run_ranks(_group_sharded_os, 2, path)
    assert msgs[0] == msgs[1] and "'state." in msgs[0] and "p_g_os" in msgs[0]
    assert not os.path.exists(path)


def _unshard():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1])
    with pytest.raises(ValueError, match="should be a distributed tensor"):
        dist.unshard_dtensor(torch.ones(2))
    p = dist.shard_tensor(torch.nn.Parameter(FULL.clone()), mesh, [dist.Shard(0)])
    full = dist.unshard_dtensor(p)
    return type(full), isinstance(full, torch.nn.Parameter), full.requires_grad, full.detach().clone()


@pytest.mark.timeout(60)
def test_unshard_dtensor_refuses_a_plain_tensor_and_keeps_a_parameter():
    for _, is_param, grad, value in run_ranks(_unshard, 2):
        assert is_param and grad and torch.equal(value, FULL)


def _keywords(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = dist.get_rank()
    mesh = dist.ProcessMesh([0, 1])
    errors = []
    for kw, kind in (({"safetensors": r == 1}, NotImplementedError), ({"save_replicas": True}, NotImplementedError)):
        with pytest.raises(kind, match=next(iter(kw))):  # also on rank 0, which passed the default
            dist.save_state_dict({"a": torch.ones(2)}, path, **kw)
        errors.append(os.path.exists(path))
    dist.save_state_dict({"a": dist.shard_tensor(FULL, mesh, [dist.Shard(0)])}, path, safetensors=False,
                         save_replicas=False)
    target = dist.shard_tensor(torch.zeros(6, 2), mesh, [dist.Shard(1)])
    for kw, kind in (({"aoa_config": {"a": ["b"]}}, NotImplementedError), ({"safetensors": True}, NotImplementedError),
                     ({"comm_method": "carrier_pigeon" if r == 0 else "broadcast"}, ValueError)):
        with pytest.raises(kind, match=next(iter(kw))):
            dist.load_state_dict({"a": target}, path, **kw)
    errors.append(target._local_value().abs().sum().item())  # nothing read
    dist.load_state_dict({"a": target}, path, offload=False, mw_name_compatibility=False, aoa_config=None,
                         safetensors=False, worker_groups=None, comm_method="send_recv")
    return errors, target._local_value().clone()


@pytest.mark.timeout(120)
def test_paddle_keywords_accepted_or_refused_on_every_rank(tmp_path):
    path = str(tmp_path / "ck")
    for r, (errors, block) in enumerate(run_ranks(_keywords, 2, path)):
        assert errors == [False, False, 0.0]
        assert torch.equal(block, FULL[:, r:r + 1])
