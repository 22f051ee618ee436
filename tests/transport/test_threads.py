"""Ranks as threads of one process: the thread process group, the baton, per-rank state, and meshes far larger
than the machine (64 ranks, a 16-rank hybrid step) against the dense truth."""

import ctypes
import re
import threading
import time

import numpy as np
import pytest
import torch

from meshviz.errors import RankError
from meshviz.testing import run_ranks

pytestmark = pytest.mark.timeout(240)


def _collectives():
    import torch.distributed as tdist

    import meshviz.distributed as dist
    from meshviz import compat

    dist.init_parallel_env()
    r, n = tdist.get_rank(), tdist.get_world_size()
    out = {"backend": tdist.get_backend(), "rank": (r, dist.get_rank(), dist.ParallelEnv().local_rank), "world": n}
    x = torch.tensor([float(r + 1), 2.0 * r])
    for op in ("sum", "max", "min", "prod", "avg"):
        y = x.clone()
        dist.all_reduce(y, op=getattr(dist.ReduceOp, op.upper()))
        out[op] = y.tolist()
    got = []
    dist.all_gather(got, torch.tensor([r, r * r]))
    out["gather"] = [t.tolist() for t in got]
    b = torch.tensor([float(r)] * 3)
    dist.broadcast(b, src=n - 1)
    out["bcast"] = b.tolist()
    rs = torch.zeros(2)
    compat.reduce_scatter_single(rs, torch.arange(2.0 * n) * (r + 1))
    out["rs"] = rs.tolist()
    a2a = torch.empty(n, dtype=torch.long)
    tdist.all_to_all_single(a2a, torch.arange(n) + 10 * r)
    out["a2a"] = a2a.tolist()
    # point to point both ways round a ring, receives posted before the sends
    left, right = torch.zeros(1), torch.zeros(1)
    works = [tdist.irecv(left, (r - 1) % n), tdist.irecv(right, (r + 1) % n),
             tdist.isend(torch.tensor([float(r)]), (r + 1) % n), tdist.isend(torch.tensor([float(r)]), (r - 1) % n)]
    for w in works:
        w.wait()
    out["ring"] = (left.item(), right.item())
    # a sub-group in a given order, and an object collective
    g = dist.new_group([n - 1, 0])
    s = torch.tensor([float(r)])
    dist.all_reduce(s, group=g)
    out["sub"] = s.item()
    objs = [None] * n
    tdist.all_gather_object(objs, {"r": r})
    out["objs"] = objs
    return out


def test_collectives_and_send_recv_on_threads():
    n = 4
    res = run_ranks(_collectives, n, ranks="threads")
    vals = [[r + 1.0, 2.0 * r] for r in range(n)]
    for r, o in enumerate(res):
        assert o["backend"] == "threads" and o["rank"] == (r, r, r) and o["world"] == n
        assert o["sum"] == [sum(v[i] for v in vals) for i in range(2)]
        assert o["max"] == [max(v[i] for v in vals) for i in range(2)]
        assert o["min"] == [min(v[i] for v in vals) for i in range(2)]
        assert o["prod"] == [float(np.prod([v[i] for v in vals])) for i in range(2)]
        assert o["avg"] == pytest.approx([sum(v[i] for v in vals) / n for i in range(2)])
        assert o["gather"] == [[q, q * q] for q in range(n)]
        assert o["bcast"] == [float(n - 1)] * 3
        full = sum(np.arange(2.0 * n) * (q + 1) for q in range(n))
        assert o["rs"] == full[2 * r: 2 * r + 2].tolist()
        assert o["a2a"] == [r + 10 * q for q in range(n)]
        assert o["ring"] == ((r - 1) % n, (r + 1) % n)
        assert o["sub"] == (float(n - 1) if r in (0, n - 1) else float(r))
        assert o["objs"] == [{"r": q} for q in range(n)]


def _raises_on_one():
    import torch.distributed as tdist

    import meshviz.distributed as dist

    dist.init_parallel_env()
    if tdist.get_rank() == 2:
        raise ValueError("rank two broke")
    x = torch.ones(1)
    tdist.all_reduce(x)
    return x.item()


def _deadlock():
    import torch.distributed as tdist

    import meshviz.distributed as dist

    dist.init_parallel_env()
    t = torch.zeros(1)
    tdist.recv(t, src=(tdist.get_rank() + 1) % tdist.get_world_size())  # everyone receives, no one sends


def _skips(op):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    if dist.get_rank() == 0:
        if op == "all_reduce":
            dist.all_reduce(torch.ones(4))
        else:
            dist.recv(torch.zeros(4), src=1)


