"""Paddle's variables, return values and launcher behaviour that scripts written for Paddle 3.3.1 rely on."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from meshviz.runtime.rendezvous import free_port

PADDLE_ONLY = textwrap.dedent("""
    import os, torch
    import meshviz.distributed as dist
    g = dist.init_parallel_env()
    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    print(f"rank={dist.get_rank()} world={dist.get_world_size()} sum={t.tolist()} group={g!r} "
          f"same={g is dist.get_group(0) and g is dist.init_parallel_env()} "
          f"master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_only_paddles_variables_start_the_world(tmp_path):
    """As a scheduler sets them for Paddle's init_parallel_env: the first endpoint is the master (it was refused:
    "MASTER_PORT is not set"); init_parallel_env returns the global Group (it was torch's ProcessGroup)."""
    (tmp_path / "s.py").write_text(PADDLE_ONLY)
    port = free_port()
    eps = f"127.0.0.1:{port},127.0.0.1:{port + 1}"
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT", "MESHVIZ_RANKS",
                                                            "TORCHELASTIC_USE_AGENT_STORE")}
    procs = [subprocess.Popen([sys.executable, "s.py"], cwd=str(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**base, "PADDLE_TRAINER_ENDPOINTS": eps, "PADDLE_TRAINER_ID": str(r),
                                   "PADDLE_TRAINERS_NUM": "2", "PADDLE_CURRENT_ENDPOINT": eps.split(",")[r],
                                   "CUDA_VISIBLE_DEVICES": "", "MESHVIZ_TIMEOUT": "30"})
             for r in (0, 1)]
    outs = [p.communicate(timeout=100) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for r, (out, _) in enumerate(outs):
        assert (f"rank={r} world=2 sum=[3.0, 3.0] group=Group(id=0, ranks=[0, 1], rank={r}) same=True "
                f"master=127.0.0.1:{port}") in out


def _paddle_view():
    import meshviz.distributed as dist

    env = {k: v for k, v in os.environ.items() if k.startswith(("PADDLE_", "FLAGS_"))}
    g = dist.init_parallel_env()
    pe = dist.ParallelEnv()
    attrs = {a: getattr(pe, a) for a in ("rank", "world_size", "nranks", "local_rank", "device_id", "dev_id",
                                          "device_type", "current_endpoint", "trainer_endpoints", "nrings")}
    return env, (type(g).__name__, g.id, g.ranks, g.rank, g.name), attrs


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_spawn_takes_backend_auto_and_sets_paddles_variables():
    """Paddle's spawn sets PADDLE_TRAINER_ID, ..._NUM, ..._ENDPOINTS, PADDLE_CURRENT_ENDPOINT and (gloo)
    PADDLE_DISTRI_BACKEND, the first endpoint being the master; backend="auto" was refused."""
    import meshviz.distributed as dist

    ctx = dist.spawn(_paddle_view, nprocs=2, backend="auto", devices="cpu", timeout=30)
    got = [ctx.return_queues[r].get() for r in (0, 1)]
    eps = got[0][0]["PADDLE_TRAINER_ENDPOINTS"].split(",")
    for r, (env, group, attrs) in enumerate(got):
        assert env == {"PADDLE_TRAINER_ID": str(r), "PADDLE_TRAINERS_NUM": "2", "PADDLE_DISTRI_BACKEND": "gloo",
                       "PADDLE_TRAINER_ENDPOINTS": ",".join(eps), "PADDLE_CURRENT_ENDPOINT": eps[r]}
        assert group == ("Group", 0, [0, 1], r, "_default_pg")
        assert attrs == {"rank": r, "world_size": 2, "nranks": 2, "local_rank": r, "device_id": -1, "dev_id": -1,
                         "device_type": "", "current_endpoint": eps[r], "trainer_endpoints": eps, "nrings": 1}
    assert len(set(eps)) == 2 and all(e.startswith("127.0.0.1:") for e in eps)


DUMP = textwrap.dedent("""
    import json, os, sys
    env = {k: v for k, v in os.environ.items() if k.startswith(("PADDLE_", "FLAGS_"))}
    print("DUMP " + json.dumps({"file": __file__, "argv": sys.argv, "env": env}))
""")


def _launch(tmp_path, run, *flags):
    env = {**os.environ, "MESHVIZ_RDZV_TIMEOUT": "60", "MESHVIZ_TIMEOUT": "30"}
    return subprocess.run([sys.executable, "-m", "meshviz.launch", "--nproc_per_node", "2", "--devices", "cpu",
                           "--log_dir", "log", *flags, "d.py", str(run)], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=100)


def _dumps(path):
    return [json.loads(line[5:]) for line in path.read_text().splitlines() if line.startswith("DUMP ")]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launch_as_paddles_variables_file_and_logs(tmp_path):
    """Workers get the variables Paddle's launch sets on the CPU, ``__file__`` is the script's absolute path while
    ``sys.argv[0]`` stays as given; each run is appended to workerlog.N unless ``--log_overwrite true``;
    ``--log_level``, ``--job_id`` and ``--run_mode collective`` are taken (``--log_level`` was refused)."""
    (tmp_path / "d.py").write_text(DUMP)
    first = _launch(tmp_path, 1)
    assert first.returncode == 0, first.stderr
    assert "Configuration Arguments" in first.stdout
    runs = [_dumps(tmp_path / "log" / f"workerlog.{i}") for i in (0, 1)]
    assert [len(r) for r in runs] == [1, 1]
    master = runs[0][0]["env"]["PADDLE_MASTER"]
    host, port = master.rsplit(":", 1)
    eps = [f"{host}:{int(port) + i}" for i in (0, 1)]
    for i, (d,) in enumerate(runs):
        assert d["file"] == str(tmp_path / "d.py") and d["argv"] == ["d.py", "1"]
        assert d["env"] == {
            "PADDLE_TRAINER_ID": str(i), "PADDLE_TRAINERS_NUM": "2", "PADDLE_GLOBAL_RANK": str(i),
            "PADDLE_GLOBAL_SIZE": "2", "PADDLE_LOCAL_RANK": str(i), "PADDLE_RANK_IN_NODE": str(i),
            "PADDLE_LOCAL_SIZE": "2", "PADDLE_NNODES": "1", "PADDLE_MASTER": master,
            "PADDLE_TRAINER_ENDPOINTS": ",".join(eps), "PADDLE_CURRENT_ENDPOINT": eps[i],
            "PADDLE_LOG_DIR": str(tmp_path / "log"), "PADDLE_DISTRI_BACKEND": "gloo"}
    second = _launch(tmp_path, 2, "--log_level", "WARNING", "--job_id", "again", "--run_mode", "collective")
    assert second.returncode == 0, second.stderr
    assert "Configuration Arguments" not in second.stdout  # only warnings and errors
    runs = [_dumps(tmp_path / "log" / f"workerlog.{i}") for i in (0, 1)]
    # appended, as Paddle's (the second run wrote over the first)
    assert [[d["argv"] for d in r] for r in runs] == [[["d.py", "1"], ["d.py", "2"]]] * 2
    third = _launch(tmp_path, 3, "--log_overwrite", "true")
    assert third.returncode == 0, third.stderr
    runs = [_dumps(tmp_path / "log" / f"workerlog.{i}") for i in (0, 1)]
    assert [[d["argv"] for d in r] for r in runs] == [[["d.py", "3"]]] * 2


def test_paddle_endpoints_on_several_nodes(tmp_path, monkeypatch):
    """With --ips, Paddle's endpoints: ip:start_port+i on each node; and init_parallel_env's reading of Paddle's
    variables: the master (PADDLE_MASTER before the first endpoint; MASTER_ADDR and MASTER_PORT before both) and
    this rank's place on its host."""
    from meshviz.launch.main import _flags, _paddle_envs, _plan, parse_args
    from meshviz.runtime import world

    monkeypatch.setattr("meshviz.runtime.devices.visible_gpu_count", lambda: 0)
    args = parse_args(["--ips", "10.0.0.1,10.0.0.2", "--host", "10.0.0.2", "--nproc_per_node", "2", "s.py"])
    nnodes, node, master = _flags(args)
    assert (nnodes, node, master) == (2, 1, "10.0.0.1:6070")
    envs = _paddle_envs(args, _plan(args), nnodes, node, master)
    eps = "10.0.0.1:6070,10.0.0.1:6071,10.0.0.2:6070,10.0.0.2:6071"
    assert [(e["PADDLE_TRAINER_ID"], e["PADDLE_LOCAL_RANK"], e["PADDLE_CURRENT_ENDPOINT"]) for e in envs] == [
        ("2", "0", "10.0.0.2:6070"), ("3", "1", "10.0.0.2:6071")]
    assert all(e["PADDLE_TRAINER_ENDPOINTS"] == eps and e["PADDLE_TRAINERS_NUM"] == "4" for e in envs)

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PADDLE_MASTER",
              "PADDLE_LOCAL_RANK", "PADDLE_RANK_IN_NODE", "PADDLE_LOCAL_SIZE"):
        monkeypatch.setenv(k, "")  # what init_parallel_env's reading writes is undone after the test
        monkeypatch.delenv(k)
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", eps)
    monkeypatch.setenv("PADDLE_CURRENT_ENDPOINT", "10.0.0.2:6071")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "3")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "4")
    world._paddle_env_as_torch()
    assert {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                       "MASTER_PORT")} == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                                           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
                                                           "MASTER_PORT": "6070"}
    monkeypatch.delenv("MASTER_PORT")
    monkeypatch.setenv("PADDLE_MASTER", "10.0.0.9:7000")  # MASTER_ADDR alone is not a master: Paddle's order
    world._paddle_env_as_torch()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.9", "7000")
    monkeypatch.setenv("PADDLE_MASTER", "7000")
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ValueError, match=r"init_parallel_env: PADDLE_MASTER must hold ip:port, got '7000'"):
        world._paddle_env_as_torch()


