"""Ranks and GPUs counted before anything starts, and every tensor on its rank's device (CPU-testable parts)."""

import itertools
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

from meshviz.core.devices import DeviceNotice, RankDevices, parse_devices, plan_devices

SPECS = ["auto", "cpu", "cuda"]
LISTS = [(0,), (1,), (0, 1), (1, 0), (0, 0), (2, 3), (0, 1, 2, 3), (0, 1, 0, 1), (3, 2, 1, 0), (7,)]


def _outcome(n, devices, gpus, backend):
    try:
        return plan_devices(n, devices, gpus, backend, who="t")
    except ValueError as e:
        return e


# -- the one decision, exhaustively, with the GPU count as an argument -------------------------------------------

@pytest.mark.timeout(60)
def test_plan_invariants_over_every_combination():
    seen = {"cpu": 0, "nccl": 0, "shared": 0, "notice": 0, "error": 0}
    for n, gpus, backend, devices in itertools.product(range(1, 9), range(0, 9), (None, "gloo", "nccl"),
                                                       SPECS + LISTS):
        got = _outcome(n, devices, gpus, backend)
        ids = devices if isinstance(devices, tuple) else None
        insisted = devices == "cuda" or ids is not None or backend == "nccl"
        if isinstance(got, ValueError):
            seen["error"] += 1
            text = str(got)
            assert text.startswith("t: ") and len(text) < 400, text
            # an error only where the request cannot be met
            if devices == "cpu":
                assert backend == "nccl"
            elif ids is not None:
                assert (len(ids) != n or any(i >= gpus for i in ids)
                        or (len(set(ids)) != len(ids) and backend != "gloo")), (n, devices, gpus, backend)
            else:
                assert insisted and (gpus == 0 or (gpus < n and backend != "gloo")), (n, devices, gpus, backend)
            continue
        assert isinstance(got, RankDevices) and got.n == n and len(got.gpus) == n
        assert got.backend in ("gloo", "nccl")
        on = [g is not None for g in got.gpus]
        assert all(on) or not any(on), got  # a world never mixes CPU and GPU ranks
        used = [g for g in got.gpus if g is not None]
        assert all(0 <= g < gpus for g in used), got
        if got.backend == "nccl":  # NCCL: one distinct GPU per rank
            assert all(on) and len(set(used)) == n, got
        if backend is not None:
            assert got.backend == backend
        if devices == "cpu" or not any(on):
            assert got.backend == "gloo" and got.device_type == "cpu"
            seen["cpu"] += 1
        if ids is not None:
            assert got.gpus == ids
        if devices == "auto" and backend is None:
            if gpus >= n:
                assert got.gpus == tuple(range(n)) and got.backend == "nccl"
            else:
                assert not any(on)
        if got.notice is not None:  # said exactly when GPUs exist but the ranks run on the CPU anyway
            seen["notice"] += 1
            assert devices == "auto" and gpus and not any(on)
            assert f"{n} ranks" in got.notice and "CPU with gloo" in got.notice
        elif devices == "auto" and gpus and not any(on):
            raise AssertionError(f"no notice for {n} CPU ranks on a machine with {gpus} GPUs")
        seen["nccl"] += got.backend == "nccl"
        seen["shared"] += got.shared
        assert not got.shared or got.backend == "gloo"
    assert all(seen.values()), seen  # every kind of outcome was reached


