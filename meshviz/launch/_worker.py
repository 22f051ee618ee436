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
    runpy.run_path(script, run_name="__main__")
    from meshviz.runtime.world import exit_quietly

    exit_quietly(0, note="its script finished")


if __name__ == "__main__":
    main()
