"""GpuBroker calls made again, or at once, or after an outage: a submit of a key that has a job (a
retry, a cleared task's new try, a drained pool), a transaction redone after a connection lost at
COMMIT (its effects counted once, its time the first try's), a pool created by two hosts at once, a
rebalance that meets a job's end being reported, and the leases after the database was away."""

import threading

import pytest
from test_broker import spec

from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.types import InvalidRequest, NotFound


def test_a_submit_redone_after_its_commit_went_through_still_returns_the_token(pool, monkeypatch):
    """A lost connection during COMMIT is retried, but the commit may have gone through: the redo
    finds its own job (the same token) and replies with the token, as the first try would have;
    a different caller with the same key gets the job without it."""
    from airflow_elastic_gpu.broker import lifecycle

    monkeypatch.setattr(lifecycle.secrets, "token_urlsafe", lambda n: "the-same-token")
    first = pool.submit(spec("redo"))
    redone = pool.submit(spec("redo"))  # what _retrying's second run of the same call sees
    assert redone.id == first.id and redone.token == "the-same-token"
    monkeypatch.setattr(lifecycle.secrets, "token_urlsafe", lambda n: "another-caller")
    other = pool.submit(spec("redo"))
    assert other.id == first.id and other.token is None
    assert pool.verify_token(first.id, "the-same-token")


def test_a_running_jobs_key_is_reattached_while_its_pool_is_drained(pool):
    """A task's retry (or a cleared task's new try) submits its key while the pool's only node is
    drained: it gets its running job back. The pool's size was checked first, the reattach refused,
    and the job ran on with nobody to follow or end it."""
    job = pool.submit(spec("k", min_gpus=2, attempt="try-1"))
    pool.set_node_schedulable("n0", False)
    again = pool.submit(spec("k", min_gpus=2, attempt="try-2"))
    assert again.id == job.id and not again.status.terminal
    pool.cancel(job.id)
    with pytest.raises(InvalidRequest, match="min_gpus=2 is more than GPU pool 'default' has"):
        pool.submit(spec("k", min_gpus=2, attempt="try-3"))  # a new job: the pool's size counts


def test_a_key_of_the_longest_length_is_submitted_again_after_its_job_ended(pool):
    """The ended job's key is kept unique by its id, cut to fit the column: a key of 512 characters
    could not be submitted again on PostgreSQL (``key@id`` overflowed ``VARCHAR(512)``)."""
    key = "k" * 512
    first = pool.submit(spec(key, name="long"))
    pool.fail(first.id, "boom")
    second = pool.submit(spec(key, name="long"))
    assert second.id != first.id and pool.job(second.id).key == key
    assert pool.job(first.id).key == f"{key[:512 - 37]}@{first.id}"


def test_a_progress_report_redone_after_its_commit_went_through_is_counted_once(pool, clock, monkeypatch):
    """The connection is lost at COMMIT, after the commit went through, and the broker redoes the
    transaction 10 s later: the sample keeps the report's time and is not stored twice. The redo
    stamped a second sample at the reconnection, and the next throughput sample read 60 steps/s
    for 10."""
    job = pool.submit(spec("a", min_gpus=4, max_gpus=4))
    pool.ack(job.id, 1)
    pool.progress(job.id, 0)
    clock.advance(10)
    retrying = pool._retrying

    def redone(fn, attempts=8):
        fn()  # the first try: committed, then its reply lost
        clock.advance(10)
        return retrying(fn, attempts)

    monkeypatch.setattr(pool, "_retrying", redone)
    pool.progress(job.id, 100)
    monkeypatch.setattr(pool, "_retrying", retrying)
    clock.advance(2)
    pool.progress(job.id, 220)
    samples = pool.samples(job.id)
    assert [(round(t - samples[0][0], 6), step) for t, step, _gpus, _gen in samples] == [(0, 0), (10, 100), (22, 220)]
    assert pool.job(job.id).throughput == ((4, pytest.approx(10.0)),)


