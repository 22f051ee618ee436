"""The nodes' line through node 0's store costs a watch tick the same few store calls whatever the number of nodes;
nodes given settings that must agree, differently, are refused on every node before any worker starts."""

import os
import signal

import pytest

from meshviz.launch.nodes import NodeLine
from meshviz.runtime import rendezvous
from tests.transport.started import finish, none_left, start_launch


class _Counting:
    """A store client that counts the calls made through it."""

    def __init__(self, store):
        self.store, self.calls = store, 0

    def __getattr__(self, name):
        op = getattr(self.store, name)

        def call(*args, **kwargs):
            self.calls += 1
            return op(*args, **kwargs)

        return call


class _Job:
    """A node's agent as follow_restarts sees it: its run, and the runs it was told to end."""

    def __init__(self):
        self.attempt, self.ended = 0, []

    def done(self):
        return False

    def end_run(self, attempt, sig=signal.SIGTERM):
        self.ended.append((attempt, sig))
        return True


class _Stopped:
    def blame(self):
        return ["rank 3 never entered all_reduce"]


def _line(server, nnodes: int, node: int, counted: bool = False) -> NodeLine:
    line = NodeLine(f"{rendezvous.LOOPBACK}:{server.port}", nnodes, node)
    line._store = rendezvous.connect_store(rendezvous.LOOPBACK, server.port, None, 5.0)
    if counted:
        line._store = _Counting(line._store)
    return line


def _tick(line: NodeLine, job: _Job) -> tuple[int, dict | None]:
    """One watch tick (follow_restarts, then news): (the store calls it made, the news)."""
    before = line._store.calls
    line.follow_restarts(job)
    news = line.news()
    return line._store.calls - before, news


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nnodes", [2, 64])
def test_a_watch_tick_costs_two_store_calls_whatever_the_number_of_nodes(nnodes, capsys):
    res = rendezvous.reserve_port()
    server = rendezvous.serve_store(res, None, 30)
    try:
        me, job = _line(server, nnodes, 1, counted=True), _Job()
        assert [_tick(me, job) for _ in range(5)] == [(2, None)] * 5
        other = _line(server, nnodes, nnodes - 1)
        other.say_failed(4, "DistNetworkError: Connection reset by peer", True, 1.0)  # only lost its peer
        assert _tick(me, job)[1] is None
        other.say_failed(5, "ValueError: late", False, 3.0)  # said twice: its last word counts
        _line(server, nnodes, 0).say_failed(0, "ValueError: early", False, 2.0)
        calls, news = _tick(me, job)
        assert news["node"] == 0 and news["rank"] == 0 and news["what"] == "ValueError: early"
        assert [_tick(me, job) for _ in range(3)] == [(2, news)] * 3
        me.say_failed(2, "ValueError: earliest, but this node's own", False, 0.5)
        assert _tick(me, job)[1]["what"] == "ValueError: early"
        _line(server, nnodes, 0).say_stopped(_Stopped())  # node 0's roll-call comes first
        assert _tick(me, job)[1] == {"node": 0, "lines": ["rank 3 never entered all_reduce"]}
        assert job.ended == []

        # another node's agent restarted its workers (run 1): this node's run 0 is ended, once
        ahead = _Job()
        ahead.attempt = 1
        other.follow_restarts(ahead)
        assert _tick(me, job)[0] == 3 and job.ended == [(0, signal.SIGTERM)]  # one look, then who restarted
        assert f"node {nnodes - 1} restarted its workers (restart 1)" in capsys.readouterr().err
        assert _tick(me, job)[0] == 1 and job.ended == [(0, signal.SIGTERM)]  # ending: only the news
        job.attempt = 1  # this node's agent restarted too: nothing ahead of run 1
        calls = [_tick(me, job)[0] for _ in range(4)]
        assert calls[1:] == [2, 2, 2] and job.ended == [(0, signal.SIGTERM)]
        ahead.attempt = 3  # its run 2 was too short for its watch to see: run 3 is still one look ahead of run 1
        other.follow_restarts(ahead)
        _tick(me, job)
        assert job.ended == [(0, signal.SIGTERM), (1, signal.SIGTERM)]
    finally:
        del server


_SCRIPT = """
import os
open(os.path.join(os.environ["STARTED"], "worker" + os.environ["RANK"]), "w").close()
"""


def _two_nodes(tmp_path, flags0, flags1):
    port = rendezvous.free_port()
    procs = []
    for node, flags in ((0, flags0), (1, flags1)):
        (tmp_path / f"n{node}").mkdir()
        procs.append(start_launch(tmp_path / f"n{node}", _SCRIPT, 1, "--nnodes", "2", "--rank", str(node), "--master",
                                  f"127.0.0.1:{port}", *flags, rdzv_timeout=25, timeout=10,
                                  MESHVIZ_CHECK_COLLECTIVES=""))
    outs = [finish(p, 40) for p in procs]
    none_left([p.pid for p in procs])
    return [p.returncode for p in procs], [err for _, err in outs]


