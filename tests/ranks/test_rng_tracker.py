"""fleet.meta_parallel's RNG tracker on 4 ranks (dp 2 x mp 2): local seeds per tensor-parallel rank, one global seed."""

import torch

from meshviz.testing import run_ranks

SEED = 1234


def _mask(n=32):
    return (torch.nn.functional.dropout(torch.ones(n), 0.5) > 0).int().tolist()


def dropout_masks():
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import get_rng_state_tracker, model_parallel_random_seed

    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 2, "mp_degree": 2, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=s)
    hcg = fleet.get_hybrid_communicate_group()
    tracker = get_rng_state_tracker()

    def masks():
        with tracker.rng_state():
            local = _mask()
        dense = _mask()
        with tracker.rng_state():  # the tracker's state went on from where it stopped
            local_next = _mask()
        return local, dense, local_next

    model_parallel_random_seed(SEED)
    first = masks()
    model_parallel_random_seed(SEED)
    again = masks()
    errors = []
    for name, seed in (("model_parallel_rng", 99), ("other", SEED + 1 + hcg.get_model_parallel_rank())):
        try:
            tracker.add(name, seed)
        except ValueError as e:
            errors.append(str(e))
    return {"mp": hcg.get_model_parallel_rank(), "dp": hcg.get_data_parallel_rank(), "first": first,
            "again": again, "errors": errors, "names": sorted(tracker.get_states_tracker())}


def _expected(seed):
    torch.manual_seed(seed)
    a = _mask()
    b = _mask()
    return a, b


def test_dropout_masks_differ_across_tensor_parallel_ranks_and_agree_across_data_parallel():
    res = run_ranks(dropout_masks, 4, timeout=120)
    by = {(r["dp"], r["mp"]): r for r in res}
    assert set(by) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for r in res:
        local, dense, local_next = r["first"]
        # local seed = seed + 1 + mp_rank * pp_size + pp_rank (Paddle's formula); the global one is the seed
        assert (local, local_next) == _expected(SEED + 1 + r["mp"])
        assert dense == _expected(SEED)[0]
        assert r["again"] == r["first"]  # reproducible from the seed
        assert r["errors"] == ["state model_parallel_rng already exists", f"seed {SEED + 1 + r['mp']} already exists"]
        assert r["names"] == ["model_parallel_rng"]
    # sharded activations: a different mask on each tensor-parallel rank, the same across data-parallel ranks
    assert by[0, 0]["first"][0] != by[0, 1]["first"][0]
    assert by[0, 0]["first"][0] == by[1, 0]["first"][0] and by[0, 1]["first"][0] == by[1, 1]["first"][0]
    assert len({tuple(r["first"][1]) for r in res}) == 1


def test_tracker_keeps_the_global_state_untouched():
    from meshviz.distributed.fleet.meta_parallel import RNGStatesTracker

    tracker = RNGStatesTracker()
    torch.manual_seed(7)
    tracker.add("a", 11)
    with tracker.rng_state("a"):
        inside = torch.rand(3)
    outside = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(outside, torch.rand(3))
    torch.manual_seed(11)
    assert torch.equal(inside, torch.rand(3))
    saved = tracker.get_states_tracker()
    with tracker.rng_state("a"):
        nxt = torch.rand(3)
    tracker.set_states_tracker(saved)
    with tracker.rng_state("a"):
        assert torch.equal(nxt, torch.rand(3))
