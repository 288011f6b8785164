"""What the broker's views show of a pool and its jobs, on SQLite and PostgreSQL: who holds which GPU,
which ended jobs a snapshot lists, and figures that count on with time."""

import pytest
from test_broker import spec


def test_a_running_jobs_gpu_seconds_count_up_to_now_not_to_its_last_resize(pool, clock):
    """The page, ``status`` and the operator showed a running job's GPU-seconds as of its last ack:
    frozen (0 until its first resize) however long it had trained since."""
    a = pool.submit(spec("a", total_steps=100_000))
    pool.ack(a.id, 1)
    held = len(pool.job(a.id).in_use_gpus)
    before = pool.job(a.id).gpu_seconds
    clock.advance(100)
    assert pool.job(a.id).gpu_seconds == pytest.approx(before + 100 * held)
    assert [j.gpu_seconds for j in pool.snapshot().jobs] == [pytest.approx(before + 100 * held)]
    done = pool.finish(a.id, 0)
    clock.advance(50)
    assert pool.job(a.id).gpu_seconds == pytest.approx(done.gpu_seconds) == pytest.approx(before + 100 * held)


def test_snapshot_shows_who_holds_which_gpu(pool):
    a = pool.submit(spec("a", max_gpus=2))
    pool.ack(a.id, 1)
    snap = pool.snapshot()
    held = {str(g.gpu): g.in_use_by for n in snap.nodes for g in n.gpus}
    assert list(held.values()).count(a.id) == 2
    assert [j.id for j in snap.jobs] == [a.id] and snap.events


def test_snapshot_lists_the_active_jobs_and_only_the_latest_ended_ones(pool, clock):
    """A pool's history grows with every scheduled run; the page and ``status`` poll the snapshot."""
    ended = []
    for i in range(5):
        job = pool.submit(spec(f"old-{i}"))
        clock.advance(1)
        pool.finish(job.id)
        ended.append(job.id)
    waiting = []
    for i in range(3):  # two run, one is queued
        waiting.append(pool.submit(spec(f"now-{i}", min_gpus=2, max_gpus=2)))
        clock.advance(1)
    snap = pool.snapshot(ended=2)
    assert [j.id for j in snap.jobs] == [*ended[-2:], *(j.id for j in waiting)]
    assert snap.ended_hidden == 3
    assert pool.snapshot(ended=0).ended_hidden == 5 and len(pool.snapshot().jobs) == 8


def test_snapshot_lists_an_older_ended_job_that_still_holds_gpus(pool, clock):
    """A cancelled job's GPUs stay held until its trainer has stopped: the page labels them with
    its name however many jobs ended after it."""
    stopping = pool.submit(spec("stopping", max_gpus=2))
    pool.ack(stopping.id, 1)
    pool.cancel(stopping.id)
    for i in range(3):
        clock.advance(1)
        pool.finish(pool.submit(spec(f"later-{i}", max_gpus=1)).id)
    snap = pool.snapshot(ended=1)
    held = {g.in_use_by for n in snap.nodes for g in n.gpus} - {None}
    assert held == {stopping.id} and stopping.id in [j.id for j in snap.jobs]
    assert snap.ended_hidden == 2 and len(snap.jobs) == 2


@pytest.mark.postgres
def test_a_job_that_ends_while_a_snapshot_is_read_is_not_counted_as_hidden(postgres_url, clock):
    """The snapshot reads the active jobs, then the last ended ones, then counts the ended ones; on
    PostgreSQL each statement saw its own moment (READ COMMITTED), so a job that ended in between
    was listed as running *and* counted among the ended ones left out: "and 1 older ended jobs"
    where there were none. The snapshot is now one moment there too (on SQLite a read is one
    transaction, and a writer waits for it)."""
    from sqlalchemy import event

    from airflow_elastic_gpu.broker.service import GpuBroker

    pool, other = GpuBroker(postgres_url, clock=clock), GpuBroker(postgres_url, clock=clock)
    pool.register_node("n0", 4)
    job = pool.submit(spec("ending"))
    pool.ack(job.id, 1)
    ended = []

    def end_it_before_the_count(conn, cursor, statement, *args):
        # the snapshot's count of the pool's ended jobs (not a statement of the finish's own)
        if "count(*)" in statement.lower() and "from job" in statement.lower() and not ended:
            ended.append(None)
            ended[0] = other.finish(job.id, 0)

    event.listen(pool.engine, "before_cursor_execute", end_it_before_the_count)
    try:
        snap = pool.snapshot()
    finally:
        event.remove(pool.engine, "before_cursor_execute", end_it_before_the_count)
        other.engine.dispose()
        pool.engine.dispose()
    assert ended, "the job was not ended during the read"
    assert [(j.id, j.status.value) for j in snap.jobs] == [(job.id, "running")]
    assert snap.ended_hidden == 0
    later = pool.snapshot()
    assert [(j.id, j.status.value) for j in later.jobs] == [(job.id, "succeeded")] and later.ended_hidden == 0
    pool.engine.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize("read", ["job", "jobs"])
def test_a_job_that_ends_while_its_view_is_read_shows_its_row_and_gpus_of_one_moment(postgres_url, clock, read):
    """A job's view reads its row, then its GPUs. On PostgreSQL the two statements ran in
    autocommit, each at its own moment: a job that ended in between was shown running on no GPUs
    (the operator and the page saw a running job that held nothing)."""
    from sqlalchemy import event

    from airflow_elastic_gpu.broker.service import GpuBroker

    pool, other = GpuBroker(postgres_url, clock=clock), GpuBroker(postgres_url, clock=clock)
    pool.register_node("n0", 4)
    job = pool.submit(spec("ending", max_gpus=2))
    pool.ack(job.id, 1)
    if read == "jobs":  # two jobs: the GPUs of several are read by one query per table
        pool.ack(pool.submit(spec("staying", max_gpus=2)).id, 1)
    held = pool.job(job.id).in_use_gpus
    ended = []

    def end_it_before_the_gpus_are_read(conn, cursor, statement, *args):
        if "gpu_target" in statement.lower() and not ended:  # (the two clients share one engine)
            ended.append(None)
            ended[0] = other.finish(job.id, 0)

    event.listen(pool.engine, "before_cursor_execute", end_it_before_the_gpus_are_read)
    try:
        view = pool.job(job.id) if read == "job" else next(j for j in pool.jobs() if j.id == job.id)
    finally:
        event.remove(pool.engine, "before_cursor_execute", end_it_before_the_gpus_are_read)
        other.engine.dispose()
    assert ended, "the job was not ended during the read"
    assert (view.status.value, view.in_use_gpus, len(view.target_gpus)) == ("running", held, 2)
    after = pool.job(job.id)
    assert (after.status.value, after.in_use_gpus) == ("succeeded", ())
    pool.engine.dispose()