def test_plan_table():
    # more ranks than GPUs, nobody insisted: CPU with gloo, said once
    p = plan_devices(4, "auto", 1, who="Cluster")
    assert p == RankDevices(4, "gloo", (None,) * 4, p.notice) and p.devices == ["cpu"] * 4
    assert p.notice.startswith("Cluster: 4 ranks but 1 GPU is visible: the ranks run on the CPU with gloo")
    assert plan_devices(4, "auto", 0).notice is None  # nothing to say on a CPU-only machine
    # enough GPUs: one each, NCCL
    assert plan_devices(2, "auto", 4).devices == ["cuda:0", "cuda:1"]
    assert plan_devices(2, "auto", 4).backend == "nccl"
    # insisting on GPUs
    with pytest.raises(ValueError, match=r"spawn: 2 ranks on GPUs but 1 GPU is visible.*NCCL needs one GPU per rank"):
        plan_devices(2, "cuda", 1, who="spawn")
    with pytest.raises(ValueError, match="no GPU is visible"):
        plan_devices(2, "cuda", 0)
    with pytest.raises(ValueError, match="needs GPUs"):
        plan_devices(2, "cpu", 4, "nccl")
    with pytest.raises(ValueError, match="ranks on GPUs"):
        plan_devices(3, "auto", 2, "nccl")  # backend='nccl' insists too
    # sharing GPUs needs gloo, and says so
    shared = plan_devices(5, "cuda", 2, "gloo")
    assert shared.gpus == (0, 1, 0, 1, 0) and shared.backend == "gloo" and shared.shared
    with pytest.raises(ValueError, match=r"devices=\[0, 0\] names GPU 0 more than once.*backend='gloo'"):
        plan_devices(2, [0, 0], 1)
    assert plan_devices(2, [0, 0], 1, "gloo").gpus == (0, 0)
    # missing, extra or invisible ids
    with pytest.raises(ValueError, match=r"3 ranks but 2 GPU ids"):
        plan_devices(3, [0, 1], 4)
    with pytest.raises(ValueError, match=r"names GPU 1 but 1 GPU is visible \(ids 0..0\)"):
        plan_devices(2, [0, 1], 1)
    with pytest.raises(ValueError, match="names GPU 0, 1 but no GPU is visible"):
        plan_devices(2, "0,1", 0)
    # n from the devices
    assert plan_devices(None, [2, 0], 3).gpus == (2, 0)
    assert plan_devices(None, "auto", 3).n == 3 and plan_devices(None, "auto", 0, default_cpu=4).n == 4
    assert plan_devices(None, "cpu", 8, default_cpu=2).n == 2
    # GPUs not counted here (engines elsewhere): GPU LOCAL_RANK
    assert plan_devices(3, "cuda", None).gpus is None and plan_devices(3, "cuda", None).devices == ["cuda"] * 3
    # names of a launcher's flags in the messages
    with pytest.raises(ValueError, match=r"--nproc_per_node <= 1"):
        plan_devices(2, "cuda", 1, who="", names={"n": "--nproc_per_node", "devices": "--devices"})
    for bad in ("tpu", [], [-1], [True], 1.5, "0,x"):
        with pytest.raises(ValueError):
            plan_devices(1, bad, 4)
    for bad_n in (0, -1, True, 1.0):
        with pytest.raises(ValueError):
            plan_devices(bad_n, "cpu", 0)
    with pytest.raises(ValueError, match="backend"):
        plan_devices(1, "cpu", 0, "mpi")


def test_parse_devices():
    assert parse_devices(None) == "auto" and parse_devices("GPU") == "cuda" and parse_devices(" cpu ") == "cpu"
    assert parse_devices("0,1") == (0, 1) and parse_devices("3") == (3,) and parse_devices([2, 0]) == (2, 0)


# -- every entry point uses it, before anything starts --------------------------------------------------------

