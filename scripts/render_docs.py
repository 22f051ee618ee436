"""Render the README tour's pictures into docs/img/ (and, with --notebooks, refresh the explorer notebook's outputs)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from meshviz import Partial, ProcessMesh, Shard  # noqa: E402
from meshviz.widgets import MeshView, PipelineView, ReshardView, TensorView  # noqa: E402

NOTEBOOKS = ["notebooks/10_explorer.ipynb"]


def render(out: str) -> list[str]:
    os.makedirs(out, exist_ok=True)
    seed = ProcessMesh([[2, 4, 5], [0, 1, 3]], ["x", "y"])
    x = np.arange(24).reshape(4, 6)
    mesh0 = ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
    mesh1 = ProcessMesh([[4, 5], [6, 7]], ["x", "y"])
    pictures = {
        "mesh_seed.png": MeshView(seed),
        "tensor_partial.png": TensorView(x.shape, seed, [Partial(), Shard(1)], value=x),
        "tensor_s0_s1.png": TensorView(x.shape, seed, [Shard(0), Shard(1)], value=x),
        "reshard_p_to_r.png": ReshardView((4, 6), seed, ["P(sum)", "S(1)"], dst_placements=["R", "R"]),
        "reshard_s0_to_s1.png": ReshardView((4, 6), ProcessMesh([0, 1], ["x"]), ["S(0)"], dst_placements=["S(1)"]),
        "reshard_cross_mesh.png": ReshardView((2, 4, 4), mesh0, ["S(0)", "R"], mesh1, ["S(0)", "S(2)"]),
        "pipeline_1f1b.png": PipelineView.synthetic(stages=4, micro_batches=8, schedule="1F1B", comm=0.05),
    }
    written = []
    for name, view in pictures.items():
        path = os.path.join(out, name)
        view.save(path, dpi=90)
        written.append(path)
        print(f"{path}  {view!r}")
    return written


def refresh_notebook(path: str) -> None:
    """Execute in place, then drop widget views and widget state: the stored outputs keep text and a PNG, so the
    notebook opens without 'model not found' boxes and stays small; running it brings the live widgets back."""
    subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", "--inplace",
                    path], check=True, cwd=ROOT)
    full = os.path.join(ROOT, path)
    with open(full, encoding="utf-8") as fh:
        nb = json.load(fh)
    nb["metadata"].pop("widgets", None)
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            out.get("data", {}).pop("application/vnd.jupyter.widget-view+json", None)
    with open(full, "w", encoding="utf-8") as fh:
        json.dump(nb, fh, indent=1, ensure_ascii=False)
        fh.write("\n")
    print(f"{path}: {os.path.getsize(full) // 1024} KiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "img"))
    ap.add_argument("--notebooks", action="store_true", help="also re-execute the explorer notebook in place")
    args = ap.parse_args()
    render(args.out)
    if args.notebooks:
        for nb in NOTEBOOKS:
            refresh_notebook(nb)


if __name__ == "__main__":
    main()
