"""meshviz.what_if's estimate of each rank's peak against torch.cuda.max_memory_allocated of the same step on a GPU.

The Llama of ``bench_what_if.py`` made smaller (4 layers, hidden 2048, FFN 5632, vocab 32000, a 2048-token
sequence per dp rank), one step estimated on simulated ranks and then run for real: one NCCL rank, or two ranks
sharing the GPU over gloo (each process's own peak). The peak is counted from the start of the step.
Run: .venv/bin/python bench/bench_what_if_gpu.py [--layers 4] [--seq 2048]
Without CUDA it says so and exits.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DIMS = dict(vocab=32000, hidden=2048, heads=16, kv_heads=4, ffn=5632)
CASES = [((1, 1), 1), ((1, 1), 3), ((1, 2), 1), ((2, 1), 1)]  # (dp, mp), sharding stage
MiB = 2**20


def estimate(shape, level, layers, seq):
    import bench_what_if as bw

    bw.set_dims(**DIMS)
    return bw.train(shape, ["dp", "mp"], level, layers, seq)


def real(shape, level, layers, seq) -> dict:
    import bench_what_if as bw

    import meshviz.distributed as dist

    bw.set_dims(**DIMS)
    dist.init_parallel_env()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    bw.train(shape, ["dp", "mp"], level, layers, seq)
    torch.cuda.synchronize()
    return dict(peak=torch.cuda.max_memory_allocated() - base, seconds=time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_what_if_gpu: no CUDA GPU here; nothing measured")
        return 0
    import meshviz
    from meshviz.testing import run_ranks

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; {args.layers} layers, seq {args.seq}, {DIMS}")
    print("| dp x mp, stage | rank | estimate MiB (params, grads, optimizer, activations) | GPU peak MiB | "
          "estimate / GPU | GPU step s |\n|---|---|---|---|---|---|")
    for shape, level in CASES:
        n = shape[0] * shape[1]
        est = meshviz.what_if(estimate, n, shape, level, args.layers, args.seq).per_rank
        kw = dict(devices="cuda", backend=None) if n == 1 else dict(devices="cuda", backend="gloo")  # share the GPU
        got = run_ranks(real, n, shape, level, args.layers, args.seq, timeout=300, collective_timeout=120,
                        env={"MESHVIZ_STRICT_DEVICES": "0"}, **kw)
        for r in range(n):
            e = est[r]
            parts = ", ".join(f"{e[k] / MiB:.0f}" for k in ("params", "grads", "optimizer", "activations"))
            print(f"| {shape[0]} x {shape[1]}, {level} | {r} | {e['peak'] / MiB:.1f} ({parts}) | "
                  f"{got[r]['peak'] / MiB:.1f} | {e['peak'] / got[r]['peak']:.3f} | {got[r]['seconds']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