def test_cluster_config_counts_before_starting():
    from meshviz.cluster.config import ClusterConfig, rank_configs

    c = ClusterConfig.from_args(4, gpus=1)
    assert (c.mode, c.backend, c.n) == ("cpu", "gloo", 4) and "4 ranks but 1 GPU" in c.notice
    c = ClusterConfig.from_args(None, gpus=2)
    assert (c.mode, c.gpus, c.backend, c.n, c.notice) == ("list", (0, 1), "nccl", 2, None)
    c = ClusterConfig.from_args(3, "cuda", "gloo", gpus=1)
    assert c.gpus == (0, 0, 0) and c.backend == "gloo"
    t0 = time.perf_counter()
    for args in [(2, "cuda"), (2, [0, 0]), (2, [0, 1]), (3, [0, 1]), (2, "cpu", "nccl")]:
        with pytest.raises(ValueError, match="Cluster: "):
            ClusterConfig.from_args(*args, gpus=1)
    assert time.perf_counter() - t0 < 1.0
    probes = [{"host": "a", "pid": r, "port": 5000} for r in range(3)]
    cfgs = rank_configs(probes, "list", (0, 0, 0), "127.0.0.1", True, 60.0, "gloo")
    assert [c["env"]["MESHVIZ_DEVICE"] for c in cfgs] == ["cuda:0"] * 3 and {c["backend"] for c in cfgs} == {"gloo"}
    cpu = rank_configs(probes, "cpu", None, "127.0.0.1", True, 60.0, "gloo")
    assert all(c["env"]["MESHVIZ_DEVICE"] == "cpu" and c["env"]["CUDA_VISIBLE_DEVICES"] == "" for c in cpu)


def test_rank_configs_translate_ids_through_visible_devices(monkeypatch):
    from meshviz.cluster.config import rank_configs

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    probes = [{"host": "a", "pid": r, "port": 5000} for r in range(2)]
    cfgs = rank_configs(probes, "list", (1, 0), "127.0.0.1", True, 60.0, "nccl")
    assert [c["env"]["CUDA_VISIBLE_DEVICES"] for c in cfgs] == ["6", "4"]  # the i-th GPU this process sees


def test_launch_plans_workers_before_starting(monkeypatch):
    import meshviz.runtime.devices as devs
    from meshviz.launch.main import _build, parse_args

    def plan(argv, gpus, backend=None):
        monkeypatch.setattr(devs, "visible_gpu_count", lambda: gpus)
        if backend:
            monkeypatch.setenv("MESHVIZ_BACKEND", backend)
        else:
            monkeypatch.delenv("MESHVIZ_BACKEND", raising=False)
        config, env, reservation, p = _build(parse_args(argv + ["s.py"]))
        if reservation is not None:
            reservation.close()
        import json

        return p, json.loads(env["MESHVIZ_LAUNCH_RANK_ENV"]), env

    p, envs, env = plan(["--nproc_per_node", "2"], 1)  # more workers than GPUs: CPU, gloo, said once
    assert p.backend == env["MESHVIZ_BACKEND"] == "gloo" and "2 ranks but 1 GPU" in p.notice
    assert envs == [{"MESHVIZ_BACKEND": "gloo", "CUDA_VISIBLE_DEVICES": "", "MESHVIZ_DEVICE": "cpu"}] * 2
    p, envs, _ = plan([], 2)  # one per GPU
    assert p.n == 2 and [e["MESHVIZ_DEVICE"] for e in envs] == ["cuda:0", "cuda:1"] and p.backend == "nccl"
    assert "CUDA_VISIBLE_DEVICES" not in envs[0]
    p, envs, _ = plan(["--devices", "1,0"], 2)  # listed GPUs: each worker sees only its own, as cuda:0
    assert [(e["CUDA_VISIBLE_DEVICES"], e["MESHVIZ_DEVICE"], e["FLAGS_selected_gpus"]) for e in envs] == [
        ("1", "cuda:0", "1"), ("0", "cuda:0", "0")]
    p, envs, _ = plan(["--devices", "cpu", "--nproc_per_node", "3"], 8)
    assert p.n == 3 and p.device_type == "cpu" and p.notice is None
    p, _, _ = plan(["--devices", "0,0"], 1, backend="gloo")
    assert p.gpus == (0, 0) and p.backend == "gloo"
    for argv, gpus, match in [(["--devices", "0,1"], 1, "names GPU 1 but 1 GPU is visible"),
                              (["--devices", "0,0"], 1, "more than once"),
                              (["--devices", "0,1"], 0, "no GPU is visible"),
                              (["--devices", "a,b"], 1, "--devices must be"),
                              (["--nproc_per_node", "3", "--devices", "0,1"], 2, "more processes than the 2")]:
        with pytest.raises(ValueError, match=match):
            plan(argv, gpus)