@pytest.mark.timeout(60)
def test_nodes_given_different_max_restart_are_refused_on_every_node_before_any_worker_starts(tmp_path):
    codes, errs = _two_nodes(tmp_path, ["--max_restart", "1"], ["--max_restart", "0"])
    for code, err in zip(codes, errs):
        assert code not in (0, None), err[-2000:]
        assert "--max_restart differs across nodes: node 0 has 1, node 1 has 0" in err, err[-2000:]
        assert "Traceback" not in err, err[-3000:]
    assert not [f for n in (0, 1) for f in os.listdir(tmp_path / f"n{n}") if f.startswith("worker")]


@pytest.mark.timeout(60)
def test_nodes_given_different_job_ids_are_refused_on_every_node_not_left_waiting(tmp_path):
    # on their own, different job ids left node 0 waiting for node 1's keys under its own job until the timeout;
    # --check_collectives on one node only fails a sound script's first collective after the timeout
    codes, errs = _two_nodes(tmp_path, ["--job_id", "a", "--check_collectives"], ["--job_id", "b", "--nproc_per_node",
                                                                                  "2"])
    for code, err in zip(codes, errs):
        assert code not in (0, None), err[-2000:]
        assert '--job_id differs across nodes: node 0 has "a", node 1 has "b"; --check_collectives differs across ' \
               'nodes: node 0 has true, node 1 has false' in err, err[-2000:]
    assert not [f for n in (0, 1) for f in os.listdir(tmp_path / f"n{n}") if f.startswith("worker")]


def _agree_all(settings_of) -> dict:
    """Nodes 0..2 (threads, node 2 first) agreeing through one served store: node -> (error class, message)."""
    import threading

    from meshviz.launch.agreement import agree

    server = rendezvous.serve_store(rendezvous.reserve_port(), None, 30)
    master, errors = f"{rendezvous.LOOPBACK}:{server.port}", {}

    def node(k):
        try:
            agree(master, k, settings_of(k), 20)
        except Exception as e:
            errors[k] = (type(e).__name__, str(e))

    threads = [threading.Thread(target=node, args=(k,)) for k in (2, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(25)
    assert not any(t.is_alive() for t in threads)
    del server
    return errors


@pytest.mark.timeout(30)
def test_three_nodes_one_with_another_max_restart_all_refuse_naming_every_nodes_value():
    errors = _agree_all(lambda k: {"--nnodes": 3, "--max_restart": 2 if k == 2 else 0, "--job_id": "j"})
    want = ("SettingsDiffer", "the nodes were given settings that must agree: --max_restart differs across nodes: "
            "node 0 has 0, node 1 has 0, node 2 has 2 (no worker was started)")
    assert errors == {0: want, 1: want, 2: want}
    assert _agree_all(lambda k: {"--nnodes": 3, "--max_restart": 1, "--job_id": "j"}) == {}


@pytest.mark.timeout(30)
def test_a_node_done_with_a_failed_job_says_so_and_node_0_stops_waiting_for_it():
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore

    server = TCPStore(rendezvous.LOOPBACK, 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    try:
        node1, node0 = _line(server, 2, 1), _line(server, 2, 0)
        node1.finish(failed=True)  # it read what stopped the job: node 0 need not serve its store for it any more
        assert node0._store.check(["meshviz/launch/done/1"])
        t0 = time.monotonic()
        node0.finish(failed=True, timeout=5.0)
        assert time.monotonic() - t0 < 1.0
    finally:
        del server


class _Ended:
    """A node's finished job as NodeLine.text sees it: its workers, and those that exited with code 0."""

    def __init__(self, ranks, well):
        self.ranks, self._well = ranks, well

    def exited_well(self):
        return 0, self._well


@pytest.mark.parametrize("well, here", [([2, 3], "the workers here had finished theirs"),
                                        ([2], "the workers here stopped or lost their connection because of it"),
                                        (None, "the workers here stopped or lost their connection because of it")])
def test_the_news_says_whether_this_nodes_workers_had_finished_before_it_came(well, here):
    line = NodeLine("127.0.0.1:1", 2, 1)
    failed = {"node": 0, "rank": 1, "what": "ValueError: late", "lost": False, "time": 1.0}
    job = None if well is None else _Ended([2, 3], well)
    assert line.text(failed, job) == [f"the worker with global rank 1 (node 0) failed first: ValueError: late; {here}"]
    stopped = line.text({"node": 0, "lines": ["rank 1 never entered all_reduce"]}, job)
    assert stopped[0] == "rank 1 never entered all_reduce"
    assert stopped[1].endswith("the workers here had finished" if well == [2, 3] else "the workers here were stopped")