def test_a_step_reported_again_later_is_not_a_sample(pool, clock):
    """An agent sends a report again when the reply to it was lost (the broker had committed it),
    and a progress pattern may match two lines of one step (a training line and "saved checkpoint
    at step N"): stored at its later time, the step made the next sample read 38 steps/s for 10."""
    job = pool.submit(spec("a", min_gpus=4, max_gpus=4))
    pool.ack(job.id, 1)
    pool.progress(job.id, 100)
    clock.advance(8)
    pool.progress(job.id, 100)  # the same step again, 8 s later
    clock.advance(2)
    pool.progress(job.id, 200)
    clock.advance(10)
    pool.progress(job.id, 300)
    assert [step for _t, step, _gpus, _gen in pool.samples(job.id)] == [100, 200, 300]
    assert pool.job(job.id).throughput == ((4, pytest.approx(10.0)),)



def test_progress_of_a_generation_replaced_before_its_ack_is_no_throughput_sample(pool, clock):
    """A runs on 4 GPUs; a priority job shrinks it to 2 (generation 2, run but not acked) and is
    cancelled before it ran, so A grows back (generation 3). Generation 2's last log lines, sent
    in the poll that saw generation 3, ran on 2 GPUs: they were counted on the in-use set's 4, and
    the model learnt that 4 GPUs give no speed-up over 2."""
    a = pool.submit(spec("a", min_gpus=1, max_gpus=4))
    pool.ack(a.id, 1)
    clock.advance(10)
    c = pool.submit(spec("c", min_gpus=2, max_gpus=2, priority=10))
    assert (pool.target(a.id).generation, len(pool.target(a.id).gpus)) == (2, 2)
    clock.advance(1)
    pool.progress(a.id, 100, generation=2)
    clock.advance(1)
    pool.progress(a.id, 200, generation=2)
    assert pool.job(a.id).throughput == ((2, pytest.approx(100.0)),)
    pool.cancel(c.id)
    pool.fail(c.id, "its trainer never started")
    pool.rebalance()
    job = pool.job(a.id)
    assert (job.target_generation, len(job.target_gpus), job.acked_generation, len(job.in_use_gpus)) == (3, 4, 1, 4)
    clock.advance(1)
    pool.progress(a.id, 300, generation=2)  # generation 2's last lines, on 2 GPUs
    assert pool.job(a.id).throughput == ((2, pytest.approx(100.0)),)  # no 4-GPU sample of 100 steps/s
    assert pool.job(a.id).steps_done == 300
    assert pool.samples(a.id)[-1][2:] == (0, 2)  # stored without a GPU count


def test_an_ended_jobs_gpu_time_stops_at_its_end_while_it_holds_its_gpus(pool, clock):
    """A cancelled job holds its GPUs until its trainer has stopped; the GPU time it reports (the
    operator's XCom) stops at its end, as the count made at its release does. It grew by 4 GPU-s
    a second until the release, then fell back."""
    job = pool.submit(spec("a", min_gpus=4, max_gpus=4))
    pool.ack(job.id, 1)
    clock.advance(10)
    assert pool.cancel(job.id, "a user's").gpu_seconds == pytest.approx(40.0)
    clock.advance(50)
    held = pool.job(job.id)
    assert len(held.in_use_gpus) == 4 and held.gpu_seconds == pytest.approx(40.0)
    pool.fail(job.id, "its trainer stopped")
    assert pool.job(job.id).gpu_seconds == pytest.approx(40.0)

@pytest.mark.postgres
def test_a_pool_created_by_two_processes_at_once_is_created_once_and_both_calls_succeed(postgres_url, clock):
    """Two hosts register their nodes in a pool that does not exist yet, at the same moment: the
    second insert of the pool waits for the first and then does nothing, and its call goes on. It
    failed with a duplicate key (``IntegrityError``, which is not retried)."""
    from sqlalchemy import text

    from airflow_elastic_gpu.broker.service import GpuBroker

    first, second = GpuBroker(postgres_url, clock=clock), GpuBroker(postgres_url, clock=clock)
    try:
        done: list[object] = []
        with first.engine.connect() as conn:  # the other host's transaction, between its insert and its commit
            tx = conn.begin()
            conn.execute(text("INSERT INTO gpu_pool (name, created_s, last_rebalance_s, policy, lease_s, "
                              "rebalance_interval_s, served_request_id) VALUES ('p', 0, 0, 'adaptive', 60, 10, 0)"))
            thread = threading.Thread(target=lambda: done.append(_outcome(lambda: second.register_node(
                "n1", 2, pool="p"))), daemon=True)
            thread.start()
            thread.join(1.0)
            assert thread.is_alive()  # waits on the uncommitted insert
            tx.commit()
        thread.join(30)
        assert done == ["ok"], done
        assert [n.name for n in second.nodes(pool="p")] == ["n1"]
    finally:
        first.engine.dispose()
        second.engine.dispose()