def _mismatch():
    import torch.distributed as tdist

    import meshviz.distributed as dist

    dist.init_parallel_env()
    t = torch.ones(1)
    if tdist.get_rank() == 0:
        tdist.broadcast(t, src=0)
    else:
        tdist.all_reduce(t)


def _late():
    import time

    import torch.distributed as tdist

    import meshviz.distributed as dist

    dist.init_parallel_env()
    if tdist.get_rank() == 1:
        time.sleep(4)  # the baton moves on while it sleeps: rank 0 waits, and is not deadlocked
    tdist.all_reduce(torch.ones(1))


def test_a_wait_ends_at_the_collective_timeout_naming_what_it_waits_for():
    with pytest.raises(RankError) as info:
        run_ranks(_late, 2, ranks="threads", timeout=30, collective_timeout=1)
    by = {o.rank: o for o in info.value.outcomes}
    assert "rank 0 timed out after 1 s in all_reduce #1 on ranks [0, 1] (waiting for rank 1)" in by[0].error
    # named as rank processes name it: the rank that never came, and where it is (the roll-call at the timeout)
    assert info.value.ranks == [1]
    assert re.match(r"rank 1 never entered all_reduce on group \[0, 1\]; it is running at test_threads\.py:\d+ in "
                    r"_late\(\); rank 0 waited in all_reduce on group \[0, 1\]", str(info.value)), str(info.value)


def test_a_raising_rank_stops_its_peers_at_once_and_a_deadlock_is_named():
    # the collective timeout is far beyond the deadline: only an immediate stop meets it
    with pytest.raises(RankError) as info:
        run_ranks(_raises_on_one, 3, ranks="threads", timeout=20, collective_timeout=600)
    err = info.value
    assert err.ranks == [2] and "rank 2 raised ValueError: rank two broke" in str(err)
    assert [o.status for o in err.outcomes] == ["error"] * 3
    for o in err.outcomes:
        if o.rank != 2:
            assert "rank 2 failed (ValueError: rank two broke)" in o.error and "all_reduce" in o.error
    with pytest.raises(RankError) as info:
        run_ranks(_deadlock, 3, ranks="threads", timeout=20, collective_timeout=600)
    text = str(info.value)
    assert "deadlock" in text
    for r in range(3):
        assert f"rank {r} waits in recv from rank {(r + 1) % 3}" in text
    for op, line in [("all_reduce", "rank 1 never entered all_reduce #1 on group [0, 1, 2] (idle: its function "
                                    "returned); rank 2 never entered all_reduce #1 on group [0, 1, 2] (idle: its "
                                    "function returned); rank 0 waited in all_reduce #1 on group [0, 1, 2] for 0.0 s"),
                     ("recv", "rank 1 never entered send on group [0, 1] (idle: its function returned); rank 0 waited "
                              "in recv on group [0, 1] for 0.0 s")]:
        with pytest.raises(RankError) as info:  # named as rank processes name it: who never entered it
            run_ranks(_skips, 3, op, ranks="threads", timeout=20, collective_timeout=600)
        assert info.value.ranks == ([1, 2] if op == "all_reduce" else [1])
        assert str(info.value).splitlines()[0] == line
    with pytest.raises(RankError) as info:
        run_ranks(_mismatch, 2, ranks="threads", timeout=20, collective_timeout=600)
    assert "mismatch" in str(info.value) and "broadcast" in str(info.value) and "all_reduce" in str(info.value)


_SHARED: dict = {}  # a module-level name every rank thread reads


def _another_ranks_group():
    import torch.distributed as tdist

    import meshviz.distributed as dist

    dist.init_parallel_env()
    group = _SHARED.setdefault("group", tdist.group.WORLD)  # the first rank's group, kept for all
    group.allreduce([torch.ones(2)]).wait()


def test_a_collective_on_another_ranks_group_is_named_at_once():
    # the scheduler took the caller for the group's rank: a wait that no peer and no timeout ended
    _SHARED.clear()
    with pytest.raises(RankError) as info:
        run_ranks(_another_ranks_group, 2, ranks="threads", timeout=20, collective_timeout=600)
    first = _SHARED["group"].rank()
    other = 1 - first
    by = {o.rank: o for o in info.value.outcomes}
    assert info.value.ranks == [other]
    assert f"rank {other} called a collective on rank {first}'s process group" in by[other].error
    assert f"rank {other} failed" in by[first].error and "all_reduce" in by[first].error


def _tripled(rank):
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
    return (distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)]) * 3).to_local().sum().item()


