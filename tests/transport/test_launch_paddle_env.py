"""meshviz.launch as Paddle 3.3.1's launch: the exit code of a failed job, Paddle's variables over the flags, and
init_parallel_env returning None in a 1-process world."""

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from meshviz.launch import launch


def _clean_env(**extra):
    """This process's variables without Paddle's and torchrun's (a launch reads Paddle's over its flags)."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "POD_IP",
            "MESHVIZ_RANKS", "TORCHELASTIC_USE_AGENT_STORE")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PADDLE_")}
    return {**env, "MESHVIZ_RDZV_TIMEOUT": "60", "MESHVIZ_TIMEOUT": "30", "CUDA_VISIBLE_DEVICES": "", **extra}


def _launch(cwd, *args, timeout=120, **env):
    p = subprocess.run([sys.executable, "-m", "meshviz.launch", *args], cwd=str(cwd), env=_clean_env(**env),
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture
def no_paddle_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("PADDLE_") or k == "POD_IP":
            monkeypatch.delenv(k)
    return monkeypatch


# -- the exit code of a failed job ---------------------------------------------------------------------------------

FAILS = textwrap.dedent("""
    import os, signal, sys, time
    mode, r = sys.argv[1], int(os.environ["PADDLE_TRAINER_ID"])
    if mode == "exit" and r == 1:
        sys.exit(3)
    if mode == "raise" and r == 1:
        raise RuntimeError("rank 1 fails")
    if mode == "kill" and r == 1:  # as the OOM killer ends a process
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "both" and r == 1:  # ends with a code of its own when the launcher stops it
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))
        time.sleep(60)
    if mode == "both" and r == 2:
        time.sleep(3)
        sys.exit(4)
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, code, named", [
    ("exit", 3, "the worker with global rank 1 failed"),
    ("raise", 1, "the worker with global rank 1 failed"),
    ("kill", 247, "the worker with global rank 1 failed"),
    # Paddle's is the first failed worker's in local-rank order (3), not the first to fail (rank 2: 4)
    ("both", 3, "the worker with global rank 2 failed first, then global rank 1"),
])
def test_a_failed_job_exits_with_the_failed_workers_code(tmp_path, mode, code, named):
    """Paddle 3.3.1's launch exits with the code of the first worker, in local-rank order, whose code is not 0
    (sys.exit(3): 3, a raise: 1, SIGKILL: 247); meshviz's exited 1. Where Paddle's depends on timing (241 when it
    had stopped local rank 0 first) meshviz passes over the workers it stopped. The worker that failed first is
    named from the report it wrote (none reached the launcher: rank 1 was named first)."""
    (tmp_path / "fails.py").write_text(FAILS)
    rc, out, err = _launch(tmp_path, "--devices", "cpu", "--nproc_per_node", "3", "--log_dir", "log", "fails.py",
                           mode)
    assert rc == code, err[-3000:]
    assert named in err, err[-3000:]


def test_the_exit_code_rule():
    """The first failed worker in rank order that the agent did not stop; signals as ``sys.exit`` maps them."""
    from meshviz.launch.agent import TorchrunJob

    def code(**exitcodes):
        job = TorchrunJob([0, 1, 2])
        job.failures = {int(r[1:]): SimpleNamespace(exitcode=c, error_file="<N/A>") for r, c in exitcodes.items()}
        job._done.set()
        return job.exit_code()

    assert code() == 0
    assert code(r0=-15, r1=3, r2=4) == 3  # rank 0 was stopped by the agent
    assert code(r2=4, r1=3) == 3
    assert code(r0=-15, r1=-9) == 247  # a SIGKILL beside a stopped worker came from elsewhere
    assert code(r1=-15) == 241  # a worker that got SIGTERM from elsewhere: Paddle's 241 too
    assert code(r0=-15, r2=-15) == 241  # every worker stopped (a failure on another node)
    assert code(r1=-11) == 245


# -- Paddle's variables over the flags -------------------------------------------------------------------------------

