"""Each multi-rank feature once on real gloo processes: a representative test of the ranks tier (which runs its
tests on thread ranks) run here as it is, with ``run_ranks`` starting processes. Collectives, reshard and
shard_tensor, the failure report naming the rank, DataParallel, fleet, group sharding, pipeline send/recv,
to_static, checkpoint, parallelize, ownership, the RNG tracker and the views of a traced run."""

import importlib
import inspect

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

CASES = [  # (module in tests/ranks, test function, its arguments)
    ("test_collective", "test_collectives_match_definitions", {}),
    ("test_collective", "test_bad_input_raises_on_every_rank", {}),
    # strided views and a scatter list holding the output went wrong on gloo only
    ("test_collective_audit", "test_seeded_sweep_matches_the_dense_truth_and_the_events_count_what_each_rank_receives",
     {}),
    ("test_collective_audit", "test_paddle_contracts_reduce_scatter_aliasing_outsiders_and_groups", {}),
    ("test_runtime", "test_co_shard_and_nd_blocks", {}),
    ("test_runtime", "test_a_raising_rank_is_named_and_nobody_hangs", {}),
    ("test_shard_api", "test_shard_layer_seed_003_demonet", {}),
    ("test_data_parallel", "test_data_parallel_matches_single_process", {}),
    ("test_fleet", "test_hybrid_dp2_mp2", {}),
    ("test_group_sharded", "test_levels_match_data_parallel", {"world": 2}),
    ("test_pipeline", "test_shared_layer_desc_with_data_parallel_and_recompute_matches_single_process", {}),
    ("test_to_static", "test_seed_demo_net_with_dist_tensor_weights_equals_eager", {}),
    ("test_checkpoint", "test_dist_tensors_reshard_on_load", {}),
    ("test_parallelize", "test_parallelize_llama_on_2_ranks_mp_sp_and_two_stages", {}),
    ("test_ownership", "test_shard_optimizer_and_group_sharding_emit_one_shape", {}),
    ("test_rng_tracker", "test_dropout_masks_differ_across_tensor_parallel_ranks_and_agree_across_data_parallel", {}),
    ("test_widgets_ranks", "test_views_draw_what_the_runtime_ran", {}),
]


@pytest.mark.parametrize("module,name,kwargs", CASES, ids=[f"{m[5:]}.{n[5:]}" for m, n, _ in CASES])
def test_on_gloo_processes(module, name, kwargs, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHVIZ_RANKS", "processes")
    test = getattr(importlib.import_module(f"tests.ranks.{module}"), name)
    if "tmp_path" in inspect.signature(test).parameters:
        kwargs = {**kwargs, "tmp_path": tmp_path}
    test(**kwargs)
