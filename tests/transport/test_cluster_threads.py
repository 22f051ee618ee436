"""meshviz.Cluster(ranks="threads"): the same Cluster API, %px output, events and RankError with ranks as threads."""

import os
import sys
import threading
import time

import pytest

import meshviz
from meshviz import trace
from meshviz.cluster import RankError

from .. import cluster_checks as checks

N = 3
pytestmark = pytest.mark.timeout(120)


# runs before the module's cluster exists: nothing of the thread world may outlive the last cluster
def test_stop_leaves_nothing_behind():
    import torch.distributed.distributed_c10d as c10d

    from meshviz.runtime import match

    world_before, sleep_before, out_before, hook_before = c10d._world, time.sleep, sys.stdout, sys.excepthook
    checking_before = match.checking()
    c = meshviz.Cluster(n=2, ranks="threads")
    assert match.checking()  # collectives are matched while it runs (check_collectives=True)
    assert time.sleep is not sleep_before
    c.execute("import torch, torch.distributed as tdist\nx = torch.ones(1)\ntdist.all_reduce(x)\n")
    assert sys.excepthook is hook_before  # not torch's, which prefixed the script's tracebacks with [rank1]: [rank0]:
    c.stop()
    assert c.state == "stopped" and "stopped" in repr(c)
    assert not [t for t in threading.enumerate() if t.name.startswith("meshviz-rank")]
    assert c10d._world is world_before and time.sleep is sleep_before and sys.stdout is out_before
    assert sys.excepthook is hook_before
    assert match.checking() == checking_before
    c.restart()
    assert c.execute("print(tdist.get_rank() if 'tdist' in dir() else 'fresh')").stdout == ["fresh\n"] * 2
    c.stop()


@pytest.fixture(scope="module")
def cluster():
    c = meshviz.Cluster(n=N, timeout=30, ranks="threads")
    yield c
    c.stop()


def _whoami():
    import torch
    import torch.distributed as tdist

    import meshviz.distributed as dist

    return {"rank": tdist.get_rank(), "world": tdist.get_world_size(), "backend": tdist.get_backend(),
            "dist": (dist.get_rank(), dist.get_world_size(), dist.ParallelEnv().local_rank), "thread":
            threading.current_thread().name, "device": str(dist.device()), "threads": torch.get_num_threads()}


def test_ranks_devices_and_state(cluster):
    assert cluster.state == "ready" and cluster.ranks_kind == "threads"
    assert cluster.ranks == list(range(N)) and cluster.devices == ["cpu"] * N
    assert cluster.backend_used == "threads" and cluster.view.targets == list(range(N))
    seen = cluster.apply(_whoami)
    for r, s in enumerate(seen):
        assert s["rank"] == r and s["world"] == N and s["backend"] == "threads"
        assert s["dist"] == (r, N, r) and s["device"] == "cpu"
        assert s["thread"] == f"meshviz-rank-{r}"
    text = repr(cluster)
    assert f"Cluster({N} ranks, threads, ready" in text
    for r in range(N):
        assert f"rank {r}: thread meshviz-rank-{r}, cpu" in text


def test_all_reduce_values_in_rank_order_and_cell_results(cluster):
    ar = cluster.execute(
        "import torch, torch.distributed as tdist\n"
        "x = torch.tensor([float(tdist.get_rank() + 1)])\n"
        "tdist.all_reduce(x)\n"
        "print(tdist.get_rank(), x.item())\n"
        "tdist.get_rank() * 10\n")
    assert ar.stdout == [f"{r} {float(sum(range(1, N + 1)))}\n" for r in range(N)]
    assert [e["data"]["text/plain"] for e in ar.execute_result] == [str(r * 10) for r in range(N)]
    assert cluster.view.pull("x.item()") == [float(sum(range(1, N + 1)))] * N
    cluster.view.push({"pushed": 5})
    assert cluster.view.pull(("pushed", "pushed + tdist.get_rank()")) == [[5, 5 + r] for r in range(N)]
    # a function defined in the notebook runs in the rank's namespace, as on an engine
    ns = {}
    exec("def f(k):\n    return pushed * k + tdist.get_rank()\n", {"__name__": "__main__"}, ns)
    ns["f"].__module__ = "__main__"
    assert cluster.apply(ns["f"], 2) == [10 + r for r in range(N)]


def test_display_outputs_as_ipyparallel_prints_them(cluster, capsys):
    ar = cluster.view.execute("print('a', tdist.get_rank())\nprint('b')", block=False)
    ar.get(timeout=30)
    capsys.readouterr()
    ar.display_outputs()
    out = capsys.readouterr().out
    assert out == "".join(f"[stdout:{r}] \na {r}\nb\n" for r in range(N))
    single = cluster.view.execute("print('only')", targets=1)
    assert single.stdout == "only\n"


