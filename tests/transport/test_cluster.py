"""meshviz.Cluster: ipyparallel engines as ranks, live events, failures named by rank."""

import json
import os
import shutil
import signal
import stat
import time

import pytest

import meshviz
from meshviz import trace
from meshviz.cluster import RankError

from .. import cluster_checks as checks
from .started import wait_for_files

N = 3
pytestmark = [pytest.mark.slow, pytest.mark.engines, pytest.mark.timeout(240)]


_PEER = ("import socket, sys\n"
         "server = socket.create_server(('127.0.0.1', 0))\n"
         "print(server.getsockname()[1], flush=True)\n"
         "conn, _ = server.accept()\n"
         "conn.recv(1)\n")  # until this side shuts the connection down


def test_an_abort_shuts_down_the_connections_to_peer_processes_only():
    """What a gloo rank does when told to abort: its TCP connections to the other ranks' processes read EOF at once;
    a connection to a process that is not a peer (here, this one) keeps working."""
    import socket
    import subprocess
    import sys

    from meshviz.cluster.peers import close_peer_sockets

    peer = subprocess.Popen([sys.executable, "-c", _PEER], stdout=subprocess.PIPE, text=True)
    server = socket.create_server(("127.0.0.1", 0))
    try:
        to_peer = socket.create_connection(("127.0.0.1", int(peer.stdout.readline())), timeout=10)
        to_self = socket.create_connection(server.getsockname(), timeout=10)
        accepted, _ = server.accept()
        assert close_peer_sockets(set()) == 0
        assert close_peer_sockets({peer.pid}) == 1
        assert to_peer.recv(1) == b""  # shut down: end of stream now, not at the timeout
        assert peer.wait(10) == 0  # the peer's end saw it too
        to_self.sendall(b"x")
        assert accepted.recv(1) == b"x"
        for s in (to_peer, to_self, accepted):
            s.close()
    finally:
        server.close()
        peer.kill()
        peer.wait()


@pytest.fixture(scope="module")
def cluster():
    c = meshviz.Cluster(n=N, timeout=30, devices="cpu")
    yield c
    c.stop()