def test_paddles_variables_override_the_flags():
    """Paddle's env_args_mapping: each variable set replaces its flag, given or not; PADDLE_TRAINER_ID is the node
    rank and PADDLE_RANK overrides it; an empty variable is unset. meshviz read none of them."""
    from meshviz.launch.main import _flags, parse_args

    env = {"PADDLE_NNODES": "2", "PADDLE_MASTER": "10.0.0.1:6170", "PADDLE_RANK": "1", "PADDLE_TRAINER_ID": "0",
           "PADDLE_NPROC_PER_NODE": "4", "PADDLE_LOG_DIR": "envlog", "PADDLE_JOB_ID": "j", "PADDLE_DEVICES": "cpu",
           "PADDLE_LOG_OVERWRITE": "true", "PADDLE_MAX_RESTART": "2", "PADDLE_LOG_LEVEL": "debug",
           "PADDLE_RUN_MODE": "collective", "PADDLE_SORT_IP": "1", "PADDLE_ELASTIC_TIMEOUT": "60",
           "PADDLE_ELASTIC_LEVEL": "-1", "PADDLE_AUTO_CLUSTER": "false", "PADDLE_START_PORT": "7000",
           "POD_IP": "10.0.0.2", "PADDLE_IPS": ""}
    args = parse_args(["--nnodes", "3", "--master", "10.0.0.9:1", "--rank", "2", "--nproc_per_node", "8",
                       "--log_dir", "flaglog", "--job_id", "f", "--devices", "0", "--max_restart", "0", "s.py"], env)
    got = {k: getattr(args, k) for k in ("nnodes", "master", "rank", "nproc_per_node", "log_dir", "job_id", "devices",
                                         "log_overwrite", "max_restart", "log_level", "run_mode", "sort_ip",
                                         "elastic_timeout", "elastic_level", "auto_cluster_config", "start_port",
                                         "host", "ips")}
    assert got == {"nnodes": "2", "master": "10.0.0.1:6170", "rank": 1, "nproc_per_node": 4, "log_dir": "envlog",
                   "job_id": "j", "devices": "cpu", "log_overwrite": True, "max_restart": 2, "log_level": "debug",
                   "run_mode": "collective", "sort_ip": True, "elastic_timeout": 60, "elastic_level": -1,
                   "auto_cluster_config": False, "start_port": 7000, "host": "10.0.0.2", "ips": None}
    assert _flags(args) == (2, 1, "10.0.0.1:6170")
    # PADDLE_TRAINER_ID is the node rank (over --rank) when PADDLE_RANK is not set
    args = parse_args(["--nnodes", "2", "--master", "10.0.0.1:6170", "--rank", "0", "s.py"], {"PADDLE_TRAINER_ID": "1"})
    assert _flags(args) == (2, 1, "10.0.0.1:6170")
    # a worker's PADDLE_TRAINER_ID (a launch started from a worker) does not move a one-node job: Paddle's neither
    assert _flags(parse_args(["s.py"], {"PADDLE_TRAINER_ID": "3"})) == (1, 0, None)
    assert parse_args(["--nproc_per_node", "2", "s.py"], {}).nproc_per_node == 2


FLAG_OF = {"PADDLE_TRAINERS_ENDPOINTS": "trainers", "PADDLE_SERVER_NUM": "server_num", "PADDLE_WITH_GLOO": "with_gloo",
           "PADDLE_AUTO_PARALLEL_CONFIG": "auto_parallel_config", "PADDLE_ELASTIC_LEVEL": "elastic_level",
           "PADDLE_NNODES": "nnodes", "PADDLE_RANK": "rank", "PADDLE_MASTER": "master", "PADDLE_RUN_MODE": "run_mode",
           "PADDLE_AUTO_CLUSTER": "auto_cluster_config"}


