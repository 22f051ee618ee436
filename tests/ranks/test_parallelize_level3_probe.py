"""Strict device mode per rank; dist.parallelize at sharding levels 1-3 in one call and two, against one process."""

import threading
import time

import pytest
import torch
from torch import nn

from meshviz.testing import run_ranks
from tests.models import LlamaForCausalLM, llama_loss

H = 4
_INSIDE, _CHECKED = threading.Event(), threading.Event()


def _wait_for(event: threading.Event, what: str) -> None:
    """Sleep until ``event`` is set: a rank thread hands the baton on while it sleeps, so the other rank runs."""
    deadline = time.monotonic() + 30
    while not event.is_set():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


class _Waits(nn.Module):
    """On meta inputs (a stage's meta forward) it holds the forward until the other rank has checked its mode."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, x):
        if x.device.type == "meta":
            _INSIDE.set()
            _wait_for(_CHECKED, "the other rank never checked")
        return self.fc(x)


def _meta_forward_beside_a_check():
    import meshviz.distributed as dist
    from meshviz.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer
    from meshviz.runtime import devices

    dist.init_parallel_env()
    layer = PipelineLayer([LayerDesc(_Waits), LayerDesc(_Waits)], num_stages=2)
    out: dict = {}
    if dist.get_rank() == 0:
        shape = tuple(layer.meta_forward(1, (torch.empty(3, H, device="meta"),)).shape)
        out = {"shape": shape, "strict": devices.strict()}
    else:
        _wait_for(_INSIDE, "rank 0 never ran its meta forward")
        try:
            out["strict"] = devices.strict()
            try:
                devices.check("all_reduce", dist.get_group(), [torch.ones(2, device="meta")])
                out["check"] = "passed"
            except ValueError as e:
                out["check"] = str(e)
        finally:
            _CHECKED.set()
    dist.barrier()
    return out


@pytest.mark.timeout(60)
def test_a_meta_forward_leaves_strict_mode_of_a_concurrent_rank_alone(monkeypatch):
    """PipelineLayer.meta_forward (what_if's stage shapes) turned strict device mode off for the whole process while
    it ran: a rank thread checking a collective's tensors meanwhile let a meta tensor through (strict False)."""
    monkeypatch.setenv("MESHVIZ_STRICT_DEVICES", "1")
    _INSIDE.clear()
    _CHECKED.clear()
    r0, r1 = run_ranks(_meta_forward_beside_a_check, 2, ranks="threads", timeout=50)
    assert r0 == {"shape": (3, H), "strict": True}
    assert r1["strict"] is True
    assert "all_reduce: a tensor on meta but this rank's device is cpu" in r1["check"]


def _mode():
    from meshviz.runtime import devices

    with devices.strict_devices(False):
        inside = devices.strict()
    return devices.strict(), inside


@pytest.mark.timeout(60)
def test_a_thread_rank_s_own_env_sets_its_strict_mode(monkeypatch):
    """Thread ranks read MESHVIZ_STRICT_DEVICES from the process's environment, not their own (``run_ranks(env=)``),
    so env={'MESHVIZ_STRICT_DEVICES': '0'} left them strict; processes honoured it."""
    monkeypatch.setenv("MESHVIZ_STRICT_DEVICES", "1")
    assert run_ranks(_mode, 2, env={"MESHVIZ_STRICT_DEVICES": "0"}, ranks="threads") == [(False, False)] * 2
    monkeypatch.setenv("MESHVIZ_STRICT_DEVICES", "0")
    assert run_ranks(_mode, 2, env={"MESHVIZ_STRICT_DEVICES": "1"}, ranks="threads") == [(True, False)] * 2


# -- dist.parallelize --------------------------------------------------------------------------------------------

def _llama():
    from tests.ranks.test_parallelize_8_probe import Cfg

    torch.manual_seed(0)
    return LlamaForCausalLM(Cfg, num_layers=2)


def _two_forms(form: str):
    """dp2 x pp2 x mp2 at sharding level 3, the configs in one call or in two (the model's, then dp_config with
    the optimizer); each starts from no cached op decision. Its communication events and weights after 2 steps."""
    import meshviz.distributed as dist
    from meshviz import trace
    from meshviz.runtime.op_plan import clear_decisions
    from tests.ranks.test_parallelize_8_probe import _batches, _plan

    dist.init_parallel_env()
    dist.auto_parallel.set_mesh(None)
    if dist.get_rank() == 0:
        clear_decisions()
    dist.barrier()
    mesh = dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dim_names=["dp", "pp", "mp"])
    model = _llama()
    model_cfg = {"mp_config": {"parallelize_plan": _plan(False)}, "pp_config": {"split_spec": "llama.layers"}}
    dp_cfg = {"dp_config": {"sharding_level": 3}}
    with trace.record() as rec:
        if form == "one":
            model, opt = dist.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.5), mesh=mesh,
                                          config={**model_cfg, **dp_cfg})
        else:
            model, _ = dist.parallelize(model, None, mesh=mesh, config=model_cfg)
            model, opt = dist.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.5), mesh=mesh,
                                          config=dp_cfg)
        first, last = mesh.get_mesh_with_dim("pp", 0), mesh.get_mesh_with_dim("pp", 1)
        for (ids, labels), in _batches(1, steps=2):
            ids = dist.shard_tensor(ids, first, [dist.Shard(0), dist.Replicate()])
            labels = dist.shard_tensor(labels, last, [dist.Shard(0), dist.Replicate()])
            llama_loss(model(ids), labels).backward()
            opt.step()
            opt.zero_grad()
    moves = [(e.kind, e.op, e.group, e.bytes) for e in rec.events if e.kind in ("reshard_step", "collective")]
    weights = {n: dist.unshard_dtensor(p).detach().clone() for n, p in model.named_parameters()}
    return moves, {n: w for n, w in weights.items() if w.numel()}


