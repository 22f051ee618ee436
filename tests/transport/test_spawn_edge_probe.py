"""spawn's edges: bad arguments refused before any rank starts; a rank that leaves without joining ends the job."""

import time

import pytest

from meshviz.errors import RankError


def _noop():
    return 1


def _leaves_before_joining(leaver: int, late: int):
    import os

    import torch

    import meshviz.distributed as dist

    rank = int(os.environ["PADDLE_TRAINER_ID"])
    if rank == leaver:
        return "left"
    if rank == late:
        time.sleep(3)  # still on its way to the rendezvous when the job ends: not a cause
    dist.init_parallel_env()
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("options", [
    {"threads": "two"}, {"threads": 0}, {"threads": 1.5}, {"timeout": -1}, {"timeout": 0}, {"timeout": "soon"},
    {"timeout": float("nan")}, {"hang_after": -1}, {"hang_after": "x"}, {"hang_after": True},
    {"start_method": "threads"},
], ids=lambda o: "-".join(f"{k}={v!r}" for k, v in o.items()))
def test_spawn_refuses_a_bad_option_value_before_any_rank_starts(options):
    import meshviz.distributed as dist

    name = next(iter(options))
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"^spawn: {name} "):
        dist.spawn(_noop, nprocs=2, devices="cpu", **options)
    assert time.monotonic() - t0 < 2  # no process was started to fail on its own


@pytest.mark.parametrize("func, args, message", [
    (5, (), "spawn: func must be a function, got int"),
    (_noop, 5, "spawn: args must be a tuple or list of func's arguments, got int"),
])
def test_spawn_refuses_a_func_or_args_it_cannot_call_before_any_rank_starts(func, args, message):
    import meshviz.distributed as dist

    t0 = time.monotonic()
    with pytest.raises(TypeError) as info:
        dist.spawn(func, args=args, nprocs=2, devices="cpu")
    assert str(info.value) == message
    assert time.monotonic() - t0 < 2


@pytest.mark.timeout(90)
@pytest.mark.parametrize("hang_after", [5.0, None])
def test_spawn_ends_at_once_when_a_rank_returns_without_joining(hang_after):
    """Rank 2 returns before init_parallel_env: rank 0, which joined, would wait the whole timeout for it (and
    rank 1, slower, after it)."""
    import meshviz.distributed as dist

    ctx = dist.spawn(_leaves_before_joining, args=(2, 1), nprocs=3, devices="cpu", timeout=20, hang_after=hang_after,
                     join=False)
    ctx.processes[2].join(60)
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        ctx.join()
    took = time.monotonic() - t0
    err = info.value
    assert took < 12, f"took {took:.1f} s: the ranks that joined waited for the one that had left (timeout 20 s)"
    assert err.ranks == [2], str(err)
    assert str(err).startswith("rank 2 never joined the process group (it returned without joining)")
    by = {o.rank: o for o in err.outcomes}
    assert by[2].arrived is False and by[0].arrived
    assert by[0].status == by[1].status == "stopped"


def test_spawn_still_returns_every_value_when_no_rank_joins():
    """Ranks that never join and return at different times strand nobody: every value comes back (the options
    given as strings, as a script passes them on from its command line)."""
    import meshviz.distributed as dist

    ctx = dist.spawn(_noop, nprocs=3, devices="cpu", hang_after=None, threads="1", timeout="30")
    assert [ctx.return_queues[r].get() for r in range(3)] == [1, 1, 1]


_WORLD_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PADDLE_MASTER",
               "PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ENDPOINTS", "PADDLE_CURRENT_ENDPOINT",
               "PADDLE_LOCAL_RANK", "PADDLE_RANK_IN_NODE", "PADDLE_LOCAL_SIZE", "TORCHELASTIC_USE_AGENT_STORE")


@pytest.mark.parametrize("env, message", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "init_parallel_env: RANK=2 with WORLD_SIZE=2: a rank is one of 0..1"),
    ({"PADDLE_TRAINER_ID": "-1", "PADDLE_TRAINERS_NUM": "3"},
     "init_parallel_env: PADDLE_TRAINER_ID=-1 with PADDLE_TRAINERS_NUM=3: a rank is one of 0..2"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "init_parallel_env: WORLD_SIZE=0: the number of ranks must be at least 1"),
    ({"PADDLE_TRAINER_ID": "one", "PADDLE_TRAINERS_NUM": "2"},
     "the environment variable PADDLE_TRAINER_ID='one' is not an int"),
], ids=["rank-past-the-world", "paddle-rank-negative", "world-0", "rank-not-a-number"])
def test_init_parallel_env_refuses_a_rank_outside_its_world_before_the_rendezvous(env, message, monkeypatch):
    """A rank whose number cannot be in its world raises at once, naming the variables, instead of waiting the
    timeout for a rank 0 (or a rendezvous) that cannot take it."""
    import torch.distributed as tdist

    import meshviz.distributed as dist

    if tdist.is_initialized():
        pytest.skip("this process already has a default process group")
    for name in _WORLD_VARS:  # set, then removed: whatever init_parallel_env sets goes again after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "9")  # nothing serves there: a rendezvous would wait the timeout
    monkeypatch.setenv("MESHVIZ_TIMEOUT", "3")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    t0 = time.monotonic()
    with pytest.raises(ValueError) as info:
        dist.init_parallel_env()
    assert str(info.value) == message
    assert time.monotonic() - t0 < 2.5  # before the 3 s timeout a rendezvous would wait
    assert not tdist.is_initialized()
