"""launch refuses a bad flag or a missing script before it imports torch (the torch-free tier blocks torch)."""

import pytest

from meshviz.launch import launch

pytestmark = pytest.mark.torch_free


@pytest.mark.parametrize("argv, error", [
    (["--nproc_per_node", "3", "--devices", "0,1", "s.py"], "--nproc_per_node 3 asks for more processes than the 2 "
                                                            "devices listed in --devices 0,1"),
    (["--nproc_per_node", "0", "s.py"], "--nproc_per_node must be >= 1, got 0"),
    (["--devices", "gpu0", "s.py"], "--devices must be comma-separated GPU ids or 'cpu', got 'gpu0'"),
    (["--nnodes", "2", "s.py"], "--nnodes > 1 needs --rank (this node's rank)"),
    (["--nnodes", "2", "--rank", "1", "s.py"], "--nnodes > 1 needs --master ip:port (or --ips)"),
    (["--nnodes", "2", "--rank", "2", "--master", "10.0.0.1:6070", "s.py"], "--rank 2 outside 0..1"),
    (["--ips", "10.0.0.1,10.0.0.2", "--nnodes", "3", "s.py"], "--ips lists 2 nodes but --nnodes is 3"),
    (["--master", "6070", "s.py"], "--master must be ip:port, got '6070'"),
    (["--max_restart", "-1", "s.py"], "--max_restart must be >= 0, got -1"),
    (["--hang_after", "-2", "s.py"], "--hang_after must be >= 0, got -2.0"),
    (["--run_mode", "ps", "s.py"], "--run_mode 'ps': only 'collective' is supported"),
    (["no_such.py"], "no such script 'no_such.py'"),
])
def test_a_bad_flag_is_refused_before_torch_is_imported(argv, error, tmp_path, monkeypatch, capsys):
    (tmp_path / "s.py").write_text("print('ran')\n")
    monkeypatch.chdir(tmp_path)
    assert launch(argv) == 2
    out, err = capsys.readouterr()
    assert err == f"meshviz.launch: error: {error}\n" and out == ""