@pytest.mark.timeout(60)
def test_launch_refuses_bad_devices_at_once(tmp_path):
    """On this machine's GPUs (none in CI): an id that is not visible is an error, before any worker starts."""
    (tmp_path / "s.py").write_text("raise SystemExit('never runs')\n")
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "meshviz.launch", "--devices", f"0,{ngpu}", "s.py"],
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    took = time.perf_counter() - t0
    assert out.returncode == 2 and f"names GPU {ngpu} but" in out.stderr, out.stderr
    assert "Configuration Arguments" not in out.stdout and not (tmp_path / "log").exists()
    assert took < 30  # interpreter and torch import included; the check itself is pure


def test_spawn_refuses_before_starting_processes(monkeypatch):
    import meshviz.distributed as dist
    import meshviz.runtime.devices as devs

    monkeypatch.setattr(devs, "visible_gpu_count", lambda: 1)
    t0 = time.perf_counter()
    for kw, match in [(dict(nprocs=2, devices="cuda"), "spawn: 2 ranks on GPUs"),
                      (dict(nprocs=2, gpus="0,0"), "more than once"),
                      (dict(nprocs=2, backend="nccl"), "NCCL needs one GPU per rank"),
                      (dict(nprocs=3, devices=[0, 1]), "3 ranks but 2 GPU ids")]:
        with pytest.raises(ValueError, match=match):
            dist.spawn(print, **kw)
    assert time.perf_counter() - t0 < 1.0


