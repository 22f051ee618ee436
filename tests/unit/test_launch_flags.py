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
    # Paddle's flags for what meshviz does not run are refused, saying why
    (["--nnodes", "2:4", "s.py"], "--nnodes 2:4: an elastic range of nodes (Paddle's elastic mode) is not "
                                  "supported; give one number"),
    (["--nnodes", "two", "s.py"], "--nnodes must be a number of nodes, got 'two'"),
    (["--elastic_level", "1", "s.py"], "--elastic_level 1: Paddle's elastic mode is not supported (only -1)"),
    (["--legacy", "true", "s.py"], "--legacy: Paddle's legacy launcher is not supported; leave the flag out"),
    (["--servers", "10.0.0.1:6000", "s.py"], "--servers is a parameter-server flag (Paddle's --run_mode ps), "
                                             "which meshviz does not have (it runs collective jobs)"),
    (["--auto_tuner_json", "t.json", "s.py"], "--auto_tuner_json is a flag of Paddle's auto-tuner, which meshviz "
                                              "does not have (it runs collective jobs)"),
    (["--log_level", "LOUD", "s.py"], "--log_level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'LOUD'"),
    (["--ips", "10.0.0.1,10.0.0.2", "--host", "10.0.0.3", "s.py"],
     "cannot tell which of --ips ['10.0.0.1', '10.0.0.2'] is this node; pass --rank (or --host)"),
])
def test_a_bad_flag_is_refused_before_torch_is_imported(argv, error, tmp_path, monkeypatch, capsys):
    (tmp_path / "s.py").write_text("print('ran')\n")
    monkeypatch.chdir(tmp_path)
    assert launch(argv) == 2
    out, err = capsys.readouterr()
    assert err == f"meshviz.launch: error: {error}\n" and out == ""


def test_paddles_other_flags_are_taken():
    """Paddle's launch flags that make sense here parse and pass (argparse refused them: "unrecognized arguments");
    ``--host`` names this node among ``--ips``, ``--nnodes N:N`` is N."""
    from meshviz.launch.main import _flags, parse_args

    args = parse_args(["--log_level", "debug", "--log_overwrite", "true", "--sort_ip", "0", "--enable_gpu_log",
                       "false", "--legacy", "false", "--elastic_level", "-1", "--elastic_timeout", "60", "--job_id",
                       "j", "--run_mode", "collective", "--auto_cluster_config", "false", "s.py", "--lr", "1"])
    assert (args.log_level, args.log_overwrite, args.sort_ip, args.training_script_args) == (
        "debug", True, False, ["--lr", "1"])
    assert _flags(args) == (1, 0, None)
    assert parse_args(["s.py"]).log_overwrite is False  # Paddle's default: append to the logs
    args = parse_args(["--ips", "10.0.0.1,10.0.0.2", "--host", "10.0.0.2", "--nnodes", "2:2", "s.py"])
    assert _flags(args) == (2, 1, "10.0.0.1:6070")
