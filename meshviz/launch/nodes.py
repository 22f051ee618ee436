"""What the nodes of a job tell each other through node 0's store: their numbers of workers, what stopped the job."""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import sys
import threading
import time

__all__ = ["IPS_ENV", "publish", "counts", "world", "ips_endpoints", "rollcall_host", "NodeLine", "looks_lost",
           "tell_nodes", "rendezvous_failure"]

IPS_ENV = "MESHVIZ_LAUNCH_IPS"  # {"ips": [...], "start_port": P} when --ips names the nodes
_KEY = "meshviz/launch/nproc/"


def _key(node: int) -> str:
    return f"{_KEY}{node}"


def publish(store, node: int, nproc: int) -> None:
    """Say that node ``node`` runs ``nproc`` workers (its local rank 0 says it, once its workers have started)."""
    store.set(_key(node), str(nproc))


def counts(store, nnodes: int, timeout: float) -> list[int]:
    """Every node's number of workers, waiting up to ``timeout`` s for the nodes that have not said it yet."""
    keys = [_key(k) for k in range(nnodes)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as e:
        missing = [k for k, key in enumerate(keys) if not store.check([key])]
        which = f"nodes {', '.join(map(str, missing))} never said how many workers they run" if len(missing) > 1 \
            else f"node {missing[0] if missing else '?'} never said how many workers it runs"
        raise RuntimeError(f"meshviz.launch: {which} within {timeout:g} s ({type(e).__name__})") from None
    return [int(store.get(key)) for key in keys]


def world(store, nnodes: int) -> int | None:
    """The number of workers of all nodes, if every node has said its number; else None."""
    keys = [_key(k) for k in range(nnodes)]
    if not store.check(keys):
        return None
    return sum(int(store.get(key)) for key in keys)


def ips_endpoints(spec: str, per_node: list[int]) -> list[str]:
    """Paddle's endpoints with --ips: node k's workers at ``ips[k]:start_port + i``, node by node."""
    from ..runtime.rendezvous import paddle_endpoints

    d = json.loads(spec)
    return [e for ip, n in zip(d["ips"], per_node) for e in paddle_endpoints(ip, d["start_port"], n)]


def rollcall_host(host: str, port: int, nnodes: int, nproc: int, hang_after: float, runner=None):
    """Node 0's roll-call host for a launched job: its world is the sum of the nodes' workers once they have said
    their numbers (``nnodes * nproc`` until then); it follows ``runner``'s restarts (each run's keys are its own)."""
    from ..runtime.watchdog import RollCallHost

    class _LaunchRollCall(RollCallHost):
        def collect(self, n: int, timeout: float = 1.5):
            if nnodes > 1:
                self.world = world(self._connect(), nnodes) or self.world
            return super().collect(n, timeout)

    def attempt() -> int:
        return runner.job.attempt if runner is not None and runner.job is not None else 0

    return _LaunchRollCall(host, port, nnodes * nproc, hang_after, wait_for_store=60.0, attempt=attempt).start()


# what the nodes said stopped the job, one record each, numbered by _SAID: node 0's roll-call found a wait nothing
# can end {"node", "lines"}, or a node's worker failed first {"node", "rank", "what", "lost", "time"}; a watch
# looks at the count alone (one store call) until it moves, whatever the number of nodes
_SAID = "meshviz/launch/said"
_RECORD = "meshviz/launch/said/"  # + number
_DONE = "meshviz/launch/done/"  # + node: the node has read what stopped the job and is ending
_RUN = "meshviz/launch/run/"  # + run: the first node whose workers entered that run (the agent's restart count)
# what a worker's error says when it only lost its connection to a peer that failed elsewhere
_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
         "never reached the rendezvous", "DistNetworkError", "DistStoreError", "Timed out", "timed out")


def looks_lost(what: str) -> bool:
    """Does a worker's error say that it lost its connection (to a peer, or to the store), not what went wrong?"""
    return any(s in what for s in _LOST)


