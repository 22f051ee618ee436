"""Render the README tour's pictures into docs/img/, each checked for colliding or cut text (and, with --notebooks,
re-execute the notebooks that show views, so their stored pictures are the current ones)."""

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
from meshviz.widgets.sheet import DPI, collisions  # noqa: E402

# the notebooks whose stored outputs hold pictures, and the ranks they are stored from (00 and 11 as engines)
NOTEBOOKS = {"notebooks/00_quickstart.ipynb": "engines", "notebooks/01_mesh_and_placements.ipynb": "threads",
             "notebooks/02_reshard.ipynb": "threads", "notebooks/05_pipeline.ipynb": "threads",
             "notebooks/06_hybrid.ipynb": "threads", "notebooks/07_group_sharding.ipynb": "threads",
             "notebooks/10_explorer.ipynb": "threads", "notebooks/11_debugging_hangs.ipynb": "engines",
             "notebooks/12_parallelize.ipynb": "threads"}


def render(out: str) -> list[str]:
    os.makedirs(out, exist_ok=True)
    seed = ProcessMesh([[2, 4, 5], [0, 1, 3]], ["x", "y"])
    x = np.arange(24).reshape(4, 6)
    mesh0 = ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
    mesh1 = ProcessMesh([[4, 5], [6, 7]], ["x", "y"])
    cross = ReshardView((2, 4, 4), mesh0, ["S(0)", "R"], mesh1, ["S(0)", "S(2)"])
    pictures = {
        "mesh_seed.png": MeshView(seed),
        "mesh_3d.png": MeshView(ProcessMesh(np.arange(8).reshape(2, 2, 2), ["pp", "dp", "mp"]), within=[0, 1, 2, 3]),
        "tensor_partial.png": TensorView(x.shape, seed, [Partial(), Shard(1)], value=x),
        "tensor_s0_s1.png": TensorView(x.shape, seed, [Shard(0), Shard(1)], value=x),
        "reshard_p_to_r.png": ReshardView((4, 6), seed, ["P(sum)", "S(1)"], dst_placements=["R", "R"]),
        "reshard_s0_to_s1.png": ReshardView((4, 6), ProcessMesh([0, 1], ["x"]), ["S(0)"], dst_placements=["S(1)"]),
        "reshard_cross_mesh.png": cross,
        "reshard_transfer.png": (cross, cross.opening_frame()),  # the frame the widget opens on: the send/recv
        "pipeline_1f1b.png": PipelineView.synthetic(stages=4, micro_batches=8, schedule="1F1B", comm=0.05),
        "pipeline_vpp.png": PipelineView.synthetic(stages=4, micro_batches=8, schedule="VPP", chunks=2, comm=0.05),
    }
    written = []
    for name, view in pictures.items():
        view, frame = view if isinstance(view, tuple) else (view, None)
        fig = view.figure() if frame is None else view.frame_figure(frame)
        problems = collisions(fig)
        if problems:
            raise SystemExit(f"{name}: " + "; ".join(problems))
        path = os.path.join(out, name)
        fig.savefig(path, dpi=DPI)
        written.append(path)
        w, h = fig.get_size_inches() * DPI
        print(f"{path}  {w:.0f}x{h:.0f} px  {view!r}" + (f" frame {frame}" if frame is not None else ""))
    return written


def refresh_notebook(path: str, ranks: str = "threads") -> None:
    """Execute in place, then drop widget views and widget state: the stored outputs keep text and a PNG, so the
    notebook opens without 'model not found' boxes and stays small; running it brings the live widgets back.
    %px output is stored as the test command sees it (IPP_NONINTERACTIVE: plain text, rank by rank)."""
    env = dict(os.environ, IPP_NONINTERACTIVE="1", MESHVIZ_RANKS=ranks)
    subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", "--inplace",
                    "--ExecutePreprocessor.timeout=600", path], check=True, cwd=ROOT, env=env)
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
    ap.add_argument("--notebooks", nargs="*", default=None, metavar="NOTEBOOK",
                    help="also re-execute these notebooks in place (none named: every notebook that shows views)")
    args = ap.parse_args()
    render(args.out)
    if args.notebooks is not None:
        for nb in args.notebooks or NOTEBOOKS:
            refresh_notebook(nb, NOTEBOOKS.get(nb, "threads"))


if __name__ == "__main__":
    main()