def test_events_arrive_while_the_cell_runs(cluster, tmp_path):
    checks.events_arrive_while_the_cell_runs(cluster, N, tmp_path)


def test_reshard_events_carry_the_planners_steps_and_replay(cluster, tmp_path):
    checks.reshard_events_carry_the_planners_steps(cluster, N)
    assert len({e.plan_id for e in cluster.events.of_kind("reshard_step")}) == 1  # one plan id on every rank
    path = str(tmp_path / "run.jsonl")
    assert cluster.record(path) == len(cluster.events)
    key = lambda e: (e.rank, e.seq)  # noqa: E731
    back = trace.load_events(path)
    assert [e.to_dict() for e in sorted(back, key=key)] == [e.to_dict() for e in sorted(cluster.events, key=key)]


def test_rank_raising_mid_collective_stops_every_rank(cluster):
    err = checks.rank_raising_mid_collective_stops_every_rank(cluster, N)
    tb = err.outcomes[1].traceback  # it starts in the cell: no frame of the runner, the baton or the backend
    assert not any(f in tb for f in ("ranks/threads.py", "ranks/baton.py", "backends/threads.py", "cluster/threads.py"))


def test_a_rank_that_fails_before_the_caller_waits_is_still_named(cluster, monkeypatch):
    """A busy machine: rank 1's report arrives before ``execute`` starts waiting on the cell it sent."""
    ranks = cluster._ranks
    run_code = ranks.run_code

    def slow_to_wait(code):
        before = len(cluster.failures)
        job = run_code(code)
        if "raise" in code:  # the cell that fails; the check's next one must not wait
            deadline = time.monotonic() + 10
            while len(cluster.failures) == before and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(cluster.failures) > before, "rank 1 never reported"
        return job

    monkeypatch.setattr(ranks, "run_code", slow_to_wait)
    checks.rank_raising_mid_collective_stops_every_rank(cluster, N)


def test_same_error_on_every_rank_keeps_the_process_group(cluster):
    checks.same_error_on_every_rank_keeps_the_process_group(cluster, N)


def test_interrupt_reaches_sleeping_and_busy_ranks(cluster):
    for body in ("import time\nfor _ in range(600): time.sleep(0.05)", "while True:\n    pass"):
        ar = cluster.view.execute("started = True\n" + body, block=False)
        time.sleep(0.3)
        cluster.interrupt()
        with pytest.raises(Exception) as info:
            ar.get(timeout=20)
        assert "KeyboardInterrupt" in str(info.value)
    ar = cluster.execute("x = torch.ones(1); tdist.all_reduce(x); print(x.item())")
    assert ar.stdout == [f"{float(N)}\n"] * N


def test_a_deadlock_is_named_at_once(cluster):
    cell = ("import torch\nt = torch.zeros(1)\n"
            "tdist.recv(t, src=(tdist.get_rank() + 1) % tdist.get_world_size())  # every rank waits\n")
    with pytest.raises(RankError) as info:
        cluster.execute(cell, timeout=10)  # the collective timeout is 30 s
    text = str(info.value)
    assert "deadlock" in text and "rank 0 waits in recv from rank 1" in text
    ar = cluster.execute("x = torch.ones(1); tdist.all_reduce(x); print(x.item())")
    assert ar.stdout == [f"{float(N)}\n"] * N


def test_a_rank_that_skips_a_collective_is_named_at_once_as_on_engines(cluster, capsys):
    cluster.execute("import torch\nimport meshviz.distributed as dist")
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        cluster.execute("t = torch.ones(4)\nif dist.get_rank() == 0:\n    dist.all_reduce(t)\n")
    assert time.monotonic() - t0 < 10  # the collective timeout is 30 s
    err = info.value
    assert err.ranks == [1, 2] and err.lead
    assert err.diagnosis[0] == "rank 1 never entered all_reduce #1 on group [0, 1, 2] (idle: its cell finished)"
    assert err.diagnosis[1] == "rank 2 never entered all_reduce #1 on group [0, 1, 2] (idle: its cell finished)"
    capsys.readouterr()
    ar = cluster.execute("t = torch.full((2,), float(dist.get_rank() + 1))\ndist.all_reduce(t)\nprint(t.tolist())")
    assert ar.stdout == ["[6.0, 6.0]\n"] * N
    assert "re-created it on ranks 0-2" in capsys.readouterr().err  # the half-done meetings were dropped


