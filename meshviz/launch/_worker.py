"""Runs one worker's training script: Paddle's variables set, stderr joined to stdout (workerlog.N)."""

import os
import runpy
import sys


def main() -> None:
    script, args = sys.argv[1], sys.argv[2:]
    local = int(os.environ.get("LOCAL_RANK", "0"))
    devices = os.environ.get("MESHVIZ_LAUNCH_DEVICES")
    if devices:
        dev = devices.split(",")[local]
        os.environ["FLAGS_selected_gpus"] = dev
        if os.environ.get("MESHVIZ_LAUNCH_GPU") == "1":
            os.environ["CUDA_VISIBLE_DEVICES"] = dev
    os.environ["PADDLE_TRAINER_ID"] = os.environ.get("RANK", "0")
    os.environ["PADDLE_TRAINERS_NUM"] = os.environ.get("WORLD_SIZE", "1")
    os.environ["PADDLE_LOCAL_RANK"] = str(local)
    if os.environ.get("MESHVIZ_LAUNCH_MERGE_STDERR") == "1":
        sys.stderr.flush()
        os.dup2(sys.stdout.fileno(), sys.stderr.fileno())
    sys.argv = [script] + args
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    from meshviz.distributed.env import exit_quietly

    exit_quietly(0, note="its script finished")


if __name__ == "__main__":
    main()
