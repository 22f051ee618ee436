"""python -m meshviz.launch against Paddle's launch: a program as the entry point, a node that never arrives."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from meshviz.runtime.rendezvous import free_port


def _launch(args, cwd, wait=True, timeout=120, **env_extra):
    env = {**os.environ, "MESHVIZ_RDZV_TIMEOUT": "60", "MESHVIZ_TIMEOUT": "30", **env_extra}
    p = subprocess.Popen([sys.executable, "-m", "meshviz.launch", *args], cwd=cwd, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if not wait:
        return p
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


MODULE = textwrap.dedent("""
    import json, os, sys, torch
    import meshviz.distributed as dist
    dist.init_parallel_env()
    r = dist.get_rank()
    t = torch.tensor([r + 1.0, 10.0 * (r + 1)])
    dist.all_reduce(t)
    names = ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "PADDLE_LOCAL_RANK", "PADDLE_CURRENT_ENDPOINT")
    with open(f"out{r}.json", "w") as fh:
        json.dump({"argv": sys.argv[1:], "sum": t.tolist(), "name": __name__,
                   "env": {k: os.environ.get(k) for k in names}}, fh)
""")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_program_is_run_as_it_is_as_paddles_launch_runs_it(tmp_path):
    # Paddle's launch runs an entry point not ending in .py as a program: `launch python -m pkg.mod args`
    (tmp_path / "probe_mod.py").write_text(MODULE)
    rc, out, err = _launch(["--nproc_per_node", "2", "--devices", "cpu", "--log_dir", str(tmp_path / "log"),
                            sys.executable, "-m", "probe_mod", "a", "--b", "1"], cwd=str(tmp_path))
    assert rc == 0, err[-3000:]
    got = [json.loads((tmp_path / f"out{r}.json").read_text()) for r in (0, 1)]
    for r, g in enumerate(got):
        assert g["argv"] == ["a", "--b", "1"] and g["name"] == "__main__"
        assert g["sum"] == [3.0, 30.0]  # 1 + 2, 10 + 20: the two ranks met
        assert g["env"]["PADDLE_TRAINER_ID"] == str(r) and g["env"]["PADDLE_TRAINERS_NUM"] == "2"
        assert g["env"]["PADDLE_LOCAL_RANK"] == str(r) and g["env"]["PADDLE_CURRENT_ENDPOINT"]
    # a program that is nowhere is refused before anything starts, naming it
    rc, out, err = _launch(["--nproc_per_node", "2", "--devices", "cpu", "no_such_program_here", "x"],
                           cwd=str(tmp_path))
    assert rc == 2 and "no such program 'no_such_program_here'" in err, err[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_node_that_never_arrives_is_named(tmp_path):
    (tmp_path / "s.py").write_text("print('ran')\n")
    alone0, alone1 = free_port(), free_port()
    common = ["--nnodes", "2", "--nproc_per_node", "1", "--devices", "cpu", "s.py"]
    procs = [_launch(["--master", f"127.0.0.1:{alone0}", "--rank", "0", "--log_dir", "l0", *common],
                     cwd=str(tmp_path), wait=False, MESHVIZ_RDZV_TIMEOUT="3"),
             _launch(["--master", f"127.0.0.1:{alone1}", "--rank", "1", "--log_dir", "l1", *common],
                     cwd=str(tmp_path), wait=False, MESHVIZ_RDZV_TIMEOUT="3")]
    (out0, err0), (out1, err1) = [p.communicate(timeout=120) for p in procs]
    assert procs[0].returncode == 1 and procs[1].returncode == 1, (err0[-2000:], err1[-2000:])
    assert f"node 1 (--rank 1) never arrived at the rendezvous at 127.0.0.1:{alone0}" in err0, err0[-2000:]
    assert f"node 0 (--rank 0) never served the rendezvous at 127.0.0.1:{alone1}" in err1, err1[-2000:]
    assert "within 3 s" in err0 and "within 3 s" in err1
    assert "Traceback" not in err0 + err1


NODE_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    import meshviz.distributed as dist
    dist.init_parallel_env()
    r = dist.get_rank()
    t = torch.tensor([2.0 ** r])
    dist.all_reduce(t)
    names = ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "PADDLE_GLOBAL_RANK", "PADDLE_GLOBAL_SIZE",
             "PADDLE_TRAINER_ENDPOINTS", "PADDLE_CURRENT_ENDPOINT", "PADDLE_LOCAL_RANK", "PADDLE_LOCAL_SIZE")
    with open(os.path.join(os.path.dirname(__file__), f"rank{r}.json"), "w") as fh:
        json.dump({"argv": sys.argv[1:], "sum": t.item(), "env": {k: os.environ.get(k) for k in names}}, fh)
""")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_nodes_with_different_nproc_per_node_agree_on_paddles_variables(tmp_path):
    # Paddle's launch runs 2 workers on node 0 and 1 on node 1 as ranks 0, 1 | 2 of one 3-rank world, and every
    # worker sees the same 3 endpoints, its own at its rank
    (tmp_path / "s.py").write_text(NODE_SCRIPT)
    port = free_port()
    procs = [_launch(["--nnodes", "2", "--master", f"127.0.0.1:{port}", "--rank", str(node), "--nproc_per_node",
                      str(n), "--devices", "cpu", "--log_dir", f"log{node}", "s.py", "--x", "1"],
                     cwd=str(tmp_path), wait=False) for node, n in ((0, 2), (1, 1))]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    endpoints = [f"127.0.0.1:{port + g}" for g in range(3)]
    for r, g in enumerate(got):
        assert g["sum"] == 7.0 and g["argv"] == ["--x", "1"]  # 1 + 2 + 4
        env = g["env"]
        assert env["PADDLE_TRAINER_ID"] == env["PADDLE_GLOBAL_RANK"] == str(r)
        assert env["PADDLE_TRAINERS_NUM"] == env["PADDLE_GLOBAL_SIZE"] == "3"
        assert env["PADDLE_TRAINER_ENDPOINTS"] == ",".join(endpoints), env
        assert env["PADDLE_CURRENT_ENDPOINT"] == endpoints[r]
        assert env["PADDLE_LOCAL_RANK"] == str(r % 2) and env["PADDLE_LOCAL_SIZE"] == ("2" if r < 2 else "1")
    assert sorted(os.listdir(tmp_path / "log0")) == ["workerlog.0", "workerlog.1"]
    assert sorted(os.listdir(tmp_path / "log1")) == ["workerlog.0"]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_nodes_named_by_ips_with_different_nproc_per_node_agree_on_paddles_endpoints(tmp_path):
    # --ips: node k's workers are at ips[k]:start_port + i, so 2 workers on node 0 and 1 on node 1 are 3 endpoints
    (tmp_path / "s.py").write_text(NODE_SCRIPT)
    port = free_port()
    procs = [_launch(["--ips", "127.0.0.1,127.0.0.2", "--start_port", str(port), "--rank", str(node),
                      "--nproc_per_node", str(n), "--devices", "cpu", "--log_dir", f"log{node}", "s.py"],
                     cwd=str(tmp_path), wait=False) for node, n in ((0, 2), (1, 1))]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    endpoints = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}", f"127.0.0.2:{port}"]
    for r in range(3):
        g = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert g["sum"] == 7.0
        env = g["env"]
        assert env["PADDLE_TRAINER_ID"] == env["PADDLE_GLOBAL_RANK"] == str(r)
        assert env["PADDLE_TRAINERS_NUM"] == "3"
        assert env["PADDLE_TRAINER_ENDPOINTS"] == ",".join(endpoints), env
        assert env["PADDLE_CURRENT_ENDPOINT"] == endpoints[r]


