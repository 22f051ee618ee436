"""The main demo: N CPU ranks run the seed's sharding and reshard examples and print, per rank, the block it holds."""

from __future__ import annotations

import argparse

__all__ = ["main", "seed_examples"]


def seed_examples() -> list[tuple[str, str]]:
    """Runs on every rank; returns (title, this rank's text) per example."""
    import torch

    import meshviz.distributed as dist

    dist.init_parallel_env()
    rank = dist.get_rank()
    out = []

    def show(title, t):
        if rank in t.process_mesh.process_ids:
            out.append((title, f"rank {rank}: {t.placements} local {t._local_value().tolist()}"))
        else:
            out.append((title, f"rank {rank}: not in mesh"))

    # seed 001 section 1: a 2x3 mesh whose ids are not in order
    mesh = dist.ProcessMesh([[2, 4, 5], [0, 1, 3]], dim_names=["x", "y"])
    dense = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])
    show("1. shard_tensor([[1..12]], mesh [[2,4,5],[0,1,3]], [Shard(0), Shard(1)])",
         dist.shard_tensor(dense, mesh, [dist.Shard(0), dist.Shard(1)]))

    # seed 001 section 5: one mesh axis, Shard(0), Shard(1), Shard(2)
    m2 = dist.ProcessMesh([0, 1], dim_names=["x"])
    a = torch.tensor([[1, 2, 3], [4, 5, 6]])
    show("5.1 Shard(0) on mesh [0,1]", dist.shard_tensor(a, m2, [dist.Shard(0)]))
    show("5.2 Shard(1) on mesh [0,1] (3 columns on 2 ranks: 2 + 1)", dist.shard_tensor(a, m2, [dist.Shard(1)]))
    try:
        dist.shard_tensor(a, m2, [dist.Shard(2)])
    except ValueError as e:
        out.append(("5.3 Shard(2) on a 2-D tensor", f"rank {rank}: ValueError: {e}"))

    # seed 001 section 6: reshard Partial -> Replicate and Shard(0) -> Replicate
    p = dist.shard_tensor(a, m2, [dist.Partial()])
    show("6.1 Partial() before (rank 0 keeps the value, rank 1 zeros)", p)
    show("6.1 reshard Partial -> Replicate (all_reduce)", dist.reshard(p, m2, [dist.Replicate()]))
    s = dist.shard_tensor(a, m2, [dist.Shard(0)])
    show("6.2 reshard Shard(0) -> Replicate (all_gather)", dist.reshard(s, m2, [dist.Replicate()]))
    t = dist.shard_tensor(dense, mesh, [dist.Shard(0), dist.Shard(1)])
    show("6.3 reshard [Shard(0), Shard(1)] -> [Shard(1), Shard(0)] on the 2x3 mesh",
         dist.reshard(t, mesh, [dist.Shard(1), dist.Shard(0)]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m meshviz.demo", description=__doc__)
    ap.add_argument("--nprocs", type=int, default=6, help="ranks to start (the seed's mesh needs 6)")
    args = ap.parse_args(argv)
    from meshviz.core import ProcessMesh, Replicate, Shard
    from meshviz.core.planner import plan_reshard
    from meshviz.testing import run_ranks

    print(f"meshviz demo: {args.nprocs} CPU ranks (gloo)\n")
    results = run_ranks(seed_examples, args.nprocs, timeout=300)
    titles = [title for title, _ in results[0]]
    for i, title in enumerate(titles):
        print(title)
        for per_rank in results:
            print("   ", per_rank[i][1])
        print()
    mesh = ProcessMesh([[2, 4, 5], [0, 1, 3]], ["x", "y"])
    print("the plan behind 6.3, from the planner:")
    print(plan_reshard([4, 3], mesh, [Shard(0), Shard(1)], mesh, [Shard(1), Shard(0)], itemsize=8).describe())
    print("\nand Shard(0) -> Replicate on a 32x32 mesh (1024 ranks, planned without running them):")
    big = ProcessMesh([[i * 32 + j for j in range(32)] for i in range(32)], ["x", "y"])
    print(plan_reshard([8192, 8192], big, [Shard(0), Shard(1)], big, [Replicate(), Shard(1)]).describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