def test_a_stopped_world_is_not_kept_alive():
    # DTensor's sharding decisions, shared between rank threads, hold the DeviceMesh of the rank that made them,
    # which holds its process group and so its world: forgotten when the last world stops
    import gc
    import weakref

    from meshviz.ranks.threads import ThreadWorld

    worlds = []
    for _ in range(3):
        world = ThreadWorld(2, timeout=20).start()
        job = world.submit(_tripled)
        assert job.wait(30) and [o.value for o in job.outcomes()] == [48.0, 48.0]
        world.stop()
        worlds.append(weakref.ref(world))
        del world, job
    gc.collect()
    # the first may stay: torch's own caches of a mesh's layout keep the first mesh of each shape they see
    assert [w() is None for w in worlds[1:]] == [True, True]


def _rng():
    import random

    import torch.distributed as tdist

    import meshviz.distributed as dist

    dist.init_parallel_env()
    r = tdist.get_rank()
    first = torch.randn(2).tolist()  # unseeded: where a fresh process starts
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    np.random.seed(7)
    random.seed(7)
    draws = [torch.rand(r + 1).tolist()]  # rank-dependent amounts between collectives
    x = torch.ones(1)
    tdist.all_reduce(x)
    draws.append(torch.rand(2).tolist())
    tdist.all_reduce(x)
    return first, model.weight.detach().clone(), draws, np.random.rand(2).tolist(), random.random()


def test_each_rank_has_its_own_rng_states_as_a_process_has():
    torch.manual_seed(1234)
    np.random.seed(1234)
    expect_main = (torch.rand(3), np.random.rand(3))
    torch.manual_seed(1234)
    np.random.seed(1234)
    res = run_ranks(_rng, 4, ranks="threads")
    # the caller's generators were left alone
    assert torch.equal(torch.rand(3), expect_main[0]) and np.array_equal(np.random.rand(3), expect_main[1])
    fresh = torch.randn(2, generator=torch.Generator()).tolist()
    torch.manual_seed(0)
    weight = torch.nn.Linear(3, 2).weight.detach()
    after = torch.get_rng_state()  # where a rank's generator is once it made its seeded Linear
    torch.manual_seed(1234)
    np.random.seed(7)
    np_draws = np.random.rand(2).tolist()
    import random

    random.seed(7)
    py_draw = random.random()
    for r, (first, w, draws, npd, pyd) in enumerate(res):
        assert first == fresh
        assert torch.equal(w, weight)  # torch.manual_seed(0); Linear() gives every rank the same weights
        ref = torch.Generator()
        ref.set_state(after)
        assert draws == [torch.rand(r + 1, generator=ref).tolist(), torch.rand(2, generator=ref).tolist()]
        assert npd == np_draws and pyd == py_draw


def _per_rank_state():
    import meshviz.distributed as dist
    from meshviz import trace
    from meshviz.core.mesh import current_rank
    from meshviz.distributed import fleet
    from meshviz.distributed.fleet.meta_parallel import get_rng_state_tracker, model_parallel_random_seed
    from meshviz.runtime import groups

    dist.init_parallel_env()
    r = dist.get_rank()
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 2, "mp_degree": 2, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=s)
    hcg = fleet.get_hybrid_communicate_group()
    model_parallel_random_seed(100)
    g = dist.new_group([0, 1]) if r < 2 else None
    if r >= 2:
        g = dist.new_group([0, 1])  # every rank makes every group, in one order
    mem = trace.MemorySink()
    trace.add_sink(mem)
    t = dist.shard_tensor(torch.arange(4.0), dist.ProcessMesh([0, 1, 2, 3]), [dist.Shard(0)])
    trace.remove_sink(mem)
    return dict(rank=r, core_rank=current_rank(), mp_rank=hcg.get_model_parallel_rank(),
                dp_group=hcg.get_data_parallel_group().ranks, tracker_seed=get_rng_state_tracker().states_[
                    "model_parallel_rng"][0], group=(g.id, g.ranks, g.rank), n_groups=len(groups._state().paddle),
                events=[(e.rank, e.kind, e.seq) for e in mem.events], local=t._local_value().tolist())