class NodeLine:
    """This node's line to the other nodes of a job, through the store on node 0 (``master``): node 0 says there
    that its roll-call stopped the job, each node which of its workers failed first. While this node's workers
    run, :meth:`watch` looks there a few times a second; told that another node stopped the job (or that a worker
    there failed on its own), it keeps that in ``heard`` and stops its own workers (SIGTERM to this process: the
    agent ends them), so that every node says what happened within seconds, whatever its own workers lost."""

    def __init__(self, master: str, nnodes: int, node: int):
        self.master, self.nnodes, self.node = master, nnodes, node
        self.heard: dict | None = None
        self._store = None
        self._lock = threading.Lock()
        self._over = threading.Event()
        self._thread: threading.Thread | None = None
        self._run = 0  # the run this node said its workers are in
        self._read = 0  # the records of _SAID read so far
        self._said: dict[int, dict] = {}  # node -> the last record it said
        self._ending: tuple[int, float] | None = None  # (run, when to SIGKILL): this node's run, ended to follow

    def _call(self, op: str, *args):
        with self._lock:
            if self._store is None:
                from ..runtime.rendezvous import connect_store

                host, _, port = self.master.rpartition(":")
                # nobody serves there yet (or any more): fail now, not after a client's retries, which a thread
                # still blocked in them when the interpreter ends turns into an abort
                socket.create_connection((host, int(port)), timeout=1.0).close()
                self._store = connect_store(host, int(port), None, 2.0)
            return getattr(self._store, op)(*args)

    def _set(self, key: str, value: dict) -> None:
        try:
            self._call("set", key, json.dumps(value))
        except Exception:
            pass

    def _say(self, value: dict) -> None:
        """Add ``value`` to what the nodes said stopped the job (the records numbered by ``_SAID``)."""
        try:
            at = int(self._call("add", _SAID, 1))
        except Exception:
            return
        self._set(_RECORD + str(at), value)

    def say_stopped(self, rc) -> None:
        """Node 0: its roll-call found a wait nothing can end (``rc``); the job stops."""
        self._say({"node": self.node, "lines": rc.blame()})

    def say_failed(self, rank: int, what: str, lost: bool, when: float) -> None:
        """This node's worker ``rank`` failed first (``what``; ``lost``: it only lost its connection)."""
        self._say({"node": self.node, "rank": rank, "what": what[:500], "lost": lost, "time": when})

    def news(self) -> dict | None:
        """What another node said stopped the job: node 0's roll-call, else the worker of another node that failed
        on its own first; None while nothing was said (or the store is gone). One store call while nobody said
        anything new, whatever the number of nodes."""
        try:
            said = int(self._call("add", _SAID, 0))
            while self._read < said:
                key = _RECORD + str(self._read + 1)
                if not self._call("check", [key]):
                    break  # counted, not written yet: read at the next look
                record = json.loads(self._call("get", key))
                self._said[record["node"]] = record
                self._read += 1
        except Exception:
            return None
        others = [r for n, r in self._said.items() if n != self.node]
        stopped = [r for r in others if "lines" in r]
        if stopped:
            return stopped[0]
        fails = [r for r in others if not r["lost"]]
        return min(fails, key=lambda f: f["time"]) if fails else None

    def wait_news(self, timeout: float) -> dict | None:
        end = time.monotonic() + timeout
        while self.heard is None and time.monotonic() < end:
            self.heard = self.news()
            if self.heard is None:
                time.sleep(0.2)
        return self.heard

    def follow_restarts(self, job) -> None:
        """Say which run this node's workers are in (the agent's restart count, ``--max_restart``); when another
        node is in a later run (its workers failed: its agent restarted them), end this node's so that its agent
        restarts them too and every node's run meets (their keys on the store are the run's), as Paddle's launch
        restarts every node when one fails; with SIGKILL after the launcher's grace if they outlive the SIGTERM."""
        from .ending import grace

        mine = job.attempt
        if self._ending is not None and self._ending[0] == mine:
            if time.monotonic() > self._ending[1]:
                job.end_run(mine, signal.SIGKILL)
            return
        try:
            while self._run < mine:  # every run this node's workers entered, a short one the watch missed too
                if int(self._call("add", f"{_RUN}{self._run + 1}/n", 1)) == 1:
                    self._call("set", _RUN + str(self._run + 1), str(self.node))
                self._run += 1
            if not self._call("check", [_RUN + str(mine + 1)]):  # one look: is any node in the next run?
                return
            first = int(self._call("get", _RUN + str(mine + 1)))
        except Exception:
            return
        if job.end_run(mine):
            self._ending = (mine, time.monotonic() + grace())
            print(f"meshviz.launch: node {first} restarted its workers (restart {mine + 1}): the workers here "
                  "were stopped to restart with them", file=sys.stderr, flush=True)

    def watch(self, runner) -> None:
        def run():
            while not self._over.wait(0.2):
                job = runner.job
                if job is None or job.done():
                    continue
                self.follow_restarts(job)
                news = self.news()
                if news is not None and not job.done():
                    self.heard = news
                    os.kill(os.getpid(), signal.SIGTERM)  # the agent ends its workers with it
                    return

        self._thread = threading.Thread(target=run, name="meshviz-launch-nodes", daemon=True)
        self._thread.start()

    def finish(self, failed: bool, timeout: float = 5.0) -> None:
        """Stop watching; say that this node is done. Node 0 of a failed job keeps its store served until every
        other node has said so (at most ``timeout`` s): they read there what stopped the job."""
        self._over.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self.node != 0:
            if failed:
                self._set(_DONE + str(self.node), {})
            return
        end = time.monotonic() + timeout
        keys = [_DONE + str(k) for k in range(1, self.nnodes)]
        while failed and time.monotonic() < end:
            try:
                if self._call("check", keys):
                    return
            except Exception:
                return
            time.sleep(0.1)

    def text(self, news: dict, job=None) -> list[str]:
        """What to print of ``news`` on this node (whose ``job`` may have ended well before the news came)."""
        done = job is not None and len(job.exited_well()[1]) == len(job.ranks)
        if "lines" in news:
            here = "the workers here had finished" if done else "the workers here were stopped"
            return [*news["lines"], f"node {news['node']} stopped the job at the roll-call: nothing could end that "
                    f"wait; {here}"]
        here = "the workers here had finished theirs" if done else \
            "the workers here stopped or lost their connection because of it"
        return [f"the worker with global rank {news['rank']} (node {news['node']}) failed first: {news['what']}; "
                f"{here}"]