@pytest.mark.parametrize("env, error", [
    ({"PADDLE_TRAINERS_ENDPOINTS": "10.0.0.1:6000"},
     "--trainers is a parameter-server flag (Paddle's --run_mode ps), which meshviz does not have (it runs collective "
     "jobs) (--trainers from PADDLE_TRAINERS_ENDPOINTS='10.0.0.1:6000')"),
    ({"PADDLE_SERVER_NUM": "2"}, "--server_num is a parameter-server flag (Paddle's --run_mode ps), which meshviz does "
                                 "not have (it runs collective jobs) (--server_num from PADDLE_SERVER_NUM='2')"),
    ({"PADDLE_WITH_GLOO": "1"}, "--with_gloo is a parameter-server flag (Paddle's --run_mode ps), which meshviz does "
                                "not have (it runs collective jobs) (--with_gloo from PADDLE_WITH_GLOO='1')"),
    ({"PADDLE_AUTO_PARALLEL_CONFIG": "c.json"},
     "--auto_parallel_config is a flag of Paddle's auto-parallel tuner, which meshviz does not have (it runs "
     "collective jobs) (--auto_parallel_config from PADDLE_AUTO_PARALLEL_CONFIG='c.json')"),
    ({"PADDLE_NPROC_PER_NODE": "two"},
     "PADDLE_NPROC_PER_NODE='two': Paddle's launch reads it as --nproc_per_node, which takes an integer"),
    ({"PADDLE_LOG_OVERWRITE": "maybe"}, "PADDLE_LOG_OVERWRITE='maybe': Paddle's launch reads it as --log_overwrite, "
                                        "which takes a yes/no value (true, false, 1, 0, ...)"),
    ({"PADDLE_ELASTIC_LEVEL": "1"}, "--elastic_level 1: Paddle's elastic mode is not supported (only -1) "
                                    "(--elastic_level from PADDLE_ELASTIC_LEVEL='1')"),
    ({"PADDLE_NNODES": "2:4"}, "--nnodes 2:4: an elastic range of nodes (Paddle's elastic mode) is not supported; "
                               "give one number (--nnodes from PADDLE_NNODES='2:4')"),
    ({"PADDLE_NNODES": "2", "PADDLE_RANK": "1"},
     "--nnodes > 1 needs --master ip:port (or --ips) (--nnodes from PADDLE_NNODES='2')"),
    ({"PADDLE_MASTER": "etcd://10.0.0.1:2379"},
     "--master etcd://10.0.0.1:2379: Paddle's elastic mode (an etcd master) is not supported; give ip:port "
     "(--master from PADDLE_MASTER='etcd://10.0.0.1:2379')"),
    ({"PADDLE_RUN_MODE": "ps"},
     "--run_mode 'ps': only 'collective' is supported (--run_mode from PADDLE_RUN_MODE='ps')"),
    ({"PADDLE_AUTO_CLUSTER": "true"}, "--auto_cluster_config: Paddle's auto-parallel cluster search is not supported "
                                      "(--auto_cluster_config from PADDLE_AUTO_CLUSTER='true')"),
])
def test_a_variable_meshviz_does_not_run_is_refused_naming_it(env, error, tmp_path, no_paddle_env, capsys):
    """Each variable that set a flag is said first (as Paddle's "LAUNCH WARNING args ... will be overridden by env"),
    unless --log_level (here PADDLE_LOG_LEVEL) hides warnings, or its value was not of the flag's kind."""
    (tmp_path / "s.py").write_text("print('ran')\n")
    no_paddle_env.chdir(tmp_path)
    for k, v in env.items():
        no_paddle_env.setenv(k, v)
    assert launch(["--nproc_per_node", "1", "s.py"]) == 2
    out, err = capsys.readouterr()
    said = [] if error.startswith("PADDLE_") or "PADDLE_LOG_LEVEL" in env else list(env)  # in Paddle's order
    notices = "".join(f"meshviz.launch: {k}={env[k]} overrides --{FLAG_OF[k]} (Paddle's launch variables take "
                      "precedence over its flags)\n" for k in said)
    assert err == notices + f"meshviz.launch: error: {error}\n" and out == ""