def test_initial_device_follows_the_plan(monkeypatch):
    import meshviz.runtime.devices as devs

    monkeypatch.setenv("MESHVIZ_DEVICE", "cpu")
    monkeypatch.delenv("MESHVIZ_BACKEND", raising=False)
    assert devs.initial_device() == ("gloo", torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a GPU"):
        devs.initial_device("nccl")
    monkeypatch.setenv("MESHVIZ_DEVICE", "cuda:1")
    assert devs.initial_device() == ("nccl", torch.device("cuda", 1))
    assert devs.initial_device("gloo") == ("gloo", torch.device("cuda", 1))
    # no decision handed down (plain torchrun): the same decision for LOCAL_WORLD_SIZE ranks
    monkeypatch.delenv("MESHVIZ_DEVICE")
    monkeypatch.setattr(devs, "visible_gpu_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.warns(DeviceNotice, match="4 ranks but 1 GPU"):
        assert devs.initial_device() == ("gloo", torch.device("cpu"))
    monkeypatch.setenv("LOCAL_RANK", "2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said by local rank 0 only
        assert devs.initial_device() == ("gloo", torch.device("cpu"))
    with pytest.raises(ValueError, match="NCCL needs one GPU per rank"):
        devs.initial_device("nccl")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert devs.initial_device() == ("nccl", torch.device("cuda", 0))


def test_rank_env():
    from meshviz.runtime.devices import rank_env

    cpu = plan_devices(2, "cpu", 4)
    assert rank_env(cpu, 1) == {"MESHVIZ_BACKEND": "gloo", "CUDA_VISIBLE_DEVICES": "", "MESHVIZ_DEVICE": "cpu"}
    gpu = plan_devices(2, "auto", 4)
    assert rank_env(gpu, 1) == {"MESHVIZ_BACKEND": "nccl", "MESHVIZ_DEVICE": "cuda:1"}
    assert rank_env(gpu, 1, ["5", "7"], renumber=True) == {"MESHVIZ_BACKEND": "nccl", "CUDA_VISIBLE_DEVICES": "7",
                                                           "MESHVIZ_DEVICE": "cuda:0"}


# -- the device check in comm.run -------------------------------------------------------------------------------

class _FakeGroup:
    """A meshviz Group of this one rank whose backend is named (no process group needed for the check)."""

    def __new__(cls, backend):
        from meshviz.runtime.groups import Group

        g = Group(0, 99, [0], None)
        g._backend = backend
        return g


def test_cpu_tensor_into_nccl_collective_is_one_clear_error():
    from meshviz.runtime import comm, devices

    started = []
    with pytest.raises(ValueError) as e:
        comm.run(comm.Call("all_reduce", _FakeGroup("nccl"), lambda g: started.append(1), tensors=(torch.ones(2),)))
    assert not started  # before any communication
    text = str(e.value)
    assert "all_reduce: a tensor on cpu cannot go into an NCCL collective" in text and "t.to(dist.device())" in text
    assert "No backend type" not in text
    # gloo carries any device: nothing checked (outside strict mode)
    with devices.strict_devices(False):
        comm.run(comm.Call("all_reduce", _FakeGroup("gloo"), lambda g: started.append(1),
                           tensors=(torch.ones(2, device="meta"),)))
    assert started == [1]


def test_strict_mode_raises_on_any_other_device(monkeypatch):
    from meshviz.runtime import comm, devices

    monkeypatch.delenv(devices.STRICT_ENV, raising=False)
    started = []
    g = _FakeGroup("gloo")
    with devices.strict_devices():
        assert devices.strict()
        comm.run(comm.Call("broadcast", g, lambda g: started.append(1), tensors=(torch.ones(2),)))  # its device: fine
        with pytest.raises(ValueError, match=r"broadcast: a tensor on meta but this rank's device is cpu \(strict"):
            comm.run(comm.Call("broadcast", g, lambda g: started.append(2),
                               tensors=(torch.ones(2), torch.ones(2, device="meta"))))
    assert not devices.strict() and started == [1]
    monkeypatch.setenv(devices.STRICT_ENV, "1")
    assert devices.strict()
    devices.set_strict(False)
    try:
        assert not devices.strict()
    finally:
        devices.set_strict(None)
    assert devices.strict()


def test_staging_for_gloo_point_to_point_is_a_no_op_on_cpu():
    from meshviz.runtime.devices import staged_recv, staged_send

    t = torch.arange(3.0)
    assert staged_send(t) is t
    buf, fin = staged_recv(t)
    assert buf is t and fin is None


def test_place_module_leaves_cpu_ranks_alone():
    from meshviz.runtime.devices import place_module

    m = torch.nn.Linear(2, 2)
    w = m.weight
    assert place_module(m, "DataParallel") is m and m.weight is w and w.device.type == "cpu"


# -- multi-rank, on the CPU, strict ----------------------------------------------------------------------------

def _strict_world():
    import torch.distributed as tdist

    import meshviz.distributed as dist
    from meshviz.runtime import devices

    dist.init_parallel_env()
    r = dist.get_rank()
    out = {"strict": devices.strict(), "device": str(dist.device()), "backend": tdist.get_backend()}
    t = torch.ones(2) * (r + 1)
    dist.all_reduce(t)
    out["sum"] = t.tolist()
    try:
        dist.all_reduce(torch.ones(2, device="meta"))
    except ValueError as e:
        out["meta"] = str(e)
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    d = dist.shard_tensor(torch.arange(4.0), mesh, [dist.Shard(0)])
    out["full"] = dist.reshard(d, mesh, [dist.Replicate()])._local_value().tolist()
    out["visible"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    return out


@pytest.mark.timeout(120)
def test_strict_cpu_world_names_the_bad_tensor():
    from meshviz.testing import run_ranks

    for _r, o in enumerate(run_ranks(_strict_world, 2, env={"MESHVIZ_STRICT_DEVICES": "1"}, timeout=90)):
        assert o["strict"] and o["device"] == "cpu" and o["backend"] == "gloo" and o["visible"] == ""
        assert o["sum"] == [3.0, 3.0] and o["full"] == [0.0, 1.0, 2.0, 3.0]
        assert "all_reduce: a tensor on meta but this rank's device is cpu" in o["meta"]


def _offload_pgos(seg):
    import meshviz.distributed as dist
    import meshviz.distributed.sharding.group_sharded as gs
    from meshviz.nn import ClipGradByGlobalNorm
    from tests.ranks.test_group_sharded import CLIP, LR, STEPS, WD, batch, full_params, make_model

    dist.init_parallel_env()
    # the ranks compute "elsewhere" than the CPU: offload is then real, and its bookkeeping runs here on the CPU
    gs.device = lambda: torch.device("meta")
    model = make_model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    model, opt, _ = gs.group_sharded_parallel(model, opt, "p_g_os", segment_size=seg, offload=True,
                                              grad_clip=ClipGradByGlobalNorm(CLIP))
    stepped = [p for g in opt.param_groups for p in g["params"]]
    for s in range(STEPS):
        x, y = batch(s, dist.get_rank())
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.clear_grad()
    states = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"params": full_params(model), "distinct": all(q is not p for q, p in zip(stepped, params)),
            "flat": all(q.dim() == 1 for q in stepped), "n_states": len(states),
            "full": {k: {kk: vv for kk, vv in v.items()} for k, v in opt.full_state_dict()["state"].items()}}


@pytest.mark.timeout(120)
def test_p_g_os_offload_steps_every_small_parameter_as_a_cpu_copy():
    """No parameter reaches segment_size: offload used to leave everything where it was; now the optimizer steps
    CPU copies of the whole parameters and copies them back, training exactly like data parallel."""
    from meshviz.testing import run_ranks
    from tests.ranks.test_group_sharded import reference

    ref, ref_opt, _ = reference(2)
    ref_state = ref_opt.state_dict()["state"]
    for res in run_ranks(_offload_pgos, 2, 10**9, timeout=100):
        assert res["distinct"] and res["flat"] and res["n_states"] == 8  # exp_avg, exp_avg_sq of 4 parameters
        for k, v in ref.items():
            torch.testing.assert_close(res["params"][k], v, rtol=1e-5, atol=1e-6)
        for i, st in ref_state.items():
            torch.testing.assert_close(res["full"][i]["exp_avg"], st["exp_avg"], rtol=1e-5, atol=1e-7)


def _offload_edited(level, seg):
    import meshviz.distributed as dist
    import meshviz.distributed.sharding.group_sharded as gs
    from meshviz.nn import ClipGradByGlobalNorm
    from tests.ranks.test_group_sharded import CLIP, LR, STEPS, WD, batch, full_params, make_model

    dist.init_parallel_env()
    gs.device = lambda: torch.device("meta")  # offload is real (see _offload_pgos)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    model, opt, _ = gs.group_sharded_parallel(model, opt, level, segment_size=seg, offload=True,
                                              grad_clip=ClipGradByGlobalNorm(CLIP))
    _edit(model, 0)
    for s in range(STEPS):
        x, y = batch(s, dist.get_rank())
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.clear_grad()
        _edit(model, s + 1)
    return full_params(model)


def _edit(model, step):
    """What a resumed run or a user does to the parameters between steps: a checkpoint loaded, an in-place edit."""
    with torch.no_grad():
        if step == 0:
            model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
        elif step == 2:
            for p in model.parameters():
                p.add_(0.1)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("level,seg", [("os", 8), ("os_g", 8), ("p_g_os", 10**9)])
def test_offload_steps_what_the_parameters_hold_now(level, seg):
    """Offload steps CPU copies of this rank's part of each parameter: a checkpoint loaded after wrapping, or an
    in-place edit between steps, must reach those copies (the stale copy used to overwrite it at the next step)."""
    from meshviz.testing import run_ranks
    from tests.ranks.test_group_sharded import CLIP, LR, STEPS, WD, batch, make_model

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    _edit(model, 0)
    for s in range(STEPS):
        xs, ys = zip(*(batch(s, r) for r in range(2)))
        torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())))
        for p in model.parameters():
            p.grad.mul_(CLIP / max(norm, CLIP))  # Paddle's global-norm clip, as the ranks clip
        opt.step()
        opt.zero_grad()
        _edit(model, s + 1)
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for rank, got in enumerate(run_ranks(_offload_edited, 2, level, seg, timeout=120)):
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {k}: {m}")