def _outcome(call) -> object:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return exc
    return "ok"


def test_a_gang_that_began_to_finish_while_the_pool_was_decided_is_published_nothing(pool, monkeypatch):
    """A node of a gang reports its trainer's clean exit between the rebalance's read of the jobs
    and its lock of their rows: the decision, made for a gang that could still be resized, is not
    published (its agents would never apply it, and the GPUs it took would sit idle until the job
    ended and its lease ran out); the pool is decided again."""
    from types import SimpleNamespace

    gang = pool.submit(spec("gang", min_gpus=2, max_gpus=4, backend="simulated"))
    pool.ack(gang.id, 1)
    before = pool.job(gang.id)
    assert len(before.target_gpus) == 4
    locked_active = type(pool)._locked_active

    def a_node_finished_meanwhile(self, s, job_ids):
        rows = locked_active(self, s, job_ids)
        return {i: SimpleNamespace(**{**r._mapping, "finished_nodes": ["n0"]}) if i == gang.id else r
                for i, r in rows.items()}

    monkeypatch.setattr(type(pool), "_locked_active", a_node_finished_meanwhile)
    newcomer = pool.submit(spec("newcomer", min_gpus=2, max_gpus=2, backend="simulated"))
    pool.rebalance()
    assert pool.job(gang.id).target_generation == before.target_generation
    assert pool.job(newcomer.id).target_gpus == ()
    monkeypatch.undo()
    pool.rebalance()  # decided again: the gang is shrunk for the newcomer
    after = pool.job(gang.id)
    assert after.target_generation == before.target_generation + 1 and len(after.target_gpus) == 2


@pytest.mark.postgres
def test_an_ended_jobs_gpus_are_released_once_when_its_stop_is_reported_during_a_rebalance(postgres_url, clock):
    """A cancelled job silent for a lease has its GPUs released by a rebalance, while its agent's
    report of the stopped trainer (which releases them too) holds the job's row: the rebalance
    leaves the job to the report. Both released the GPUs, and the history had two releases."""
    from sqlalchemy import text

    from airflow_elastic_gpu.broker.service import GpuBroker

    broker = GpuBroker(postgres_url, clock=clock)
    try:
        broker.register_node("n0", 4)
        broker.configure_pool(lease_s=30)
        job = broker.submit(spec("a", min_gpus=4))
        broker.ack(job.id, 1)
        broker.cancel(job.id)
        clock.advance(31)
        with broker.engine.connect() as conn:  # the report under way holds the job's row
            tx = conn.begin()
            conn.execute(text("SELECT id FROM job WHERE id = :id FOR UPDATE"), {"id": job.id})
            thread = threading.Thread(target=broker.rebalance, daemon=True)
            thread.start()
            thread.join(30)
            assert not thread.is_alive()
            assert [e.kind for e in broker.events(job_id=job.id)].count("release") == 0
            tx.rollback()
        broker.rebalance()
        assert [e.kind for e in broker.events(job_id=job.id)].count("release") == 1
        assert broker.job(job.id).in_use_gpus == ()
    finally:
        broker.engine.dispose()


def test_after_an_outage_longer_than_the_lease_every_job_has_a_lease_to_be_heard_again(pool, clock):
    """The broker's database was away for 100 s (a lease is 30 s): no agent could be heard, and
    the first rebalance after it recorded every job but the caller's as LOST. Now each job has a
    whole lease from then: one whose agent reports again runs on, one that stays silent is LOST a
    lease later."""
    pool.configure_pool(lease_s=30)
    heard = pool.submit(spec("heard", min_gpus=2, max_gpus=2))
    silent = pool.submit(spec("silent", min_gpus=2, max_gpus=2))
    for job in (heard, silent):
        pool.ack(job.id, 1)
        pool.heartbeat(job.id)
    clock.advance(100)  # the outage: no call reaches the database
    pool.rebalance()  # the first call after it
    assert pool.job(heard.id).status is JobStatus.RUNNING and pool.job(silent.id).status is JobStatus.RUNNING
    (outage,) = [e for e in pool.events() if e.kind == "outage"]
    assert "no rebalance for 100s (lease 30s, rebalance interval 10s)" in outage.message
    clock.advance(20)
    pool.heartbeat(heard.id)
    pool.rebalance()
    assert pool.job(silent.id).status is JobStatus.RUNNING  # 20 s into its new lease
    clock.advance(11)
    pool.rebalance()
    assert pool.job(heard.id).status is JobStatus.RUNNING
    assert pool.job(silent.id).status is JobStatus.LOST
    assert [e.kind for e in pool.events()].count("outage") == 1