def _before_init():
    import torch

    import meshviz.distributed as dist

    out = {"get_group": dist.get_group(0), "initialized": dist.is_initialized()}
    for name, call in [("all_reduce", lambda: dist.all_reduce(torch.ones(2))), ("barrier", dist.barrier),
                       ("new_group", lambda: dist.new_group([0, 1])), ("get_backend", dist.get_backend),
                       ("broadcast", lambda: dist.broadcast(torch.ones(2), src=0)),
                       ("send", lambda: dist.send(torch.ones(2), dst=1 - dist.get_rank()))]:
        try:
            call()
            out[name] = "ran"
        except RuntimeError as e:
            out[name] = str(e)
    out["initialized_after"] = dist.is_initialized()
    g = dist.init_parallel_env()
    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    out["after"] = (repr(g), g is dist.get_group(0), t.tolist())
    return out


@pytest.mark.timeout(120)
def test_collectives_before_init_parallel_env_raise_on_every_rank():
    """Paddle 3.3.1 raises for a collective or new_group before init_parallel_env ("The global group is not
    initialized"); meshviz started the world on its own and ran them."""
    from meshviz.testing import run_ranks

    got = run_ranks(_before_init, 2, ranks="threads")
    for r, out in enumerate(got):
        assert out.pop("get_group") is None and out.pop("initialized") is False
        assert out.pop("initialized_after") is False
        assert out.pop("after") == (f"Group(id=0, ranks=[0, 1], rank={r})", True, [3.0, 3.0])
        assert out == {name: f"{name}: the default process group is not initialized; call dist.init_parallel_env() "
                             "first (or fleet.init(is_collective=True))"
                       for name in ("all_reduce", "barrier", "new_group", "get_backend", "broadcast", "send")}