def test_ranks_devices_and_state(cluster):
    assert cluster.state == "ready"
    assert cluster.ranks == list(range(N))
    assert cluster.engine_ids == list(range(N))  # rank == engine id on a fresh cluster
    assert cluster.devices == ["cpu"] * N
    assert cluster.view.targets == cluster.engine_ids
    seen = cluster.apply(_whoami)
    for r, s in enumerate(seen):
        assert s["rank"] == r and s["world"] == N
        assert s["env"] == {"RANK": str(r), "WORLD_SIZE": str(N), "LOCAL_RANK": str(r),
                            "MASTER_ADDR": "127.0.0.1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        assert s["threads"] == 1 and s["backend"] == "gloo" and s["timeout_s"] == 30
    text = repr(cluster)
    assert f"Cluster({N} ranks, gloo, ready" in text
    for r in range(N):
        assert f"rank {r}: engine {r}, cpu" in text
    # private state: connection files 0600 in a 0700 dir, controller on loopback
    assert stat.S_IMODE(os.stat(cluster.state_dir).st_mode) == 0o700
    sec = os.path.join(cluster.state_dir, "security")
    files = [f for f in os.listdir(sec) if f.endswith(".json") and f.startswith("ipcontroller")]
    assert files
    for f in files:
        p = os.path.join(sec, f)
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
        with open(p) as fh:
            info = json.load(fh)
        assert info["location"] in ("127.0.0.1", "localhost") or info.get("interface", "").endswith("127.0.0.1")
    # the ranks listen on loopback only: the process-group store, gloo's sockets, ipyparallel's
    import psutil

    pids = {i["pid"] for i in cluster.info}
    listening = [c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.pid in pids]
    assert listening and set(listening) == {"127.0.0.1"}
    # the controller beats every 0.5 s (an engine checks every beat + 0.5 s): a start waits for one beat, not 3 s
    assert cluster.apply(_heartbeat_check_ms) == [1000] * N


def _heartbeat_check_ms():
    from ipyparallel.engine.app import IPEngine

    return IPEngine.instance().hb_check_period


def _whoami():
    import os

    import torch
    import torch.distributed as tdist

    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"]
    return {"rank": tdist.get_rank(), "world": tdist.get_world_size(), "env": {k: os.environ.get(k) for k in keys},
            "threads": torch.get_num_threads(), "backend": tdist.get_backend(),
            "timeout_s": float(os.environ["MESHVIZ_TIMEOUT"])}


def test_all_reduce_values_in_rank_order(cluster):
    ar = cluster.execute(
        "import torch, torch.distributed as tdist\n"
        "x = torch.tensor([float(tdist.get_rank() + 1)])\n"
        "tdist.all_reduce(x)\n"
        "print(tdist.get_rank(), x.item())\n")
    assert ar.stdout == [f"{r} {float(sum(range(1, N + 1)))}\n" for r in range(N)]


def test_events_arrive_while_the_cell_runs(cluster, tmp_path):
    checks.events_arrive_while_the_cell_runs(cluster, N, tmp_path)


def test_reshard_events_carry_the_planners_steps(cluster):
    checks.reshard_events_carry_the_planners_steps(cluster, N)


def test_record_replays_to_the_same_events(cluster, tmp_path):
    cluster.execute("from meshviz import trace\nfrom meshviz.trace import Event\n"
                    "for i in range(4): trace.emit(Event(kind='mark', step=i, values=[i, 0.5]))")
    assert len(cluster.events) >= 4 * N
    path = str(tmp_path / "run.jsonl")
    n = cluster.record(path)
    assert n == len(cluster.events)
    back = trace.load_events(path)
    key = lambda e: (e.rank, e.seq)  # noqa: E731
    assert [e.to_dict() for e in sorted(back, key=key)] == [e.to_dict() for e in sorted(cluster.events, key=key)]
    got = []
    assert trace.replay(path, got.append) == n and len(got) == n


def test_rank_raising_mid_collective_stops_every_rank(cluster):
    checks.rank_raising_mid_collective_stops_every_rank(cluster, N)


def test_same_error_on_every_rank_keeps_the_process_group(cluster):
    checks.same_error_on_every_rank_keeps_the_process_group(cluster, N, settle=0.5)


_STARTED = "import pathlib, torch.distributed as tdist\npathlib.Path({prefix!r} + str(tdist.get_rank())).touch()\n"


def test_interrupt_reaches_the_engines(cluster, tmp_path):
    prefix = str(tmp_path / "started")
    cell = _STARTED.format(prefix=prefix) + "import time\nfor _ in range(600): time.sleep(0.05)"
    ar = cluster.view.execute(cell, block=False)
    wait_for_files(prefix, N)
    cluster.interrupt()
    with pytest.raises(Exception) as info:
        ar.get(timeout=20)
    assert "KeyboardInterrupt" in str(info.value)


def test_interrupt_unblocks_ranks_stuck_in_a_collective(cluster, tmp_path):
    prefix = str(tmp_path / "started")
    cell = (_STARTED.format(prefix=prefix) + "import torch\n"
            "t = torch.zeros(1)\n"
            "tdist.recv(t, src=(tdist.get_rank() + 1) % tdist.get_world_size())  # every rank waits: deadlock\n")
    mark = cluster._mark()  # before the cell goes: a rank may report before _finish starts waiting
    ar = cluster.view.execute(cell, block=False)
    wait_for_files(prefix, N)
    cluster.interrupt()
    with pytest.raises(RankError) as info:
        cluster._finish(ar, timeout=25, mark=mark)
    # the 30 s collective timeout was not needed: no rank was still waiting at the 25 s deadline
    assert [o.status for o in info.value.outcomes] == ["error"] * N
    ar = cluster.execute("x = torch.ones(1); tdist.all_reduce(x); print(x.item())")
    assert ar.stdout == [f"{float(N)}\n"] * N


def _what_sigint_does():
    """The engine's SIGINT handler on a frame outside any request (as while a reply is sent) and on this one."""
    import sys

    handler, out = signal.getsignal(signal.SIGINT), []
    for frame in (None, sys._getframe()):
        try:
            handler(signal.SIGINT, frame)
            out.append("ignored")
        except KeyboardInterrupt:
            out.append("raised")
    return out


def test_an_interrupt_after_the_cell_leaves_its_reply_alone(cluster):
    """SIGINT while an engine sends a finished cell's reply would lose the reply (the kernel raises during every
    request), and the cluster would wait for that rank forever: outside the user's code it is ignored, and
    interrupts landing all around a cell's end each give either the cell's result or its KeyboardInterrupt, at
    once."""
    assert cluster.apply(_what_sigint_does) == [["ignored", "raised"]] * N
    import random
    import threading

    rng = random.Random(3)
    for _ in range(40):
        timer = threading.Timer(0.05 + rng.uniform(0.0, 0.03), cluster.interrupt, kwargs={"abort_after": None})
        t0 = time.monotonic()
        timer.start()
        try:
            cluster.execute("import time\ntime.sleep(0.05)\n", timeout=20)
        except RankError as e:
            assert all(o.status in ("ok", "error") for o in e.outcomes), str(e)
            assert all("KeyboardInterrupt" in o.error for o in e.outcomes if o.status == "error"), str(e)
        timer.join()
        assert time.monotonic() - t0 < 10
    assert cluster.execute("print(1)").stdout == ["1\n"] * N


def test_px_output_comes_in_rank_order(cluster):
    checks.px_output_in_rank_order(cluster, N)


def test_px_magic_names_the_rank(cluster):
    checks.px_magic_names_the_rank(cluster)


def test_killed_engine_is_reported_and_restart_works(cluster, tmp_path):
    """Runs last: it breaks the shared cluster, then restarts it."""
    pid = cluster.info[1]["pid"]
    go = str(tmp_path / "go")
    mark = cluster._mark()
    ar_future = cluster.view.execute(  # the ranks reach the all_reduce only once rank 1 is dead
        f"import os, time, torch, torch.distributed as tdist\nwhile not os.path.exists({go!r}): time.sleep(0.01)\n"
        "x = torch.ones(1)\ntdist.all_reduce(x)\n", block=False)
    os.kill(pid, signal.SIGKILL)
    open(go, "w").close()
    with pytest.raises(RankError) as info:
        cluster._finish(ar_future, timeout=25, mark=mark)  # the death is reported before the 30 s collective timeout
    assert 1 in info.value.ranks and "rank 1 died" in str(info.value)
    assert cluster.state == "broken"
    assert "DEAD" in repr(cluster)
    with pytest.raises(RuntimeError, match="rank 1"):
        cluster.execute("pass")
    old_dir = cluster.state_dir
    cluster.restart()
    assert os.path.exists(os.path.join(old_dir, "cluster.log"))  # a dead engine's cluster keeps its logs
    shutil.rmtree(old_dir)
    assert cluster.state == "ready" and cluster.engine_ids == list(range(N))
    ar = cluster.execute("import torch, torch.distributed as tdist\nx = torch.ones(1); tdist.all_reduce(x)\n"
                         "print(x.item())")
    assert ar.stdout == [f"{float(N)}\n"] * N


def test_stop_is_quiet_and_cleans_up(capfd):
    c = meshviz.Cluster(n=2, timeout=20, devices="cpu")
    pids = [i["pid"] for i in c.info]
    capfd.readouterr()
    c.stop()
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert c.state == "stopped" and "stopped" in repr(c)
    assert not os.path.exists(c.state_dir)  # nothing failed: the state dir and its logs are removed
    import psutil

    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, "engines still alive 10 s after stop()"
        time.sleep(0.05)


@pytest.mark.timeout(30)
def test_rank_configs_bind_devices_as_documented(monkeypatch):
    from meshviz.cluster.config import rank_configs

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # GPU ids as this process sees them: all of them

    probes = [{"host": "a", "pid": 10 + r, "port": 5000 + r} for r in range(4)]
    gpu = rank_configs(probes, "cuda", None, "127.0.0.1", True, 60.0, None, ncpu=16)
    assert [c["env"]["CUDA_VISIBLE_DEVICES"] for c in gpu] == ["0", "1", "2", "3"]  # rank r -> GPU r
    assert [c["backend"] for c in gpu] == ["nccl"] * 4 and [c["threads"] for c in gpu] == [4] * 4
    assert all(c["env"]["MASTER_PORT"] == "5000" for c in gpu)  # rank 0's held port serves the store
    assert gpu[1]["peer_pids"] == [10, 12, 13]
    listed = rank_configs(probes, "list", [3, 2, 1, 0], "127.0.0.1", True, 60.0, None)
    assert [c["env"]["CUDA_VISIBLE_DEVICES"] for c in listed] == ["3", "2", "1", "0"]
    cpu = rank_configs(probes, "cpu", None, "127.0.0.1", True, 60.0, None)
    assert all(c["env"]["CUDA_VISIBLE_DEVICES"] == "" and c["threads"] == 1 and c["backend"] == "gloo" for c in cpu)
    two_hosts = [{"host": h, "pid": i, "port": 7000 + i} for i, h in enumerate("aabb")]
    cfg = rank_configs(two_hosts, "cuda", None, "10.0.0.1", False, 60.0, None, ncpu=8)
    assert [c["env"]["LOCAL_RANK"] for c in cfg] == ["0", "1", "0", "1"]
    assert [c["env"]["CUDA_VISIBLE_DEVICES"] for c in cfg] == ["0", "1", "0", "1"]
    assert [c["peer_pids"] for c in cfg] == [[1], [0], [3], [2]]
    assert "GLOO_SOCKET_IFNAME" not in cfg[0]["env"] and cfg[0]["env"]["MASTER_ADDR"] == "10.0.0.1"


def test_bad_arguments_raise_before_starting():
    with pytest.raises(ValueError):
        meshviz.Cluster(n=0)
    with pytest.raises(ValueError):
        meshviz.Cluster(n=2, devices="tpu")
    with pytest.raises(ValueError):
        meshviz.Cluster(n=2, timeout=-1)
    with pytest.raises(ValueError):
        meshviz.Cluster(n=2, devices=[0])


@pytest.mark.timeout(30)
def test_control_states_and_the_abort_protocol():
    import threading

    from meshviz.cluster import ClusterState, RankOutcome
    from meshviz.cluster.control import Control

    c = Control()
    sent = []
    c.attach(sent.append)
    assert c.state is ClusterState.STOPPED and c.state == "stopped" and f"{c.state}" == str(c.state) == "stopped"
    c.begin_start()
    assert c.state == "starting"
    with pytest.raises(RuntimeError, match="already starting"):
        c.begin_start()
    c.started()
    assert c.state == "ready"
    c.on_control({"type": "failed", "rank": 1, "time": time.time()})
    assert sent == [{"type": "failed", "rank": 1}] and c.failures[0]["received"] > 0
    threads = [threading.Thread(target=c.on_control, args=({"type": "stuck", "rank": r, "failed": 1},))
               for r in (0, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sent[1:] == [{"type": "abort", "origin": 1}]  # told once, however many ranks report stuck
    assert c.state == "aborted" and c.needs_reset
    c.reset_done()
    assert c.state == "ready" and not c.needs_reset and not c.abort_sent
    c.report_dead(2, "engine process 9 exited")
    assert c.state == "broken" and c.dead == {2: "engine process 9 exited"}
    assert sent[-2:] == [{"type": "failed", "rank": 2}, {"type": "abort", "origin": 2}]
    c.reset_done()
    assert c.state == "broken"  # only a restart mends a dead rank
    err = c.rank_error([RankOutcome(0, 0, "error", "RuntimeError: peer"), RankOutcome(2, 2, "died", c.dead[2])],
                       since=1, t0=time.time())
    assert err.ranks == [2] and "restart" in err.note
    assert c.stopped() and c.state == "stopped" and not c.stopped()

    m = Control()
    m.begin_start()
    m.started()
    polls = []

    def find_dead():
        polls.append(1)
        return {1: "engine process 5 exited"} if len(polls) < 4 else None  # None: the backend is gone

    m.start_monitor(find_dead, interval=0.01)
    m._monitor.join(5)
    assert len(polls) == 4 and m.dead == {1: "engine process 5 exited"} and m.state == "broken"
    assert [f["rank"] for f in m.failures] == [1]  # reported once