def test_an_outage_is_seen_when_the_pools_rebalance_interval_is_long(pool, clock):
    """A lease of 60 s and a rebalance every 40 s: a database away for 75 s is an outage too (two
    rebalance intervals, 80 s, had to pass)."""
    pool.configure_pool(lease_s=60, rebalance_interval_s=40)
    job = pool.submit(spec("a", min_gpus=2, max_gpus=2))
    pool.ack(job.id, 1)
    pool.heartbeat(job.id)
    pool.rebalance()
    clock.advance(75)
    pool.rebalance()
    assert pool.job(job.id).status is JobStatus.RUNNING
    assert [e.kind for e in pool.events()].count("outage") == 1


def test_a_node_removal_redone_after_its_commit_went_through_succeeds(pool, monkeypatch):
    """The connection is lost at COMMIT after the node was removed: the redo finds no node, and the
    call succeeds (it raised NotFound for a removal that had happened). An unknown node is still
    named."""
    pool.register_node("n1", 2)
    retrying = pool._retrying

    def redone(fn, attempts=8):
        fn()  # committed, then its reply lost
        return retrying(fn, attempts)

    monkeypatch.setattr(pool, "_retrying", redone)
    pool.remove_node("n1")
    assert [n.name for n in pool.nodes()] == ["n0"]
    monkeypatch.setattr(pool, "_retrying", retrying)
    with pytest.raises(NotFound, match="unknown node 'n1'"):
        pool.remove_node("n1")


def test_a_retried_tasks_start_does_not_put_off_the_release_of_an_ended_jobs_gpus(pool, clock):
    """A cancelled job holds its GPUs until its agent reports the trainer stopped, or a lease after
    its last heartbeat; a task's retry that starts it again (reattaching) is no heartbeat of its
    agent. It was taken for one, and the GPUs stayed held a lease longer."""
    pool.configure_pool(lease_s=30)
    job = pool.submit(spec("a", min_gpus=4))
    pool.ack(job.id, 1)
    pool.heartbeat(job.id)
    pool.cancel(job.id)
    clock.advance(20)
    pool.start(job.id, "local:again")
    clock.advance(11)
    pool.rebalance()
    assert pool.job(job.id).in_use_gpus == ()


def test_a_drain_or_a_pool_setting_made_again_records_one_event(pool):
    """A drain, or a pool setting, redone after its commit went through (or simply given twice)
    changes nothing the second time and records no second event: the pool's log said each twice."""
    from airflow_elastic_gpu.states import EventKind

    def kinds():
        return [e.kind for e in pool.events() if e.kind in (EventKind.NODE, EventKind.CONFIG)]

    before = kinds()
    pool.set_node_schedulable("n0", False)
    pool.set_node_schedulable("n0", False)
    pool.configure_pool(lease_s=90, policy_params={"hysteresis": 0.1})
    pool.configure_pool(lease_s=90, policy_params={"hysteresis": 0.1})
    assert kinds()[len(before):] == [EventKind.NODE, EventKind.CONFIG]
    pool.set_node_schedulable("n0", True)
    assert kinds()[len(before):] == [EventKind.NODE, EventKind.CONFIG, EventKind.NODE]


def test_a_retry_of_a_task_whose_job_succeeded_gets_that_job_and_a_cleared_task_trains_again(pool):
    """The try failed after its job succeeded (its worker lost while it returned the result): the
    retry, whose max_tries Airflow leaves as it was, gets the success back rather than training
    again for hours. A cleared task (Airflow raised max_tries) and a retry after a failed job
    train again; without max_tries (the triggerer's task instance has none) every retry does."""
    job = pool.submit(spec("k", attempt="try-1", max_tries=2))
    pool.finish(job.id, 0, {"final": True, "accuracy": 0.9})
    retried = pool.submit(spec("k", attempt="try-2", max_tries=2))
    assert retried.id == job.id and retried.status is JobStatus.SUCCEEDED and retried.token is None
    assert pool.job(job.id).metrics["accuracy"] == 0.9
    cleared = pool.submit(spec("k", attempt="try-3", max_tries=4))
    assert cleared.id != job.id and not cleared.status.terminal
    pool.fail(cleared.id, "boom")
    again = pool.submit(spec("k", attempt="try-4", max_tries=4))
    assert again.id not in (job.id, cleared.id)  # a failed job's retry trains again
    pool.finish(again.id, 0)
    assert pool.submit(spec("k", attempt="try-5")).id not in (job.id, cleared.id, again.id)
    with pytest.raises(InvalidRequest, match="max_tries must be an integer >= 0"):
        spec("k", max_tries=-1)


