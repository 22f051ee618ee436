"""What a fresh process pays to start: ``import meshviz.distributed`` against torch's DTensor import it builds on,
and a rank that only runs collectives, in CPU seconds (user + system) and wall seconds, each in a process of its
own, the two alternating round by round; prints the median, the spread and meshviz / torch.

Run: .venv/bin/python bench/bench_import.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

CASES = {  # name: (meshviz's, torch's)
    "import": ("import meshviz.distributed", "import torch.distributed.tensor"),
    "import + a collective": (
        "import torch, meshviz.distributed as dist\ndist.init_parallel_env()\nt = torch.ones(2)\n"
        "dist.all_reduce(t)",
        "import os, torch, torch.distributed as td, torch.distributed.tensor\n"
        "td.init_process_group('gloo', store=td.HashStore(), rank=0, world_size=1)\nt = torch.ones(2)\n"
        "td.all_reduce(t)"),
    "import + a dist tensor op": (
        "import torch, meshviz.distributed as dist\ndist.init_parallel_env()\n"
        "m = dist.ProcessMesh([0], dim_names=['x'])\nx = dist.shard_tensor(torch.ones(4, 4), m, [dist.Shard(0)])\n"
        "y = x + x",
        "import torch, torch.distributed as td\nfrom torch.distributed.tensor import distribute_tensor, Shard\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "td.init_process_group('gloo', store=td.HashStore(), rank=0, world_size=1)\n"
        "m = init_device_mesh('cpu', (1,))\nx = distribute_tensor(torch.ones(4, 4), m, [Shard(0)])\ny = x + x"),
}


def run(code: str) -> tuple[float, float]:
    """(CPU s, wall s) of ``python -c code`` in a fresh process."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    env.pop("MESHVIZ_RANKS", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    run("import torch")  # the files in the page cache for both sides
    print(f"load average {os.getloadavg()[0]:.1f}; {args.rounds} rounds, each side in a fresh process")
    print(f"{'case':28} {'meshviz CPU s':>20} {'torch CPU s':>20} {'ratio':>14} {'meshviz wall s':>15} "
          f"{'torch wall s':>13}")
    for name, (ours, theirs) in CASES.items():
        got: dict[str, list[tuple[float, float]]] = {"m": [], "t": []}
        ratios = []
        for _ in range(args.rounds):
            m, t = run(ours), run(theirs)
            got["m"].append(m)
            got["t"].append(t)
            ratios.append(m[0] / t[0])

        def cell(xs):
            return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

        print(f"{name:28} {cell([c for c, _ in got['m']]):>20} {cell([c for c, _ in got['t']]):>20} "
              f"{cell(ratios):>14} {statistics.median(w for _, w in got['m']):>15.2f} "
              f"{statistics.median(w for _, w in got['t']):>13.2f}")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