ENV_DUMP = textwrap.dedent("""
    import os
    print("DUMP", os.environ["PADDLE_TRAINER_ID"], os.environ["PADDLE_TRAINERS_NUM"], os.environ["PADDLE_LOG_DIR"])
""")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_launch_takes_paddles_variables_over_its_flags(tmp_path):
    """As Paddle 3.3.1 (``PADDLE_NPROC_PER_NODE=2 PADDLE_LOG_DIR=xlog ... --nproc_per_node 3 --log_dir ylog``: two
    workers, logs in xlog, "LAUNCH WARNING args nproc_per_node will be overridden by env"); meshviz started three
    workers logging to ylog. A worker's PADDLE_TRAINER_ID in the launcher's variables leaves a one-node job be."""
    (tmp_path / "d.py").write_text(ENV_DUMP)
    rc, out, err = _launch(tmp_path, "--devices", "cpu", "--nproc_per_node", "3", "--log_dir", "flaglog", "d.py",
                           PADDLE_NPROC_PER_NODE="2", PADDLE_LOG_DIR="envlog", PADDLE_TRAINER_ID="1")
    assert rc == 0, err[-3000:]
    assert ("meshviz.launch: PADDLE_NPROC_PER_NODE=2 overrides --nproc_per_node (Paddle's launch variables take "
            "precedence over its flags)") in err
    assert "meshviz.launch: PADDLE_LOG_DIR=envlog overrides --log_dir" in err
    assert "nproc_per_node: 2" in out and "log_dir: envlog" in out
    assert sorted(os.listdir(tmp_path / "envlog")) == ["workerlog.0", "workerlog.1"]
    assert not (tmp_path / "flaglog").exists()
    for i in (0, 1):
        assert f"DUMP {i} 2 {tmp_path / 'envlog'}" in (tmp_path / "envlog" / f"workerlog.{i}").read_text()


# -- init_parallel_env in a 1-process world --------------------------------------------------------------------------

ONE = textwrap.dedent("""
    import torch
    import meshviz.distributed as dist
    from meshviz.distributed.parallel import init_parallel_env
    g = init_parallel_env()
    again = init_parallel_env()
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.barrier()
    parts = []
    dist.all_gather(parts, torch.arange(2.0))
    print(f"ONE ret={g!r} again={again!r} world={dist.get_world_size()} rank={dist.get_rank()} sum={t.tolist()} "
          f"gathered={[p.tolist() for p in parts]} group={dist.new_group([0])!r}")
""")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_init_parallel_env_returns_none_in_a_one_process_world(tmp_path):
    """Paddle 3.3.1's init_parallel_env returns None when the world has one process (plain ``python s.py``, and under
    launch with --nproc_per_node 1); meshviz's returned the global Group. Collectives still run there (Paddle's
    raise "The global group is not initialized")."""
    (tmp_path / "one.py").write_text(ONE)
    want = "ONE ret=None again=None world=1 rank=0 sum=[1.0, 1.0] gathered=[[0.0, 1.0]] group=Group(id=10, ranks=[0]"
    p = subprocess.run([sys.executable, "one.py"], cwd=str(tmp_path), env=_clean_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and want in p.stdout, p.stderr[-3000:]
    rc, out, err = _launch(tmp_path, "--devices", "cpu", "--nproc_per_node", "1", "--log_dir", "log", "one.py")
    assert rc == 0 and want in (tmp_path / "log" / "workerlog.0").read_text(), err[-3000:]


def _init():
    from meshviz.distributed.parallel import init_parallel_env

    g = init_parallel_env()
    return None if g is None else (g.id, g.ranks)


@pytest.mark.timeout(120)
def test_init_parallel_env_returns_the_group_with_two_ranks_or_more():
    from meshviz.testing import run_ranks

    assert run_ranks(_init, 1, ranks="threads") == [None]
    assert run_ranks(_init, 2, ranks="threads") == [(0, [0, 1])] * 2


def _dist_init():
    import meshviz.distributed as dist

    g = dist.init_parallel_env()
    return None if g is None else (g.id, g.ranks)


@pytest.mark.timeout(120)
def test_dist_init_parallel_env_is_paddles():
    """``dist.init_parallel_env`` is the one that returns None in a 1-process world (``paddle.distributed``'s is
    ``paddle.distributed.parallel.init_parallel_env``)."""
    from meshviz.testing import run_ranks

    assert run_ranks(_dist_init, 1, ranks="threads") == [None]
    assert run_ranks(_dist_init, 2, ranks="threads") == [(0, [0, 1])] * 2