def test_a_clear_that_left_max_tries_as_it_was_trains_again(pool):
    """Airflow's clear leaves ``max_tries`` as it was when the task's ``retries`` were lowered
    before it, or when the task still ran (the seconds between its job's success and its end):
    such a clear got the old success back. The DAG run's ``clear_number`` tells it from a retry;
    a job recorded without one (before the broker knew it) goes by ``max_tries`` alone."""
    job = pool.submit(spec("k", attempt="try-1", max_tries=2, clear_number=0))
    pool.finish(job.id, 0)
    assert pool.submit(spec("k", attempt="try-2", max_tries=2, clear_number=0)).id == job.id  # a retry
    cleared = pool.submit(spec("k", attempt="try-3", max_tries=2, clear_number=1))
    assert cleared.id != job.id and not cleared.status.terminal
    pool.finish(cleared.id, 0)
    old = pool.submit(spec("old", attempt="try-1", max_tries=2))  # recorded without a clear_number
    pool.finish(old.id, 0)
    assert pool.submit(spec("old", attempt="try-2", max_tries=2, clear_number=3)).id == old.id
    with pytest.raises(InvalidRequest, match="clear_number must be an integer >= 0"):
        spec("k", clear_number=-1)


def test_a_retry_of_a_try_that_reattached_after_a_clear_gets_the_success_back(pool):
    """A task cleared while its job ran: the new try reattached (with the run's new clear_number);
    the job succeeded, that try's worker was lost, and its retry trained again, because the job
    still recorded the first try's clear_number."""
    job = pool.submit(spec("k", attempt="try-1", max_tries=2, clear_number=0))
    assert pool.submit(spec("k", attempt="try-2", max_tries=2, clear_number=1)).id == job.id  # reattached
    pool.finish(job.id, 0)
    assert pool.submit(spec("k", attempt="try-3", max_tries=2, clear_number=1)).id == job.id  # its retry


def test_a_failing_policy_still_ends_silent_jobs_and_frees_an_ended_jobs_gpus(pool, clock, caplog):
    """The rebalance reaps jobs whose agent went silent and frees the GPUs of ended jobs before the
    policy decides: a policy that raises keeps both. They were rolled back with its decision, so
    while it failed no lease ended and no cancelled job's GPUs came back."""

    class BrokenPolicy:
        preemptive = False

        def decide(self, state):
            raise RuntimeError("policy bug")

    pool.configure_pool(lease_s=30)
    silent = pool.submit(spec("silent", min_gpus=2, max_gpus=2))
    pool.ack(silent.id, 1)
    cancelled = pool.submit(spec("cancelled", min_gpus=2, max_gpus=2))
    pool.ack(cancelled.id, 1)
    pool.cancel(cancelled.id)
    live = pool.submit(spec("live", min_gpus=1, max_gpus=4))  # waits: the policy decides nothing
    pool.policy_override = BrokenPolicy()
    for _ in range(4):  # 40 s, past the lease, with a rebalance every 10 s (no outage of the broker)
        clock.advance(10)
        assert pool.rebalance() == {}
    assert pool.failed_rebalances >= 1 and "policy bug" in caplog.text
    assert pool.job(silent.id).status is JobStatus.LOST and pool.job(silent.id).in_use_gpus == ()
    assert pool.job(cancelled.id).in_use_gpus == () and pool.job(cancelled.id).target_gpus == ()
    from airflow_elastic_gpu.broker.rows import read_pool

    with pool.engine.connect() as conn:
        assert read_pool(conn, "default").pending > 0  # the requests it served are asked for again
    pool.policy_override = None
    assert pool.rebalance()[live.id]
