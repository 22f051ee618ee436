"""Each seed example is translated in a notebook cell that says so; no stored output names a machine's checkout."""

import json
import os
import re

import pytest

pytestmark = pytest.mark.torch_free  # imports no torch: the test command runs it once, torch blocked

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOKS = os.path.join(ROOT, "notebooks")

# (seed, example, notebook, marker that must appear in one of the notebook's code cells)
COVERAGE = [
    ("000", "DataParallel example (spawn / launch)", "03_data_parallel", "# seed 000 DataParallel example"),
    ("000", "PyLayer example (no_sync + fused_allreduce_gradients)", "03_data_parallel", "# seed 000 PyLayer example"),
    ("000", "no_sync example", "03_data_parallel", "# seed 000 no_sync example"),
    ("000", "state_dict example", "03_data_parallel", "# seed 000 state_dict example"),
    ("000", "set_state_dict example", "03_data_parallel", "# seed 000 set_state_dict example"),
    ("001", "1. dense tensor vs dist tensor", "01_mesh_and_placements", "# seed 001 §1"),
    ("001", "4.1 data parallel", "03_data_parallel", "# seed 001 §4.1"),
    ("001", "4.2 tensor parallel", "04_tensor_parallel", "# seed 001 §4.2"),
    ("001", "4.3 pipeline parallel", "05_pipeline", "# seed 001 §4.3"),
    ("001", "4.4 hybrid parallel", "06_hybrid", "# seed 001 §4.4"),
    ("001", "5 code 1: Shard(0)", "01_mesh_and_placements", "# seed 001 §5 code 1"),
    ("001", "5 code 2: Shard(1)", "01_mesh_and_placements", "# seed 001 §5 code 2"),
    ("001", "5 code 3: Shard(2) on a 2-D tensor", "01_mesh_and_placements", "# seed 001 §5 code 3"),
    ("001", "6.1 Partial -> Replicate", "02_reshard", "# seed 001 §6.1"),
    ("001", "6.2 Shard(0) -> Replicate", "02_reshard", "# seed 001 §6.2"),
    ("001", "7 BatchSampler, DataLoader, Dataset", "03_data_parallel", "# seed 001 §7"),
    ("002", "group_sharded_parallel example", "07_group_sharding", "# seed 002 group_sharded_parallel"),
    ("003", "DistModel / to_static example", "08_dist_model", "# seed 003 DistModel"),
    ("004", "single-card training", "09_fleet", "# seed 004 single-card"),
    ("004", "fleet multi-card training", "09_fleet", "# seed 004 fleet multi-card"),
    ("004", "fleetrun commands (one node, several nodes)", "09_fleet", "# seed 004 fleetrun"),
]


def _code_cells(name):
    path = os.path.join(NOTEBOOKS, name + ".ipynb")
    if not os.path.exists(path):
        pytest.fail(f"notebooks/{name}.ipynb is missing")
    with open(path, encoding="utf-8") as fh:
        nb = json.load(fh)
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("seed,example,notebook,marker", COVERAGE, ids=[f"{s}:{e}" for s, e, _, _ in COVERAGE])
def test_seed_example_has_a_notebook_cell(seed, example, notebook, marker):
    cells = _code_cells(notebook)
    assert any(marker in c for c in cells), f"seed {seed} '{example}': no code cell of {notebook} contains {marker!r}"


def test_markers_are_unique_and_every_seed_is_covered():
    markers = [m for *_, m in COVERAGE]
    assert len(set(markers)) == len(markers)
    assert {s for s, *_ in COVERAGE} == {"000", "001", "002", "003", "004"}


def test_notebooks_with_a_cluster_stop_it_last():
    for name in sorted(f[:-6] for f in os.listdir(NOTEBOOKS) if f.endswith(".ipynb")):
        cells = _code_cells(name)
        if any("meshviz.Cluster(" in c for c in cells):
            assert "cluster.stop()" in cells[-1], f"{name}: the last code cell must stop the cluster"


def test_no_notebook_output_names_a_checkout():
    # a stored traceback names meshviz's files relative to the package, never where one machine had it checked out
    found = []
    for name in sorted(os.listdir(NOTEBOOKS)):
        if name.endswith(".ipynb"):
            text = open(os.path.join(NOTEBOOKS, name), encoding="utf-8").read()
            found += [f"{name}: {m}" for m in sorted(set(re.findall(r"/(?:work|root|home)/[\w./-]*meshviz", text)))]
    assert not found, found
