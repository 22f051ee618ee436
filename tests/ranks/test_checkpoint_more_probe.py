"""Checkpoint probes: dtypes other than the saved ones, blocks that ranks hold differently, more saved layouts."""

import os

import pytest
import torch

from meshviz.testing import run_ranks

FULL = torch.arange(30.0).reshape(10, 3) - 11.5  # halves: a cast to int64 would truncate them


def _local(v):
    return v._local_value().detach().clone() if hasattr(v, "_local_value") else v.detach().clone()


# -- a dtype other than the saved one: one error on every rank before anything is read (DCP would cast silently) -------


def _save_dtypes(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([1, 0])
    dist.save_state_dict({"w": dist.shard_tensor(FULL, mesh, [dist.Shard(0)]), "n": torch.arange(4),
                          "h": dist.shard_tensor(FULL.bfloat16(), mesh, [dist.Replicate()])}, path)


def _load_dtypes(path, dtypes):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([2, 0, 1])
    sd = {"w": dist.shard_tensor(torch.zeros(10, 3, dtype=dtypes["w"]), mesh, [dist.Shard(0)]),
          "n": torch.zeros(4, dtype=dtypes["n"]),
          "h": dist.shard_tensor(torch.zeros(10, 3, dtype=dtypes["h"]), mesh, [dist.Shard(1)])}
    try:
        dist.load_state_dict(sd, path)
    except ValueError as e:
        return str(e), {k: _local(v) for k, v in sd.items()}
    return None, {k: _local(v) for k, v in sd.items()}


@pytest.mark.timeout(60)
def test_a_dtype_other_than_the_saved_one_raises_on_every_rank_before_reading(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(_save_dtypes, 2, path)
    wrong = {"w": torch.int64, "n": torch.float32, "h": torch.float32}
    for rank, (err, got) in enumerate(run_ranks(_load_dtypes, 3, path, wrong)):
        assert err is not None and err.startswith("load_state_dict: the state_dict's tensors have other dtypes"), err
        assert "h (saved torch.bfloat16, here torch.float32), n (saved torch.int64, here torch.float32), " \
               "w (saved torch.float32, here torch.int64)" in err
        assert all(not v.any() for v in got.values()), (rank, got)  # nothing read
    right = {"w": torch.float32, "n": torch.int64, "h": torch.bfloat16}
    for rank, (err, got) in enumerate(run_ranks(_load_dtypes, 3, path, right)):
        rows = {2: slice(0, 4), 0: slice(4, 8), 1: slice(8, 10)}[rank]  # [2, 0, 1]: ceil blocks 4, 4, 2
        assert err is None and torch.equal(got["w"], FULL[rows]) and torch.equal(got["n"], torch.arange(4))
        col = {2: 0, 0: 1, 1: 2}[rank]
        assert got["h"].dtype == torch.bfloat16 and torch.equal(got["h"], FULL.bfloat16()[:, col:col + 1])


# -- ranks that hold one block of a key with different values: refused before anything is written --------------------


def _save_clash(path, case):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    rank = dist.get_rank()
    stage = rank // 2
    meshes = [dist.ProcessMesh([0, 1]), dist.ProcessMesh([2, 3])]
    if case == "stages":  # two pipeline stages that both name their first layer's weight "layers.0.weight"
        sd = {"layers": {"0": {"weight": dist.shard_tensor(FULL + 100 * stage, meshes[stage], [dist.Shard(0)])}}}
    elif case == "tied":  # one weight on both stages, equal values: one copy is right
        sd = {"layers": {"0": {"weight": dist.shard_tensor(FULL, meshes[stage], [dist.Shard(0)])}}}
    else:  # Replicate from unequal local values: not replicated
        full = dist.ProcessMesh([0, 1, 2, 3])
        sd = {"layers": {"0": {"weight": dist.dtensor_from_local(FULL + rank, full, [dist.Replicate()])}}}
    try:
        dist.save_state_dict(sd, path)
    except ValueError as e:
        return str(e)
    return None


def _load_one(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    sd = {"layers": {"0": {"weight": torch.zeros(10, 3)}}}
    dist.load_state_dict(sd, path)
    return sd["layers"]["0"]["weight"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case, words", [
    ("stages", "under 'layers.0.weight' (values differ: the block at [0, 0], ranks [0, 2]), 'layers.0.weight' "
               "(values differ: the block at [5, 0], ranks [1, 3]); a checkpoint keeps one copy of each block"),
    ("replicate", "under 'layers.0.weight' (values differ: the block at [0, 0], ranks [0, 1, 2, 3]); a checkpoint"),
], ids=["stages", "replicate"])
def test_a_block_that_ranks_hold_with_different_values_is_refused(tmp_path, case, words):
    path = str(tmp_path / "ck")
    run_ranks(_save_clash, 4, path, "tied")  # the directory already holds a checkpoint
    assert os.path.exists(os.path.join(path, ".metadata"))
    msgs = run_ranks(_save_clash, 4, path, case)
    assert len(set(msgs)) == 1 and msgs[0].startswith("save_state_dict: dist tensors' blocks differ across the ranks")
    assert words in msgs[0], msgs[0]
    assert torch.equal(run_ranks(_load_one, 1, path)[0], FULL)  # the checkpoint there is left as it was


@pytest.mark.timeout(60)
def test_a_weight_tied_across_stages_with_equal_values_is_saved_once(tmp_path):
    path = str(tmp_path / "ck")
    assert run_ranks(_save_clash, 4, path, "tied") == [None] * 4
    assert torch.equal(run_ranks(_load_one, 1, path)[0], FULL)


# -- more saved layouts: Partial MAX / AVG on a 2-D mesh, dtensor_from_local Partial, bool, empty; loaded 4 -> 1, 2 ----


def _save_more(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    rank = dist.get_rank()
    m2 = dist.ProcessMesh([[3, 1], [0, 2]])
    sd = {"max": dist.shard_tensor(FULL, m2, [dist.Partial(dist.ReduceType.kRedMax), dist.Shard(0)]),
          "avg": dist.shard_tensor(FULL, m2, [dist.Shard(1), dist.Partial(dist.ReduceType.kRedAvg)]),
          "sum": dist.dtensor_from_local(torch.full((5, 3), float(rank)), m2, [dist.Shard(0), dist.Partial()]),
          "mask": dist.shard_tensor(FULL > 0, m2, [dist.Shard(0), dist.Shard(0)]),
          "empty": dist.shard_tensor(torch.zeros(0, 3, dtype=torch.int64), m2, [dist.Shard(1), dist.Replicate()])}
    dist.save_state_dict(sd, path)


def _load_more(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh(list(range(dist.get_world_size())))
    sd = {"max": dist.shard_tensor(torch.zeros(10, 3), mesh, [dist.Shard(0)]), "avg": torch.zeros(10, 3),
          "sum": dist.shard_tensor(torch.zeros(10, 3), mesh, [dist.Shard(1)]),
          "mask": dist.shard_tensor(torch.zeros(10, 3, dtype=torch.bool), mesh, [dist.Replicate()]),
          "empty": torch.zeros(0, 3, dtype=torch.int64)}
    dist.load_state_dict(sd, path)
    return {k: _local(v) for k, v in sd.items()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [1, 2])
def test_partial_bool_and_empty_saved_on_a_2d_mesh_load_into_other_worlds(tmp_path, world):
    path = str(tmp_path / "ck")
    run_ranks(_save_more, 4, path)
    # "sum": rows 0-4 are rows [3, 1] of the mesh summed (3 + 1), rows 5-9 [0, 2] (0 + 2)
    summed = torch.cat([torch.full((5, 3), 4.0), torch.full((5, 3), 2.0)])
    for rank, got in enumerate(run_ranks(_load_more, world, path)):
        rows = slice(5 * rank, 5 * rank + 5) if world == 2 else slice(0, 10)
        cols = slice(2 * rank, min(2 * rank + 2, 3)) if world == 2 else slice(0, 3)
        assert torch.equal(got["max"], FULL[rows]) and torch.equal(got["avg"], FULL)
        assert torch.equal(got["sum"], summed[:, cols]) and torch.equal(got["mask"], FULL > 0)
        assert got["empty"].shape == (0, 3)


# -- a group of some ranks (process_group): errors name the ranks by their global numbers ----------------------------


def _group_errors(path):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    stage, out = rank // 2, []
    where = f"{path}/s{stage}"
    for sd in ([] if rank == 3 else {"x": torch.ones(1)}, {"x": torch.ones(1 + rank % 2)}):
        try:
            dist.save_state_dict(sd, where, process_group=groups[stage])
        except (TypeError, ValueError) as e:
            out.append(str(e))
    dist.save_state_dict({"x": torch.ones(1)}, where, process_group=groups[stage])
    try:
        dist.load_state_dict({"x": torch.zeros(1), **({"y": torch.zeros(1)} if rank % 2 else {})}, where,
                             process_group=groups[stage])
    except RuntimeError as e:
        out.append(str(e))
    return out


@pytest.mark.timeout(60)
def test_errors_in_a_process_group_name_global_ranks(tmp_path):
    path = str(tmp_path / "ck")
    res = run_ranks(_group_errors, 4, path)
    assert res[0] == res[1] and res[2] == res[3]
    stage0, stage1 = res[0], res[2]
    assert stage1[0] == "save_state_dict: state_dict must be a dict, got list (rank 3)"
    assert "'x' (shapes [1] on rank 0, [2] on rank 1)" in stage0[0]
    assert "'x' (shapes [1] on rank 2, [2] on rank 3)" in stage1[1]
    assert stage0[1].endswith("Missing key in checkpoint state_dict: y. (rank 1)")
    assert stage1[2].endswith("Missing key in checkpoint state_dict: y. (rank 3)")


# -- save_group_sharded_model: a write that fails on the group's first rank raises on every rank -----------------------


def _save_sharded_model(out):
    import meshviz.distributed as dist
    from meshviz.distributed.sharding import group_sharded_parallel, save_group_sharded_model

    dist.init_parallel_env()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model, opt, _ = group_sharded_parallel(model, torch.optim.AdamW(model.parameters()), "os_g")
    try:
        save_group_sharded_model(model, out, opt)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.timeout(60)
def test_save_group_sharded_model_that_cannot_write_raises_on_every_rank(tmp_path):
    (tmp_path / "a_file").write_text("x")
    out = str(tmp_path / "a_file" / "model")  # under a file: no directory can be made there
    msgs = run_ranks(_save_sharded_model, 2, out)
    assert msgs[0] == msgs[1], msgs  # not the writer alone, with the other rank left waiting for it
    assert msgs[0].startswith(f"NotADirectoryError: save_group_sharded_model: rank 0 could not write {out!r}: ")
    assert run_ranks(_save_sharded_model, 2, str(tmp_path / "ok")) == [None, None]
    torch.manual_seed(0)
    want = torch.nn.Linear(3, 2).state_dict()
    got = torch.load(str(tmp_path / "ok" / "model.pdmodel"))
    assert all(torch.equal(got[k], want[k]) for k in want)