def test_per_rank_state_stays_per_rank():
    res = run_ranks(_per_rank_state, 4, ranks="threads")
    seqs = set()
    for r, o in enumerate(res):
        assert o["rank"] == o["core_rank"] == r
        assert o["mp_rank"] == r % 2 and o["dp_group"] == [r % 2, r % 2 + 2]
        assert o["tracker_seed"] == 100 + 1 + (r % 2)  # Paddle's local seed: seed + 1 + mp_rank * pp + pp_rank
        assert o["group"][1] == [0, 1] and o["group"][2] == (r if r < 2 else -1)
        assert o["local"] == [float(r)]
        assert o["events"] and all(e[0] == r for e in o["events"])  # a rank's sink sees its own events only
        seqs.add(tuple(e[2] for e in o["events"]))
    assert len(seqs) == 1  # each rank numbers its events from the same start, as a process does
    assert len({o["n_groups"] for o in res}) == 1


# -- far past the machine ----------------------------------------------------------------------------------------

_IDS = np.random.default_rng(0).permutation(64).reshape(8, 8)
_SHAPE = (16, 24)
_CASES = [
    (["S(0)", "S(1)"], ["R", "R"]),
    (["P(sum)", "S(0)"], ["S(1)", "R"]),
    (["S(0)", "S(0)"], ["S(1)", "P(sum)"]),
    (["R", "S(1)"], ["S(0)", "S(1)"]),
    (["P(max)", "R"], ["R", "S(0)"]),
]


def _placements(names):
    from meshviz.core.placements import parse_placement

    return [parse_placement(p) for p in names]


def _reshard_64():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh = dist.ProcessMesh(_IDS, dim_names=["x", "y"])
    value = torch.arange(float(np.prod(_SHAPE))).reshape(_SHAPE)
    out = []
    for src, dst in _CASES:
        t = dist.shard_tensor(value, mesh, _placements(src))
        r = dist.reshard(t, mesh, _placements(dst))
        out.append(r._local_value().numpy().copy())
    return out


@pytest.mark.timeout(300)
def test_64_rank_reshards_match_the_planner_simulation_and_the_dense_tensor():
    from meshviz.core.layout import dense_to_local
    from meshviz.core.mesh import ProcessMesh
    from meshviz.core.planner import plan_reshard, simulate

    res = run_ranks(_reshard_64, 64, ranks="threads", timeout=280)
    mesh = ProcessMesh(_IDS, ["x", "y"])
    value = np.arange(float(np.prod(_SHAPE))).reshape(_SHAPE)
    for i, (src, dst) in enumerate(_CASES):
        plan = plan_reshard(_SHAPE, mesh, _placements(src), mesh, _placements(dst), itemsize=4)
        sim = simulate(plan, value)
        for rank in range(64):
            got = res[rank][i]
            np.testing.assert_array_equal(got, sim[rank], err_msg=f"{src} -> {dst} on rank {rank}")
            if not any(p.startswith("P") for p in dst):
                np.testing.assert_array_equal(got, dense_to_local(value, mesh, _placements(dst), mesh.coordinate(rank)))


def _hybrid_16(steps):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    mesh0 = dist.ProcessMesh(np.arange(8).reshape(2, 4), dim_names=["x", "y"])  # stage 0: dp 2 x mp 4
    mesh1 = dist.ProcessMesh(np.arange(8, 16).reshape(2, 4), dim_names=["x", "y"])  # stage 1
    torch.manual_seed(0)
    w0 = dist.shard_tensor(torch.nn.Parameter(torch.randn(16, 32) * 0.1), mesh0, [dist.Replicate(), dist.Shard(1)])
    w1 = dist.shard_tensor(torch.nn.Parameter(torch.randn(32, 16) * 0.1), mesh1, [dist.Replicate(), dist.Shard(0)])
    opt = dist.shard_optimizer(torch.optim.AdamW([w0, w1], lr=0.01))
    losses = []
    for step in range(steps):
        x = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(step))
        x = dist.shard_tensor(x, mesh0, [dist.Shard(0), dist.Replicate()])
        y = dist.reshard(torch.matmul(x, w0), mesh1, [dist.Shard(0), dist.Shard(2)])  # the stage transfer
        loss = torch.mean(torch.matmul(y, w1))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(dist.unshard_dtensor(loss).item() if dist.get_rank() >= 8 else None)
    return losses, dist.unshard_dtensor(w0).detach(), dist.unshard_dtensor(w1).detach()