def _dense_llama(steps: int, lr: float = 0.5, momentum: float = 0.0) -> dict:
    from tests.ranks.test_parallelize_8_probe import _batches

    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for (ids, labels), in _batches(1, steps=steps):
        llama_loss(model(ids), labels).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.timeout(120)
def test_level_3_in_one_call_and_in_two_moves_the_same_and_trains_as_one_process():
    one = run_ranks(_two_forms, 8, "one", timeout=100, collective_timeout=40)
    two = run_ranks(_two_forms, 8, "two", timeout=100, collective_timeout=40)
    want = _dense_llama(2)
    for rank, ((moves_one, w_one), (moves_two, w_two)) in enumerate(zip(one, two)):
        assert moves_one == moves_two, rank
        assert {op for _, op, _, _ in moves_one} >= {"all_gather", "reduce_scatter", "send_recv"}, rank
        assert w_one.keys() == w_two.keys() and w_one, rank
        for name, w in w_one.items():
            torch.testing.assert_close(w, want[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{rank} {name}: {m}")
            torch.testing.assert_close(w_two[name], w, rtol=0, atol=0)
    for name in want:  # every weight is held by the ranks of its stage
        assert any(name in w for _, w in one), name


def _optimizer_after_a_step(level: int):
    import meshviz.distributed as dist
    from meshviz.distributed.auto_parallel.intermediate import parallelize_model, parallelize_optimizer
    from tests.ranks.test_parallelize_8_probe import _batches, _plan

    dist.init_parallel_env()
    dist.auto_parallel.set_mesh(None)
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    cfg = {"mp_config": {"parallelize_plan": _plan(False)}, "dp_config": {"sharding_level": level}}
    model = parallelize_model(_llama(), mesh=mesh, config=cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = [dist.shard_tensor(t, mesh, [dist.Shard(0), dist.Replicate()]) for (pair,) in _batches(1, steps=3)
               for t in pair]
    llama_loss(model(batches[0]), batches[1]).backward()
    opt.step()
    opt.zero_grad()
    opt = parallelize_optimizer(opt, mesh=mesh, config=cfg)
    for i in (2, 4):
        llama_loss(model(batches[i]), batches[i + 1]).backward()
        opt.step()
        opt.zero_grad()
    return type(opt).__name__, {n: dist.unshard_dtensor(p).detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_parallelize_optimizer_carries_over_the_states_of_an_optimizer_that_has_stepped(level):
    """parallelize_optimizer took an optimizer holding momentum; at levels 1 and 2 the sharded optimizer stepped
    shadows of the parameters without it, and the weights left one process's (embedding off by 0.0039 after 2
    more steps). The states it holds are sharded now, as Paddle's shard_optimizer shards the accumulators it finds:
    the weights are one process's that never stopped, at every level."""
    want = _dense_llama(3, lr=0.1, momentum=0.9)
    for rank, (kind, weights) in enumerate(run_ranks(_optimizer_after_a_step, 4, level, timeout=100)):
        assert kind != "SGD", rank
        for name, w in want.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{rank} {name}: {m}")

