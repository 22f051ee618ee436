"""Runs one worker's training script: Paddle's variables set, stderr joined to stdout (workerlog.N)."""

import json
import os
import runpy
import signal
import sys
import zipfile


def main() -> None:
    script, args = sys.argv[1], sys.argv[2:]
    local = int(os.environ.get("LOCAL_RANK", "0"))
    _end_with_the_launcher()
    # this run's keys on the agent's store (a restart's are apart from the run's before)
    from meshviz.runtime.rendezvous import ATTEMPT

    os.environ[ATTEMPT] = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for name in ("MESHVIZ_LAUNCH_RANK_ENV", "MESHVIZ_LAUNCH_PADDLE_ENV"):
        rank_envs = os.environ.get(name)
        if rank_envs:  # this worker's device and Paddle's variables, decided by the launcher before it started
            os.environ.update(json.loads(rank_envs)[local])
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    os.environ.update(PADDLE_TRAINER_ID=rank, PADDLE_TRAINERS_NUM=world, PADDLE_LOCAL_RANK=str(local),
                      PADDLE_GLOBAL_RANK=rank, PADDLE_GLOBAL_SIZE=world)
    master = os.environ.pop("MESHVIZ_LAUNCH_ENDPOINTS", "")
    if master:  # the endpoints follow the master's port, one per rank of the world torch's rendezvous counted
        from meshviz.runtime.rendezvous import paddle_endpoints, paddle_env

        host, _, port = master.rpartition(":")
        os.environ.update(paddle_env(int(rank), paddle_endpoints(host, int(port), int(world))))
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 and os.environ.get("MESHVIZ_LAUNCH_PADDLE_ENV"):
        _tell_nodes(local, int(rank))
    if os.environ.get("MESHVIZ_LAUNCH_MERGE_STDERR") == "1":
        sys.stderr.flush()
        os.dup2(sys.stdout.fileno(), sys.stderr.fileno())
    if is_program(script):
        _exec(script, args)
    from meshviz.ranks import patches

    patches.record_torch_calls_when_watched(os.environ)  # a raw tdist collective shows in the roll-call
    sys.argv = [script] + args
    path = os.path.abspath(script)
    sys.path.insert(0, os.path.dirname(path))
    from meshviz.launch.leavers import say_left

    try:
        _run(path)
    except BaseException as e:
        if not (isinstance(e, SystemExit) and e.code in (0, None)):
            _report(e)
        else:
            say_left()
        raise
    say_left()
    from meshviz.runtime.world import exit_quietly

    exit_quietly(0, note="its script finished")


def _end_with_the_launcher() -> None:
    """On Linux, have the kernel kill this worker when the launcher that started it dies (a SIGKILL to it leaves
    nobody to end its workers, which would wait in a collective until the timeout, or run on); ends now when the
    launcher is already gone. Only when the launcher started it from its main thread (``MESHVIZ_LAUNCH_PID``):
    the signal comes when the starting thread ends."""
    parent = os.environ.pop("MESHVIZ_LAUNCH_PID", "")
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # it died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


def _tell_nodes(local: int, rank: int) -> None:
    """Tell the other nodes how many workers this node runs (node 0's roll-call counts the world so), and with
    --ips name Paddle's endpoints from every node's number: nodes may run different --nproc_per_node."""
    from meshviz.launch import nodes
    from meshviz.runtime.rendezvous import connect_store, paddle_env

    timeout = float(os.environ.get("MESHVIZ_RDZV_TIMEOUT", "900"))
    store = connect_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, timeout)
    if local == 0:
        nodes.publish(store, int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    spec = os.environ.pop(nodes.IPS_ENV, "")
    if spec:
        per_node = nodes.counts(store, int(os.environ["GROUP_WORLD_SIZE"]), timeout)
        os.environ.update(paddle_env(rank, nodes.ips_endpoints(spec, per_node)))


def is_program(script: str) -> bool:
    """Is ``script`` a program to run as it is (Paddle's launch runs a script not ending in ``.py`` so: ``launch
    python -m pkg.mod`` or ``launch ./run.sh``)? A folder, a zip, and a file without the execute bit stay Python."""
    if script.endswith((".py", ".pyxes")) or os.path.isdir(script):
        return False
    if os.path.isfile(script):
        return os.access(script, os.X_OK) and not zipfile.is_zipfile(script)
    return True  # a name found on PATH


def _exec(program: str, args: list) -> None:
    """Become ``program args...`` (found on PATH as Paddle's launch runs it), with this worker's variables."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # a Python program's lines reach workerlog.N as they come
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(program, [program, *args])
    except OSError as e:
        _report(e)
        print(f"meshviz.launch: cannot run {program!r}: {e}", file=sys.stderr, flush=True)
        sys.exit(127)


def _run(path: str) -> None:
    """Run the script at ``path`` as ``python script.py`` does (Paddle's launch runs it so): ``__file__`` is its
    absolute path, ``sys.argv[0]`` as given (``runpy.run_path`` would make both the path it was given)."""
    if not os.path.isfile(path) or zipfile.is_zipfile(path):
        runpy.run_path(path, run_name="__main__")  # a folder or zip with a __main__.py
        return
    import builtins
    import importlib.machinery
    import types

    with open(path, "rb") as fh:
        code = compile(fh.read(), path, "exec")
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __package__=None, __spec__=None, __builtins__=builtins,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _report(e: BaseException) -> None:
    """What the script raised, in the error file torch's agent reads (its own format): the file's time says when,
    so the launcher can tell the worker that failed first from those that lost their connection to it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import time
    import traceback

    now = time.time()  # to the microsecond: a file's time may be a few ms coarse, and a peer fails ms later
    data = {"message": {"message": f"{type(e).__name__}: {e}",
                        "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(now)),
                                      "meshviz_time": repr(now)}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


if __name__ == "__main__":
    main()
