"""Rendezvous: held ports, the store on loopback, the rank environment; one RankError; spawn's blame."""

import datetime
import os
import pickle
import socket
import time
from functools import partial

import pytest
import torch

from meshviz.errors import RankError, RankOutcome
from meshviz.runtime import rendezvous

from .started import wait_for_files


def _listeners(port: int) -> list[str]:
    """Hex addresses listening on ``port`` (from /proc: 0100007F is 127.0.0.1, 00000000 every interface)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                cols = line.split()
                addr, p = cols[1].split(":")
                if cols[3] == "0A" and int(p, 16) == port:
                    out.append(addr)
    return out


def test_a_reserved_port_stays_taken_until_the_store_serves_on_it_on_loopback_only():
    res = rendezvous.reserve_port()
    port = res.port
    for reuse in (False, True):  # held: nobody else can take it, not even with SO_REUSEADDR (as torch's store)
        other = socket.socket()
        if reuse:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
            other.listen(1)
        other.close()
    to = datetime.timedelta(seconds=10)
    server = rendezvous.serve_store(res, 2, to)
    assert not res.held
    assert _listeners(port) == ["0100007F"]  # 127.0.0.1 only, never 0.0.0.0 / ::
    client = rendezvous.connect_store("127.0.0.1", port, 2, to)
    client.set("k", "v")
    assert server.get("k") == b"v"
    with pytest.raises(RuntimeError, match="handed over"):
        res.listen()


def test_free_port_is_only_a_number():
    port = rendezvous.free_port()
    s = socket.socket()
    s.bind(("127.0.0.1", port))  # nothing holds it any more
    s.close()


def test_rank_env_and_arrival_on_a_hosted_store(monkeypatch):
    env = rendezvous.rank_env(2, 4, "127.0.0.1", 1234, local_rank=0, local_world=2, hosted=True)
    assert env == {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert rendezvous.rank_env(1, 3, "h", 5)["LOCAL_RANK"] == "1"
    assert "TORCHELASTIC_USE_AGENT_STORE" not in rendezvous.rank_env(1, 3, "h", 5)
    res = rendezvous.reserve_port()
    server = rendezvous.serve_store(res, 3, 10)
    assert rendezvous.arrived(server, 3) == [False, False, False]
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    # every rank, rank 0 included, is a client of the hosted store and marks its arrival
    for r in (0, 2):
        store = rendezvous.process_group_store(r, 3, "127.0.0.1", res.port, 10)
        assert store is not None
    assert rendezvous.arrived(server, 3) == [True, False, True]


def test_await_arrivals_names_who_never_came_and_the_first_verdict_reaches_every_rank_of_that_run(monkeypatch):
    import threading

    import torch.distributed as tdist

    store = tdist.HashStore()
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv(rendezvous.HOSTED, "True")  # the store is not this process's to keep: no pause at the end
    rendezvous.mark_arrived(store, 0)
    rendezvous.mark_arrived(store, 2)
    want = ("init_parallel_env: rank 1 never reached the rendezvous at h:5 (waited 0.3 s; WORLD_SIZE=3; arrived: "
            "[0, 2]): start every rank with the same MASTER_ADDR and MASTER_PORT, or start them with dist.spawn or "
            "meshviz.launch")
    with pytest.raises(RuntimeError) as err:
        rendezvous.await_arrivals(store, 0, 3, "h", 5, 0.3)
    assert str(err.value) == want
    rendezvous.mark_arrived(store, 1)  # too late: a rank of that run still waiting takes the verdict, at once
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        rendezvous.await_arrivals(store, 2, 3, "h", 5, 0.3)
    assert str(err.value) == want and time.monotonic() - t0 < 0.2  # at its first look, not at its own timeout
    # torchrun's restart on the same store: its ranks wait for each other again, the verdict before is not theirs
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    store2 = tdist.HashStore()
    rendezvous.mark_arrived(store2, 0)
    store2.set("meshviz/arrived/gave_up/0", "100")
    later = threading.Timer(0.3, rendezvous.mark_arrived, (store2, 1))
    later.start()
    t0 = time.monotonic()
    rendezvous.await_arrivals(store2, 0, 2, "h", 5, 30)
    assert 0.25 < time.monotonic() - t0 < 5


_INIT = "import meshviz.distributed as dist\ndist.init_parallel_env(timeout=3)\n"


def _by_hand(rank: int, world: int, port: int) -> dict[str, str]:
    """The environment of a rank started by hand on loopback (nothing hosted, processes not threads, no GPU)."""
    env = {k: v for k, v in os.environ.items() if k not in (rendezvous.HOSTED, "MESHVIZ_RANKS")}
    env.update(rendezvous.rank_env(rank, world, "127.0.0.1", port), CUDA_VISIBLE_DEVICES="")
    return env


def test_init_parallel_env_names_the_rank_that_never_came():
    import subprocess
    import sys

    def start(rank, world, port):
        return subprocess.Popen([sys.executable, "-c", _INIT], env=_by_hand(rank, world, port), stderr=subprocess.PIPE,
                                text=True)

    three, alone = rendezvous.free_port(), rendezvous.free_port()
    procs = [start(0, 3, three), start(1, 3, three), start(1, 2, alone)]  # rank 2 of three never starts; nor rank 0
    errs = [p.communicate(timeout=120)[1].strip().splitlines()[-1] for p in procs]
    assert all(p.returncode == 1 for p in procs)
    for err in errs[:2]:  # both ranks that came name the one that did not
        assert err == (f"RuntimeError: init_parallel_env: rank 2 never reached the rendezvous at 127.0.0.1:{three} "
                       "(waited 3 s; WORLD_SIZE=3; arrived: [0, 1]): start every rank with the same MASTER_ADDR and "
                       "MASTER_PORT, or start them with dist.spawn or meshviz.launch"), err
    assert errs[2].startswith(f"RuntimeError: init_parallel_env: rank 0 never served the rendezvous store at "
                              f"127.0.0.1:{alone} (waited 3 s; WORLD_SIZE=2)"), errs[2]


def _as_a_terminal_starts_it() -> None:
    """A child's SIGINT at its default, so that Python raises KeyboardInterrupt on it: a test run started in the
    background of a script (as the test command's torch-matrix legs) inherits SIGINT ignored, and Python keeps an
    ignored SIGINT ignored."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _waiting(world: int, ranks, timeout: int = 60):
    """``ranks`` of a ``world`` started with init_parallel_env(timeout=...), once all of them wait at the
    rendezvous (rank 0 serves its store): (processes, port)."""
    import subprocess
    import sys

    port = rendezvous.free_port()
    procs = []
    for rank in ranks:
        procs.append(subprocess.Popen([sys.executable, "-c", _INIT.replace("timeout=3", f"timeout={timeout}")],
                                      env=_by_hand(rank, world, port), stderr=subprocess.PIPE, text=True,
                                      preexec_fn=_as_a_terminal_starts_it))
    deadline = time.monotonic() + 60
    while True:
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "a rank never reached its wait"
        try:
            came = rendezvous.arrived(rendezvous.connect_store("127.0.0.1", port, None, 1), world)
            if [r for r, c in enumerate(came) if c] == sorted(ranks):
                break
        except Exception:
            pass
        time.sleep(0.2)
    time.sleep(0.5)
    return procs, port


def _ended(procs, timeout=30) -> list[str]:
    try:
        return [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def test_ctrl_c_while_init_parallel_env_waits_for_a_peer_ends_the_rank_at_once():
    """Rank 0 of two, rank 1 never started, init_parallel_env's timeout 60 s: a SIGINT once rank 0 has arrived
    ends it at once (was: the process group's wait for its peer, one C++ call, handled it only at the timeout)."""
    import signal

    (proc,), _ = _waiting(2, [0])
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    (err,) = _ended([proc])
    took = time.monotonic() - sent
    assert proc.returncode != 0 and err.strip().splitlines()[-1] == "KeyboardInterrupt", err[-2000:]
    assert "init_parallel_env" in err and took < 10, (took, err[-2000:])


def test_ctrl_c_while_a_rank_waits_for_rank_0_to_serve_the_store_ends_it_at_once():
    """Rank 1 of two started alone (timeout 60 s): a SIGINT while it waits for rank 0's store ends it at once (was:
    torch's connect loop, one C++ call, heard it only at the timeout)."""
    import signal
    import subprocess
    import sys

    env = _by_hand(1, 2, rendezvous.free_port())
    code = "import meshviz.distributed as dist\nprint('ready', flush=True)\ndist.init_parallel_env(timeout=60)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_as_a_terminal_starts_it)
    assert proc.stdout.readline() == "ready\n"
    time.sleep(1.0)  # in init_parallel_env's wait by now
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    (err,) = _ended([proc])
    assert proc.returncode != 0 and err.strip().splitlines()[-1] == "KeyboardInterrupt", err[-2000:]
    assert "_rank0_store" in err and time.monotonic() - sent < 10, err[-2000:]


def test_a_rank_waiting_for_its_peers_says_that_rank_0_which_served_the_store_went_away():
    """Ranks 0 and 1 of three wait for rank 2 (timeout 60 s); rank 0, which serves the store, is killed: rank 1
    says so at once (was: torch's "Failed to recv, got 0 bytes" from gloo's connect)."""
    import signal

    procs, port = _waiting(3, [0, 1])
    procs[0].send_signal(signal.SIGKILL)
    sent = time.monotonic()
    err = _ended(procs)[1]
    assert time.monotonic() - sent < 10 and procs[1].returncode == 1, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        f"RuntimeError: init_parallel_env: rank 0's rendezvous store at 127.0.0.1:{port} went away while rank 1 "
        "waited for the others (WORLD_SIZE=3): rank 0 ended; its output says why"), err[-2000:]


_UNDESTROYED = """
import atexit, torch, torch.distributed as tdist
atexit.register(lambda: print("initialized at exit:", tdist.is_initialized(), flush=True))  # runs after meshviz's
import meshviz.distributed as dist
dist.init_parallel_env(timeout=30)
t = torch.ones(2) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("sum", t.tolist(), flush=True)
"""


def test_ranks_started_by_hand_destroy_their_process_group_at_exit():
    """A script that never destroys its group: meshviz does at the interpreter's exit, before its teardown, where
    gloo's threads letting go of the last collective's tensors aborted about one exit in ten after the script had
    succeeded (exit code -6, "terminate called without an active exception"; torch's own scripts do the same)."""
    import subprocess
    import sys

    port = rendezvous.free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _UNDESTROYED], env=_by_hand(rank, 2, port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for out, _ in outs:
        assert out.splitlines() == ["sum [3.0, 3.0]", "initialized at exit: False"], outs


def test_rank_error_is_one_class_with_plain_text_and_coloured_rendering():
    import meshviz.cluster
    import meshviz.cluster.errors
    import meshviz.runtime.world
    import meshviz.testing

    assert meshviz.cluster.RankError is meshviz.cluster.errors.RankError is RankError
    assert meshviz.testing.RankFailed is meshviz.runtime.world.RankError is RankError
    assert meshviz.cluster.RankOutcome is RankOutcome
    red_tb = "\x1b[0;31mTraceback (most recent call last)\x1b[0m\n\x1b[0;31mValueError\x1b[0m: boom"
    outcomes = [RankOutcome(0, 0, "error", "RuntimeError: peer gone"),
                RankOutcome(1, 1, "error", "ValueError: boom", red_tb), RankOutcome(2, 2, "ok", value=7)]
    err = RankError(outcomes, [1], "a note")
    assert err.rank == 1 and err.ranks == [1]
    text = str(err)
    assert "\x1b" not in text
    assert text.startswith("rank 1 raised ValueError: boom (rank 0 stopped because of it)\na note\n")
    assert "--- rank 1 (engine 1) traceback ---\nTraceback (most recent call last)\nValueError: boom" in text
    assert "--- rank 0 (engine 0): error: RuntimeError: peer gone" in text
    shown = err._render_traceback_()
    assert shown[0] == "RankError: rank 1 raised ValueError: boom (rank 0 stopped because of it)"
    assert red_tb in shown  # the notebook keeps the colours
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is RankError and back.ranks == [1] and str(back) == text
    assert [o.status for o in back.outcomes] == ["error", "error", "ok"]
    err.streamed = True
    assert "traceback ---" not in str(err)
    never = RankError([RankOutcome(0, status="error", error="DistStoreError: wait timeout", arrived=True),
                       RankOutcome(1, status="stopped", error="ended when another rank failed", arrived=False)], [1])
    assert str(never).startswith("rank 1 never joined the process group (the others gave up waiting; it was "
                                 "stopped) (rank 0 stopped because of it)")


def test_one_place_chooses_the_rank_that_caused_it():
    from meshviz.ranks.outcomes import error_of, rank_error
    from meshviz.trace.status import RankStatus, RollCall

    ok, err, died = RankOutcome, "error", "died"
    outs = [ok(0, status=err, error="E: a"), ok(1, status=died, error="exit code 1"), ok(2, status="stopped")]
    assert error_of([ok(0), ok(1)]) is None
    assert rank_error(outs).ranks == [0]  # nothing seen failing: the first that did not end well
    assert rank_error(outs, [1, 0]).ranks == [1]  # the first failure seen
    assert rank_error(outs, [(1, 2), 0]).ranks == [1, 2]  # ranks seen failing together
    # a rank that never arrived while every rank seen failing did: the others waited for it
    late = [ok(0, status=err, error="DistStoreError", arrived=True), ok(1, status="stopped", arrived=False)]
    assert rank_error(late, [0]).ranks == [1] and rank_error(late, [0]).diagnosis == []
    # the roll-call's culprits when the first failure came out of a collective, not when a rank died first
    rc = RollCall([RankStatus(0, "in_collective", op="all_reduce", group=(0, 1), seq=1), RankStatus(1, "idle")])
    two = [ok(0, status=err, error="E: timeout"), ok(1, status="stopped")]
    assert rc.culprits() == [1]
    e = rank_error(two, [0], inside={0}, rollcall=rc)
    assert e.ranks == [1] and e.lead and e.diagnosis == rc.blame() and e.rollcall is rc
    assert rank_error(two, [0], rollcall=rc).ranks == [0]  # it failed elsewhere: it is the cause
    assert rank_error(two, rollcall=rc).ranks == [1]  # nothing seen: the roll-call decides
    dead = [ok(0, status=died, error="exit code 9"), ok(1, status="stopped")]
    assert rank_error(dead, [0], inside={0}, rollcall=rc).ranks == [0]
    m = rank_error(two, [0], mismatch=([1, 0, 1], "ranks 0, 1 sit in different collectives"), note="n")
    assert m.ranks == [0, 1] and m.lead and m.diagnosis == ["ranks 0, 1 sit in different collectives"]
    assert m.note == "n"


def test_every_way_of_making_ranks_is_a_runner():
    from meshviz.cluster.engines import EngineJob, Engines
    from meshviz.cluster.thread_view import RankResult
    from meshviz.cluster.threads import Threads
    from meshviz.launch.agent import Torchrun, TorchrunJob
    from meshviz.ranks.processes import RankProcesses, SpawnContext
    from meshviz.ranks.runner import Job, Runner
    from meshviz.ranks.threads import ThreadWorld

    for cls in (RankProcesses, ThreadWorld, Engines, Threads, Torchrun):
        assert all(callable(getattr(cls, m, None)) for m in ("start", "submit", "interrupt", "stop")), cls
        assert cls.kind in ("processes", "threads", "engines", "torchrun")
    for cls in (SpawnContext, EngineJob, RankResult, TorchrunJob):
        assert all(callable(getattr(cls, m, None)) for m in ("done", "wait", "pending", "outcomes", "error")), cls
    tw = ThreadWorld(2).start(join=False)
    try:
        assert isinstance(tw, Runner)
        job = tw.submit(lambda r: r * 10)
        assert isinstance(job, Job) and job.wait(30) and job.error() is None
        assert [o.value for o in job.outcomes()] == [0, 10] and job.pending() == []
        bad = tw.submit(lambda r: 1 / r, ranks=[1, 0])
        assert bad.wait(30) and bad.error().ranks == [0] and "ZeroDivisionError" in str(bad.error())
    finally:
        tw.stop()
    assert isinstance(RankProcesses(2, 10), Runner)


def test_rank_processes_run_one_function():
    from meshviz.ranks.processes import RankProcesses

    procs = RankProcesses(2, 30, "fork").start()
    try:
        job = procs.submit(_exits_with_rank)
        assert job.wait(60) and job.done() and job.pending() == []
        err = job.error()
        assert err is not None and err.ranks == [1] and job.outcomes()[1].status == "died"
        assert job.outcomes()[0].status in ("ok", "stopped")
        with pytest.raises(RuntimeError, match="one function"):
            procs.submit(_exits_with_rank)
    finally:
        procs.stop()


def _exits_with_rank(rank):
    os._exit(rank)


def _sleeps(prefix, rank):
    open(prefix + str(rank), "w").close()
    for _ in range(1200):
        time.sleep(0.05)


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_an_interrupted_process_rank_is_named_and_the_others_stop(method, tmp_path):
    from meshviz.ranks.processes import RankProcesses

    prefix = str(tmp_path / "started")
    procs = RankProcesses(2, 30, method).start()
    try:
        job = procs.submit(partial(_sleeps, prefix))
        wait_for_files(prefix, 2)
        t = time.monotonic()
        procs.interrupt([1])
        # before: torch's wrapper ended rank 1 with exit code 0 (outcome "ok") and rank 0 slept on
        assert job.wait(10) and time.monotonic() - t < 10
        err = job.error()
        assert err is not None and err.ranks == [1]
        assert [o.status for o in job.outcomes()] == ["stopped", "error"]
        assert "rank 1 was interrupted (KeyboardInterrupt)" in job.outcomes()[1].error
        assert "KeyboardInterrupt" in job.outcomes()[1].traceback and "_sleeps" in job.outcomes()[1].traceback
    finally:
        procs.stop()


def test_stop_ends_a_running_process_job_and_its_error_says_so(tmp_path):
    from meshviz.ranks.processes import RankProcesses

    prefix = str(tmp_path / "started")
    procs = RankProcesses(2, 30, "fork").start()
    job = procs.submit(partial(_sleeps, prefix))
    wait_for_files(prefix, 2)
    assert not job.done() and job.pending() == [0, 1] and job.error() is None
    procs.stop()
    why = "ended by stop() before it returned"
    assert job.done() and job.pending() == []
    assert [(o.status, o.error) for o in job.outcomes()] == [("stopped", why)] * 2
    err = job.error()  # before: None, as if the job had ended well
    assert err is not None and err.ranks == [0, 1] and str(err).startswith(f"rank 0 was stopped ({why}); rank 1")


# -- spawn and run_ranks name the rank that caused it ------------------------------------------------------------
def skips_the_rendezvous_on_rank_2():
    import meshviz.distributed as dist

    if int(os.environ["RANK"]) == 2:
        return  # never joins: the others wait for it until the timeout
    dist.init_parallel_env()
    dist.barrier()


def dies_on_rank_1(code):
    import torch

    import meshviz.distributed as dist

    dist.init_parallel_env()
    if dist.get_rank() == 1:
        time.sleep(0.2)
        os._exit(code)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_spawn_names_a_rank_that_never_joins():
    import meshviz.distributed as dist

    t0 = time.time()
    with pytest.raises(RankError) as info:
        dist.spawn(skips_the_rendezvous_on_rank_2, nprocs=3, timeout=2, devices="cpu")
    err = info.value
    assert time.time() - t0 < 60
    assert err.ranks == [2] and err.rank == 2
    assert str(err).startswith("rank 2 never joined the process group (it returned without joining)")
    by = {o.rank: o for o in err.outcomes}
    assert by[2].status == "ok" and by[2].arrived is False
    # spawn ends the others once one of them waits in the rendezvous for rank 2: the other may not have come yet
    assert (by[0].arrived or by[1].arrived) and {by[0].status, by[1].status} <= {"error", "stopped"}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_spawn_and_run_ranks_name_a_rank_that_dies():
    import meshviz.distributed as dist
    from meshviz.testing import RankFailed, run_ranks

    with pytest.raises(RankError) as info:
        dist.spawn(dies_on_rank_1, args=(7,), nprocs=3, timeout=20, devices="cpu")
    err = info.value
    assert err.ranks == [1] and str(err).startswith("rank 1 died (exit code 7)")
    assert all(o.status in ("error", "stopped") for o in err.outcomes if o.rank != 1)
    with pytest.raises(RankFailed) as info:
        run_ranks(dies_on_rank_1, 2, 3, timeout=60, collective_timeout=20)
    err = info.value
    assert err.ranks == [1] and str(err).startswith("rank 1 died (exit code 3)")
    assert {o.rank: o.status for o in err.outcomes}[0] in ("error", "ok")
    assert run_ranks(dies_on_rank_1, 1, 3, timeout=60) == [1.0]  # a lone rank 0 never dies


def spins_on(rank):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    if dist.get_rank() == rank:
        time.sleep(0.3)  # ranks as threads: the others take the turn and reach the all-reduce first
        while True:  # pure Python: never waits, never sleeps
            time.perf_counter()
    t = torch.ones(1)
    dist.all_reduce(t)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["processes", "threads"])