SKIPS = textwrap.dedent("""
    import time, torch
    import meshviz.distributed as dist
    dist.init_parallel_env()
    if dist.get_rank() == 2:
        time.sleep(2)
    else:
        dist.all_reduce(torch.ones(1))
""")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_roll_call_of_nodes_with_different_nproc_per_node_lists_the_ranks_there_are(tmp_path):
    # node 0 runs 2 workers, node 1 one: the world is 3 ranks, not node 0's 2 per node times 2 nodes
    (tmp_path / "s.py").write_text(SKIPS)
    port = free_port()
    procs = [_launch(["--nnodes", "2", "--master", f"127.0.0.1:{port}", "--rank", str(node), "--nproc_per_node",
                      str(n), "--devices", "cpu", "--hang_after", "0.5", "--max_restart", "0", "--log_dir",
                      f"log{node}", "s.py"], cwd=str(tmp_path), wait=False, MESHVIZ_TIMEOUT="600")
             for node, n in ((0, 2), (1, 1))]
    (_, err0), _ = [p.communicate(timeout=120) for p in procs]
    assert procs[0].returncode == 1, err0[-3000:]
    assert "meshviz.launch: rank 2 never entered all_reduce #1 on group [0, 1, 2]" in err0, err0[-3000:]
    assert "  rank 2: " in err0 and "rank 3" not in err0, err0[-3000:]


RAW_SKIP = textwrap.dedent("""
    import torch, torch.distributed as tdist
    import meshviz.distributed as dist
    dist.init_parallel_env()
    if dist.get_rank() == 0:
        tdist.all_reduce(torch.ones(1))
""")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_raw_collective_one_worker_skips_is_named_at_the_roll_call(tmp_path):
    # torch.distributed called directly is in the roll-call too: rank 1 never entered it, found long before the
    # 600 s collective timeout
    (tmp_path / "s.py").write_text(RAW_SKIP)
    rc, out, err = _launch(["--nproc_per_node", "2", "--devices", "cpu", "--hang_after", "0.5", "--max_restart", "0",
                            "--log_dir", str(tmp_path / "log"), "s.py"], cwd=str(tmp_path), MESHVIZ_TIMEOUT="600")
    assert rc == 1, err[-3000:]
    assert "meshviz.launch: rank 1 never entered all_reduce on group [0, 1] (idle: its script finished)" in err, \
        err[-3000:]