def tell_nodes(line: NodeLine, job, first: int) -> dict | None:
    """Say which of this node's workers failed first (``first``, of ``job``); returns what another node said
    stopped the job when that explains this node's failure (its workers only lost their connection, or the other
    failed earlier), waiting a few seconds for it; else None."""
    from .agent import _reported_at

    f = job.failures[first]
    what = job.said(first)
    when = _reported_at(f, job.log_dir)
    lost = f.exitcode == -signal.SIGTERM or looks_lost(what)  # SIGTERM: the agent ended it
    line.say_failed(first, what, lost, when)
    news = line.heard or (line.wait_news(3.0) if lost else line.news())
    if news is not None and not lost and news.get("time", when) > when:
        return None
    return news


def rendezvous_failure(e, config) -> str:
    """What a rendezvous that timed out means: which node never arrived (node 0: the store never filled), or that
    node 0's store never answered (the other nodes); or which settings the nodes were given differently."""
    import re

    if type(e).__name__ == "SettingsDiffer":  # meshviz.launch.agreement's: its message says it all
        return str(e)
    master, node, nnodes = config.rdzv_endpoint, config.rdzv_configs["rank"], config.min_nodes
    within = f"within {config.rdzv_configs['timeout']} s (MESHVIZ_RDZV_TIMEOUT)"
    if node != 0:
        return (f"node 0 (--rank 0) never served the rendezvous at {master} {within}: start it there, or check "
                f"--master; {type(e).__name__}: {e}")
    m = re.search(r"(\d+)/(\d+) clients joined", str(e))
    if m and nnodes == 2:
        missing = "node 1 (--rank 1) never arrived"
    elif m:
        missing = f"{nnodes - int(m.group(1))} of nodes 1..{nnodes - 1} never arrived"
    else:
        missing = f"not every one of nodes 1..{nnodes - 1} arrived"
    return f"{missing} at the rendezvous at {master} (job {config.run_id}) {within}; {type(e).__name__}: {e}"
