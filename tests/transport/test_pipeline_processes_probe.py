"""A pipeline stage that raises on a gloo rank process, which catches its error and goes on, stops the stages waiting
on it at once, naming it, and a later collective with them says why it cannot run (not a hang, not a gloo error)."""

import functools
import time

import pytest
import torch

from meshviz.testing import run_ranks

from ..ranks.test_pipeline_errors_edge_probe import BAD, _caught, _fleet

pytestmark = pytest.mark.timeout(60)
TIMEOUT = 30  # the collective timeout: every wait below must end well before it
HOLD = 15  # seconds the failing rank goes on (waits for the others' word) after catching its error


def _then(done, fn):
    """``fn()`` caught; then a later all-reduce over the world, caught. The last rank (the failing stage) then waits
    (up to HOLD s) until every other rank is done, as a script or a notebook going on after a caught error:
    the other stages must not wait for it."""
    import meshviz.distributed as dist

    got = fn()
    later = _caught(lambda: dist.all_reduce(torch.ones(2)))
    me, n = dist.get_rank(), dist.get_world_size()
    if me == n - 1:
        t0 = time.monotonic()
        while time.monotonic() - t0 < HOLD and not all((done / str(r)).exists() for r in range(n - 1)):
            time.sleep(0.05)
    else:
        (done / str(me)).write_text("done")
    return got, later


def _expect(got, stage, error, took=6.0):
    *others, (last, last_later) = got
    name, msg, secs = last
    assert f"{name}: {msg}".startswith(error), last
    assert secs < took, last
    for rank, ((name, msg, secs), _) in enumerate(others):
        assert secs < took, (rank, secs, msg)  # on HEAD: until the failing rank ends (HOLD s), or the timeout
        assert name == "RankStopped", (rank, name, msg)
        assert f"(pipeline stage {stage} (rank {len(got) - 1}) raised {error}" in msg, (rank, msg)
    for rank, (_, (name, msg, secs)) in enumerate(got):
        # on HEAD: the failing rank's all-reduce raises gloo's bare "Connection closed by peer" (or waits)
        assert name == "RuntimeError" and secs < took, (rank, name, msg)
        assert "were closed after pipeline stage" in msg and f"(rank {len(got) - 1}) raised {error}" in msg, (rank, msg)


def test_a_caught_loss_error_on_the_last_gloo_stage_stops_the_first_at_once_naming_it(tmp_path):
    """2 stages 1F1B, a class id out of range in the last micro-batch: the first stage waits for a gradient the
    last stage will never send."""
    got = run_ranks(_then, 2, tmp_path, functools.partial(_fleet, "1F1B", 2, 4), timeout=50,
                    collective_timeout=TIMEOUT)
    _expect(got, 1, BAD)


def test_a_caught_loss_error_in_a_gloo_eval_batch_stops_the_loss_broadcast_naming_it(tmp_path):
    """eval_batch: the first stage is done with its forwards and waits in the loss broadcast from the last."""
    got = run_ranks(_then, 2, tmp_path, functools.partial(_fleet, "FThenB", 2, 2, evaluate=True), timeout=50,
                    collective_timeout=TIMEOUT)
    _expect(got, 1, BAD)


def test_a_caught_loss_error_in_a_gloo_distmodel_pipeline_stops_the_first_stage_naming_it(tmp_path):
    """to_static with strategy.pipeline (2 stages, 1F1B): the stages' transfers are the model's reshards."""
    from ..ranks.test_pipeline_errors_edge_probe import DM_BAD, _distmodel

    got = run_ranks(_then, 2, tmp_path, functools.partial(_distmodel, "train", "1F1B", 4, 2), timeout=50,
                    collective_timeout=TIMEOUT)
    _expect(got, 1, DM_BAD)