def test_run_ranks_past_its_deadline_names_the_rank_that_never_came(kind):
    from meshviz.testing import RankFailed, run_ranks

    # processes: 8 s, so that rank 0 is in the all-reduce by then on a loaded machine (its start took over 3 s once)
    deadline = 8 if kind == "processes" else 3
    with pytest.raises(RankFailed) as info:
        run_ranks(spins_on, 2, 1, timeout=deadline, collective_timeout=30, ranks=kind)
    err = info.value  # rank 0 waits in the all-reduce, rank 1 spins
    assert err.ranks == [1] and err.lead, str(err)
    assert str(err).startswith("rank 1 never entered all_reduce #1 on group [0, 1]; it is running at "
                               "test_rendezvous.py:"), str(err)
    assert "in spins_on(); rank 0 waited in all_reduce #1 on group [0, 1] for " in str(err)
    by = {o.rank: o for o in err.outcomes}
    assert by[0].status == by[1].status == "running", err.outcomes
    assert by[0].error.startswith(f"no result after {deadline} s;")
    if kind == "threads":  # the rank that runs first keeps the turn: the other never runs
        _FIRST.clear()
        with pytest.raises(RankFailed) as info:
            run_ranks(first_spins, 2, timeout=3, collective_timeout=30, ranks=kind)
        err = info.value
        held, other = _FIRST[0], 1 - _FIRST[0]
        assert len(_FIRST) == 1 and err.ranks == [held] and not err.lead
        assert str(err).startswith(f"rank {held} was still running (no result after 3 s; interrupted at "
                                   "test_rendezvous.py:"), str(err)
        assert (f"ranks as threads take turns: rank {held} kept the turn for 3 s without entering a collective or "
                f"sleeping, so rank {other} could not go on") in str(err)


_FIRST: list = []


def first_spins():
    import meshviz.distributed as dist

    _FIRST.append(dist.get_rank())  # before init: its RANK
    if len(_FIRST) == 1:
        while True:
            time.perf_counter()
    dist.init_parallel_env()


def sums_ranks():
    import meshviz.distributed as dist

    dist.init_parallel_env()
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()


@pytest.mark.timeout(120)
def test_spawn_takes_paddles_options_and_returns_its_context():
    import meshviz.distributed as dist
    from meshviz.ranks.processes import SpawnContext

    with pytest.warns(DeprecationWarning, match="'started_port' is deprecated and ignored"):
        ctx = dist.spawn(sums_ranks, nprocs=2, ips="127.0.0.1", started_port=6170, devices="cpu")
    assert isinstance(ctx, SpawnContext) and ctx.join() and [p.exitcode for p in ctx.processes] == [0, 0]

