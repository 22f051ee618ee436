"""init_parallel_env, spawn from a script, and failures that name the rank."""

import re
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import meshviz.distributed as dist

    def train(scale):
        dist.init_parallel_env()
        mesh = dist.ProcessMesh([0, 1, 2], dim_names=["x"])
        t = dist.shard_tensor(torch.arange(6.0) * scale, mesh, [dist.Shard(0)])
        full = dist.unshard_dtensor(t)
        print(f"rank {dist.get_rank()}/{dist.get_world_size()} local {t._local_value().tolist()} "
              f"full {full.tolist()}", flush=True)
        if len(sys.argv) > 1 and dist.get_rank() == int(sys.argv[1]):
            raise ValueError("failing on purpose")
        dist.barrier()
        return {"rank": dist.get_rank(), "local": t._local_value().tolist()}

    if __name__ == "__main__":
        import queue
        ctx = dist.spawn(train, args=(2.0,), nprocs=3, devices="cpu")
        print("returned", [ctx.return_queues[r].get() for r in range(3)], flush=True)
        try:
            ctx.return_queues[0].get()
        except queue.Empty as e:
            print("again:", e, flush=True)
    """
)


def _run(tmp_path, *args):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=120,
                          env={"MESHVIZ_TIMEOUT": "20", "PATH": "/usr/bin:/bin"})


def test_spawn_runs_a_function_defined_in_a_script(tmp_path):
    out = _run(tmp_path)
    assert out.returncode == 0, out.stderr
    lines = sorted(re.findall(r"rank \d/3 local \[[^\]]*\] full \[[^\]]*\]", out.stdout))
    full = "[0.0, 2.0, 4.0, 6.0, 8.0, 10.0]"
    assert lines == [
        f"rank 0/3 local [0.0, 2.0] full {full}",
        f"rank 1/3 local [4.0, 6.0] full {full}",
        f"rank 2/3 local [8.0, 10.0] full {full}",
    ]
    # what each rank's function returned, as Paddle's context.return_queues[rank].get() gives it
    assert ("returned [{'rank': 0, 'local': [0.0, 2.0]}, {'rank': 1, 'local': [4.0, 6.0]}, "
            "{'rank': 2, 'local': [8.0, 10.0]}]") in out.stdout
    assert "again: spawn: rank 0's return value was taken already" in out.stdout


def test_spawn_names_the_failing_rank_and_does_not_hang(tmp_path):
    out = _run(tmp_path, "1")
    assert out.returncode != 0
    assert "RankError: rank 1 raised" in out.stderr
    assert "failing on purpose" in out.stderr


def _returns_or_raises(failing: int):
    import meshviz.distributed as dist

    dist.init_parallel_env()
    if dist.get_rank() == failing:
        raise ValueError("failing on purpose")
    return dist.get_rank() * 10


def test_spawn_without_join_hands_each_ranks_return_value():
    import queue

    import meshviz.distributed as dist
    from meshviz.errors import RankError

    ctx = dist.spawn(_returns_or_raises, args=(-1,), nprocs=2, join=False, devices="cpu", timeout=20)
    assert [ctx.return_queues[r].get(timeout=60) for r in range(2)] == [0, 10]
    assert ctx.join()
    ctx = dist.spawn(_returns_or_raises, args=(1,), nprocs=2, join=False, devices="cpu", timeout=20)
    with pytest.raises(queue.Empty, match="rank 1 ended without returning"):
        ctx.return_queues[1].get(timeout=60)
    with pytest.raises(RankError, match="rank 1 raised"):
        ctx.join()


def test_single_process_defaults():
    import meshviz.distributed as dist

    assert dist.get_rank() == 0 and dist.get_world_size() == 1 or dist.is_initialized()
    with pytest.raises(ValueError, match="nprocs"):
        dist.spawn(print, nprocs=0)


def listening_addresses():
    """Addresses this rank's process listens on (from /proc, no tools needed)."""
    import os

    import torch

    import meshviz.distributed as dist

    dist.init_parallel_env()
    t = torch.ones(2)
    dist.all_reduce(t)
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    addrs = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    addrs.append(cols[1].split(":")[0])
    return t.tolist(), addrs


def test_spawned_ranks_listen_on_loopback_only():
    from meshviz.testing import run_ranks

    for total, addrs in run_ranks(listening_addresses, 2, timeout=90):
        assert total == [2.0, 2.0]
        # 127.0.0.1 is 0100007F in /proc/net/tcp; 0.0.0.0 would be 00000000
        assert addrs and all(a in ("0100007F", "00000000000000000000000001000000") for a in addrs), addrs
