"""The long op sweep: every op case in every placement on a 1-D mesh of 2 and a 2x2 mesh; prints the figure."""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.ranks.op_cases import MESHES, case_keys, figure, label, run_sweep  # noqa: E402

__all__ = ["main"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mesh", choices=sorted(MESHES), action="append", help="a mesh (default: both)")
    ap.add_argument("--sample", type=int, default=None,
                    help="seeded placement combinations per case and shape (default: all of them)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--op", action="append", help="only these ops (the figure's names)")
    a = ap.parse_args(argv)
    results = []
    t0 = time.time()
    for mesh in a.mesh or sorted(MESHES):
        keys = case_keys(len(MESHES[mesh]), sample=a.sample, seed=a.seed, ops=a.op)
        results += run_sweep(mesh, keys, seed=a.seed, timeout=24 * 3600)
    print(figure(results))
    for mesh, key, st, detail in results:
        if st != "ok":
            print(f"{st:8} {label(mesh, key)}: {detail}")
    print(f"{time.time() - t0:.0f} s")
    return 0 if not any(r[2] in ("WRONG", "crashed") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
