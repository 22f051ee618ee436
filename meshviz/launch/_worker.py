"""Runs one worker's training script: Paddle's variables set, stderr joined to stdout (workerlog.N)."""

import json
import os
import runpy
import sys


def main() -> None:
    script, args = sys.argv[1], sys.argv[2:]
    local = int(os.environ.get("LOCAL_RANK", "0"))
    rank_envs = os.environ.get("MESHVIZ_LAUNCH_RANK_ENV")
    if rank_envs:  # this worker's device, decided by the launcher before anything started
        os.environ.update(json.loads(rank_envs)[local])
    os.environ["PADDLE_TRAINER_ID"] = os.environ.get("RANK", "0")
    os.environ["PADDLE_TRAINERS_NUM"] = os.environ.get("WORLD_SIZE", "1")
    os.environ["PADDLE_LOCAL_RANK"] = str(local)
    if os.environ.get("MESHVIZ_LAUNCH_MERGE_STDERR") == "1":
        sys.stderr.flush()
        os.dup2(sys.stdout.fileno(), sys.stderr.fileno())
    sys.argv = [script] + args
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException as e:
        if not (isinstance(e, SystemExit) and e.code in (0, None)):
            _report(e)
        raise
    from meshviz.runtime.world import exit_quietly

    exit_quietly(0, note="its script finished")


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
