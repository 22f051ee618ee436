"""The op sweep, seeded sample: every op case in sampled placements on 2 ranks and a 2x2 mesh, against the dense run."""

import pytest

from tests.ranks.op_cases import CASES, MESHES, case_keys, figure, label, run_sweep

# seeded picks per case and shape: the same cases on every run; the counts pin the sweep so it cannot shrink
SAMPLE = {"1d": 3, "2d": 1}
TRIED = {"1d": 792, "2d": 264}


@pytest.mark.parametrize("mesh", ["1d", "2d"])
def test_op_sweep_matches_dense(mesh, record_property):
    keys = case_keys(len(MESHES[mesh]), sample=SAMPLE[mesh], seed=1)
    assert len(keys) == TRIED[mesh]
    results = run_sweep(mesh, keys, seed=1, timeout=240)
    assert len(results) == TRIED[mesh]
    record_property("op_sweep", figure(results).splitlines()[0])  # scripts/test_table.py reads it
    assert {CASES[key[0]].op for _m, key, _s, _d in results} == {c.op for c in CASES}
    bad = [f"{st} {label(m, key)}: {detail}" for m, key, st, detail in results if st in ("WRONG", "crashed")]
    assert not bad, figure(results) + "\n" + "\n".join(bad)
