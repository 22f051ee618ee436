"""Each node's number of workers, told through the agent's store: nodes may run different --nproc_per_node."""

from __future__ import annotations

import datetime
import json

__all__ = ["IPS_ENV", "publish", "counts", "world", "ips_endpoints", "rollcall_host"]

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


def rollcall_host(host: str, port: int, nnodes: int, nproc: int, hang_after: float):
    """Node 0's roll-call host for a launched job: its world is the sum of the nodes' workers once they have said
    their numbers (``nnodes * nproc`` until then)."""
    from ..runtime.watchdog import RollCallHost

    class _LaunchRollCall(RollCallHost):
        def collect(self, n: int, timeout: float = 1.5):
            if nnodes > 1:
                self.world = world(self._connect(), nnodes) or self.world
            return super().collect(n, timeout)

    return _LaunchRollCall(host, port, nnodes * nproc, hang_after, wait_for_store=60.0).start()
