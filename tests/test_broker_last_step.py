"""A job that has reported its last step evaluates or saves: the broker does not resize it (on
SQLite and PostgreSQL), except off GPUs that may no longer be handed out."""

from __future__ import annotations

import pytest
from test_broker import spec


@pytest.mark.parametrize(("last", "total", "resized"), [
    (100, 100, False), (99, 100, False),  # its last step, counted from 1 or from 0
    (150, 100, True),  # past total_steps: given too few, it trains on and is resized as any
    (50, 100, True),
    (0, 1, True),  # a job of one step: it was fixed from its start
])
def test_a_job_that_reported_its_last_step_is_not_resized(pool, clock, last, total, resized):
    """It evaluates or saves now: a shrink for a newcomer stopped it there to restart for nothing,
    and a gang whose other node had ended meanwhile waited for that node for ever (it failed at the
    rendezvous time-out though its training was done)."""
    a = pool.submit(spec("a", min_gpus=2, max_gpus=4, total_steps=total))
    pool.ack(a.id, 1)
    clock.advance(10)
    pool.progress(a.id, last, generation=1)
    b = pool.submit(spec("b", min_gpus=2, max_gpus=2, total_steps=100))
    assert (pool.job(a.id).target_generation == 2) is resized
    if not resized:
        assert pool.job(b.id).target_gpus == ()
        pool.finish(a.id, 0, {"accuracy": 0.9})
        assert len(pool.job(b.id).target_gpus) == 2  # at its end the GPUs go to the newcomer


def test_a_job_at_its_last_step_still_leaves_a_drained_node(pool, clock):
    pool.register_node("n1", 4)
    a = pool.submit(spec("a", min_gpus=2, max_gpus=4, total_steps=100))
    pool.ack(a.id, 1)
    (node,) = {g.node for g in pool.job(a.id).target_gpus}
    clock.advance(10)
    pool.progress(a.id, 99, generation=1)
    pool.set_node_schedulable(node, False)  # a drain: its GPUs may no longer be handed out
    moved = pool.job(a.id)
    assert moved.target_generation == 2 and {g.node for g in moved.target_gpus} == {"n0", "n1"} - {node}