def test_a_non_blocking_cell_waits_for_a_later_cell_to_join_it(cluster):
    cluster.execute("import torch\nimport meshviz.distributed as dist")
    first = cluster.view.execute("t = torch.full((1,), 5.0)\nif dist.get_rank() == 0:\n    dist.all_reduce(t)\n",
                                 block=False)
    deadline = time.monotonic() + 10
    while (cluster.status()[0].waiting_s or 0) < 0.5:  # not a deadlock: the notebook may still run a cell
        assert time.monotonic() < deadline and not first.ready()
        time.sleep(0.05)
    status = cluster.status()
    assert [s.state for s in status] == ["in_collective", "idle", "idle"] and status.culprits() == [1, 2]
    assert status[0].where == "line 3 of the cell"
    second = cluster.view.execute("dist.all_reduce(t)", targets=[1, 2], block=False)
    first.get(timeout=10)
    second.get(timeout=10)
    assert cluster.view.pull("t.item()", block=True) == [15.0] * N


def test_mismatched_shapes_are_named_before_any_data_moves(cluster):
    cluster.execute("import torch\nimport meshviz.distributed as dist")
    with pytest.raises(RankError) as info:
        cluster.execute("t = torch.ones(4 if dist.get_rank() == 0 else 8)\ndist.all_reduce(t)")
    err = info.value
    assert err.ranks == [0] and err.lead
    assert err.diagnosis[0].endswith("rank 0 entered all_reduce with float32[4]; rank 1 entered all_reduce with "
                                     "float32[8]; rank 2 entered all_reduce with float32[8]")
    ar = cluster.execute("t = torch.ones(2)\ndist.all_reduce(t)\nprint(t.tolist())")
    assert ar.stdout == ["[3.0, 3.0]\n"] * N


def test_px_output_comes_in_rank_order(cluster):
    checks.px_output_in_rank_order(cluster, N)


def test_px_magic_names_the_rank(cluster):
    shell = checks.px_magic_names_the_rank(cluster)
    res = shell.run_cell("%%px --targets 1\nonly_one = 1\n")
    assert res.error_in_exec is None
    assert cluster.view.pull("only_one", targets=1) == 1
    with pytest.raises(RankError, match="NameError"):
        cluster.view.pull("only_one", targets=0)


def test_the_environment_picks_threads_and_bad_arguments_raise(monkeypatch):
    from meshviz.cluster.config import ClusterConfig

    monkeypatch.setenv("MESHVIZ_RANKS", "threads")
    assert ClusterConfig.from_args(2).ranks == "threads"
    assert ClusterConfig.from_args(2, ranks="engines").ranks == "engines"
    monkeypatch.delenv("MESHVIZ_RANKS")
    assert ClusterConfig.from_args(2).ranks == "engines"
    with pytest.raises(ValueError, match="ranks must be"):
        meshviz.Cluster(n=2, ranks="fibres")
    with pytest.raises(ValueError, match="CPU"):
        meshviz.Cluster(n=2, ranks="threads", devices="cuda")
    with pytest.raises(ValueError, match="ipyparallel options"):
        meshviz.Cluster(n=2, ranks="threads", engines="mpi")
    with pytest.raises(ValueError, match="'threads' backend"):
        meshviz.Cluster(n=2, ranks="threads", backend="nccl")
    assert os.environ.get("MESHVIZ_RANKS") is None


def test_a_cluster_runs_over_any_runner_it_is_given():
    from meshviz.cluster.threads import Threads

    seen = []

    class Counting(Threads):
        kind = "threads"

        def run_code(self, code, *args, **kwargs):
            seen.append(code)
            return super().run_code(code, *args, **kwargs)

    c = meshviz.Cluster(n=2, ranks="threads", runner=Counting)
    try:
        assert isinstance(c._ranks, Counting)
        cell = ("import torch, torch.distributed as tdist\n"
                "x = torch.ones(1) * (tdist.get_rank() + 1)\ntdist.all_reduce(x)")
        c.execute(cell)
        assert c.apply(lambda: float(__import__("torch").ones(1).sum())) == [1.0, 1.0]
        assert c.view.pull("x") == [__import__("torch").tensor([3.0])] * 2
        with pytest.raises(RankError) as err:
            c.execute("import torch.distributed as tdist\n"
                      "if tdist.get_rank() == 1:\n    raise ValueError('on purpose')")
        assert err.value.ranks == [1] and "on purpose" in str(err.value)
        assert seen[0] == cell and len(seen) == 2
    finally:
        c.stop()
