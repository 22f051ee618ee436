"""Rounds of jobs on one world of rank threads: what a failed round leaves behind never reaches the next."""

import time

import pytest
import torch


def _fail_then_recv(rank):
    import meshviz.distributed as dist

    if rank == 1:
        raise ValueError("rank 1 broke")
    time.sleep(0.3)  # rank 1 has failed: this receive is posted after it
    t = torch.zeros(1)
    try:
        dist.recv(t, src=1)
    except RuntimeError as e:
        return type(e).__name__
    return "received"


def _send_recv(rank):
    import meshviz.distributed as dist

    t = torch.full((1,), 7.0) if rank == 1 else torch.zeros(1)
    if rank == 1:
        dist.send(t, dst=0)
    else:
        dist.recv(t, src=1)
    return t.tolist()


@pytest.mark.timeout(60)
def test_a_receive_posted_after_its_peer_failed_is_not_filled_by_the_next_round():
    from meshviz.ranks.threads import ThreadWorld

    tw = ThreadWorld(2, timeout=20).start()
    try:
        job = tw.submit(_fail_then_recv)
        assert job.wait(30)
        first = job.outcomes()
        assert [o.status for o in first] == ["ok", "error"] and first[0].value == "RankStopped", first
        job = tw.submit(_send_recv)
        assert job.wait(30)
        second = job.outcomes()
        assert [o.status for o in second] == ["ok", "ok"], second
        assert [o.value for o in second] == [[7.0], [7.0]]
    finally:
        tw.stop()
