"""The settings every node of a job must share, compared through node 0's store before any worker starts."""

from __future__ import annotations

import datetime
import json
import os
import time

__all__ = ["settings", "agree"]

_DIFFER: list = []


def _differ_class():
    """SettingsDiffer, made at first use: torch is imported only once the flags were checked."""
    if not _DIFFER:
        from torch.distributed import DistStoreError

        class SettingsDiffer(DistStoreError):
            """The nodes of a job were given settings that must agree, differently (found at the rendezvous)."""

        _DIFFER.append(SettingsDiffer)
    return _DIFFER[0]


_AGREE = "meshviz/launch/settings"  # how many nodes said their settings (+ "/" + number: one node's)


def settings(config) -> dict:
    """This node's settings that every node of the job must share (``config``: its LaunchConfig)."""
    return {"--nnodes": config.min_nodes, "--max_restart": config.max_restarts, "--job_id": config.run_id,
            "--check_collectives": os.environ.get("MESHVIZ_CHECK_COLLECTIVES", "") == "1"}


def _differences(said: list[dict]) -> list[str]:
    out = []
    for name in said[0]["settings"]:
        values = [(d["node"], d["settings"].get(name)) for d in sorted(said, key=lambda d: d["node"])]
        if len({json.dumps(v) for _, v in values}) > 1:
            out.append(f"{name} differs across nodes: " + ", ".join(
                f"node {n} has {v if isinstance(v, int) and not isinstance(v, bool) else json.dumps(v)}"
                for n, v in values))
    return out


def agree(master: str, node: int, mine: dict, timeout: float) -> None:
    """At the rendezvous, before any worker starts: say this node's settings (:func:`settings`) on node 0's store
    and read every node's (as many as node 0's --nnodes); raise SettingsDiffer (a DistStoreError), on every node
    alike, naming each setting that differs and each node's value. Node 0 answers until the others have read."""
    from ..runtime.rendezvous import connect_store

    host, _, port = master.rpartition(":")
    store = connect_store(host, int(port), None, timeout)
    at = int(store.add(_AGREE, 1))
    store.set(f"{_AGREE}/{at}", json.dumps({"node": node, "settings": mine}))
    if node == 0:
        store.set(f"{_AGREE}/node0", json.dumps(mine))
    store.wait([f"{_AGREE}/node0"], datetime.timedelta(seconds=timeout))
    nnodes = json.loads(store.get(f"{_AGREE}/node0"))["--nnodes"]
    keys = [f"{_AGREE}/{i}" for i in range(1, nnodes + 1)]
    store.wait(keys, datetime.timedelta(seconds=timeout))
    said = [json.loads(v) for v in store.multi_get(keys)]
    if at > nnodes:  # this node came after node 0's count (its own --nnodes says more nodes)
        said.append({"node": node, "settings": mine})
    wrong = _differences(said)
    store.add(f"{_AGREE}/read", 1)
    if not wrong:
        return
    if node == 0:
        end = time.monotonic() + 5.0
        while int(store.add(f"{_AGREE}/read", 0)) < nnodes and time.monotonic() < end:
            time.sleep(0.05)
    raise _differ_class()("the nodes were given settings that must agree: " + "; ".join(wrong)
                          + " (no worker was started)")