@pytest.mark.timeout(300)
def test_16_rank_hybrid_steps_match_a_single_process():
    steps = 2
    res = run_ranks(_hybrid_16, 16, steps, ranks="threads", timeout=280)
    torch.manual_seed(0)
    w0 = torch.nn.Parameter(torch.randn(16, 32) * 0.1)
    w1 = torch.nn.Parameter(torch.randn(32, 16) * 0.1)
    opt = torch.optim.AdamW([w0, w1], lr=0.01)
    ref = []
    for step in range(steps):
        x = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(step))
        loss = torch.mean(torch.matmul(torch.matmul(x, w0), w1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    for rank, (losses, g0, g1) in enumerate(res):
        if rank < 8:  # stage 0 holds w0 (a rank outside a mesh holds an empty value)
            torch.testing.assert_close(g0, w0.detach(), rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_allclose(losses, ref, rtol=1e-5)
            torch.testing.assert_close(g1, w1.detach(), rtol=1e-5, atol=1e-6)


def _caught_then_more():
    import torch.distributed as tdist

    import meshviz.distributed as dist
    from meshviz.backends.threads import RankStopped

    dist.init_parallel_env()
    r = tdist.get_rank()
    out = []
    try:  # rank 0 reduces while rank 1 receives: a deadlock, caught by the user's code
        t = torch.zeros(1)
        tdist.all_reduce(t) if r == 0 else tdist.recv(t, src=0)
    except RankStopped as e:
        out.append(str(e).split(":")[0])
    for step in range(2):  # a meeting the deadlock left half done would pair these with the peer's next calls
        t = torch.full((1,), 10.0 * step + r + 1)
        try:
            tdist.all_reduce(t)
            out.append(t.item())
        except RankStopped as e:
            out.append(str(e)[:59])
    return out


def test_a_caught_failed_wait_stops_every_later_collective_of_the_run():
    """Rank 0's half-done all_reduce would meet rank 1's next one (each later call paired with the peer's next:
    values silently wrong); every later call fails instead, as a process group is unusable after a failed wait."""
    stopped = "the ranks' collectives stopped at a failed wait (deadlock: "
    assert run_ranks(_caught_then_more, 2, ranks="threads", timeout=30) == [["deadlock", stopped, stopped]] * 2


def _deadlock_named_at_once(world) -> str:
    def recv_from_the_other(r):
        import torch.distributed as tdist

        tdist.recv(torch.zeros(1), src=1 - r)

    t0 = time.monotonic()
    job = world.submit(recv_from_the_other)
    assert job.wait(20)
    assert time.monotonic() - t0 < 5  # named at once, not at the 30 s collective timeout
    return job.outcomes()[0].error


def test_an_interrupt_sent_while_the_holder_waits_for_the_lock_leaves_the_deadlock_check_working():
    """An interrupt is sent to the rank holding the turn. Here that rank is entering time.sleep and waits for the
    scheduler's lock: the KeyboardInterrupt used to land after the sleep marked it away, which stayed so for good,
    and no later deadlock was named (a loaded machine met this after an interrupted sleep loop)."""
    from meshviz.ranks.threads import ThreadWorld

    world = ThreadWorld(2, timeout=30).start()
    try:
        ready, go = threading.Event(), threading.Event()

        def sleeper(r):
            if r == 0:
                ready.set()
                go.wait(10)
            time.sleep(0.01)

        job = world.submit(sleeper)
        assert ready.wait(10)
        with world.lock:  # as interrupt() holds it: rank 0 enters the sleep and waits for the lock
            go.set()
            time.sleep(0.3)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(world._idents[0]),
                                                       ctypes.py_object(KeyboardInterrupt))
        assert job.wait(10)
        assert [o.status for o in job.outcomes()] == ["error", "ok"]
        assert "KeyboardInterrupt" in job.outcomes()[0].error
        assert "deadlock" in _deadlock_named_at_once(world)
    finally:
        world.stop()


class _InterruptAfterAdd(set):
    """A set whose add is followed by a KeyboardInterrupt on the calling thread, once (an interrupt landing in the
    middle of the scheduler's bookkeeping)."""

    armed = False

    def add(self, item) -> None:
        super().add(item)
        if _InterruptAfterAdd.armed:
            _InterruptAfterAdd.armed = False
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.get_ident()),
                                                       ctypes.py_object(KeyboardInterrupt))


def test_a_rank_ends_its_job_neither_away_nor_waiting_whatever_an_interrupt_left_half_done():
    from meshviz.ranks.threads import ThreadWorld

    world = ThreadWorld(2, timeout=30).start()
    try:
        world._away = _InterruptAfterAdd()

        def sleeper(r):
            if r == 0:
                _InterruptAfterAdd.armed = True
            time.sleep(0.01)

        job = world.submit(sleeper)
        assert job.wait(10)
        assert [o.status for o in job.outcomes()] == ["error", "ok"]
        assert not world._away and not world._blocked and world.holder is None
        assert "deadlock" in _deadlock_named_at_once(world)
    finally:
        world.stop()
