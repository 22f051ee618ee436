"""More ranks than GPUs, for real: spawn, launch and Cluster on this machine, each call timed and printed."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings

import torch

TRAIN = """
import torch, torch.distributed as tdist, meshviz.distributed as dist
dist.init_parallel_env()
t = torch.ones(2, device=dist.device()) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("rank", dist.get_rank(), tdist.get_backend(), dist.device(), t.tolist(), flush=True)
"""


def _rank():
    exec(TRAIN, {})


def check(name: str, fn) -> None:
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            res = f"ok {fn()!r}"
        except Exception as e:
            res = f"{type(e).__name__}: {e}"
    notices = [str(w.message) for w in caught if type(w.message).__name__ == "DeviceNotice"]
    print(f"[{name}] {time.perf_counter() - t0:.2f} s: {res}" + (f"\n    notice: {notices}" if notices else ""),
          flush=True)


def main() -> int:
    import meshviz
    import meshviz.distributed as dist

    g = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = max(2, g + 1)  # more ranks than there are GPUs
    nccl = torch.cuda.nccl.version() if g else None
    print(f"torch {torch.__version__}, {g} GPU(s), NCCL {nccl}; {n} ranks", flush=True)
    ids = ",".join(str(i) for i in range(n))  # names one GPU that is not there
    check(f"spawn(nprocs={n})", lambda: dist.spawn(_rank, nprocs=n))
    check(f"spawn(nprocs={n}, devices='cuda')", lambda: dist.spawn(_rank, nprocs=n, devices="cuda"))
    check(f"spawn(nprocs={n}, gpus='{ids}')", lambda: dist.spawn(_rank, nprocs=n, gpus=ids))
    check("spawn(nprocs=2, gpus='0,0')", lambda: dist.spawn(_rank, nprocs=2, gpus="0,0"))
    check(f"spawn(nprocs={n}, devices='cuda', backend='gloo')",
          lambda: dist.spawn(_rank, nprocs=n, devices="cuda", backend="gloo"))
    d = tempfile.mkdtemp()
    script = os.path.join(d, "train.py")
    with open(script, "w") as fh:
        fh.write(textwrap.dedent(TRAIN))
    for flags in (["--nproc_per_node", str(n)], ["--devices", ids], ["--devices", "0,0"], ["--devices", "0"]):
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "meshviz.launch", "--log_dir", os.path.join(d, "log"), *flags,
                            script], capture_output=True, text=True, timeout=180, cwd=d)
        said = [x for x in (p.stdout + p.stderr).splitlines() if "rank" in x or "error" in x.lower()][-4:]
        print(f"[meshviz.launch {' '.join(flags)}] {time.perf_counter() - t0:.2f} s: exit {p.returncode}",
              *said, sep="\n    ", flush=True)

    def cluster(**kw):
        c = meshviz.Cluster(**kw)
        try:
            return repr(c), [s.strip() for s in c.execute(TRAIN).stdout]
        finally:
            c.stop()

    for kw in (dict(n=None), dict(n=n), dict(n=n, devices="cuda"), dict(devices=[0, 0]),
               dict(n=n, devices="cuda", backend="gloo")):
        check(f"Cluster({', '.join(f'{k}={v!r}' for k, v in kw.items())})", lambda kw=kw: cluster(**kw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
