"""GpuBroker on SQLite and PostgreSQL: job life, the two-phase resize protocol, leases, bad input."""

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from conftest import RESIZE_AT_ONCE
from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError

from airflow_elastic_gpu.broker.models import Base, Gpu, GpuInUse, JobStatus
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import InvalidRequest, JobSpec, NotFound


def spec(key, **kw):
    kw.setdefault("min_gpus", 1)
    kw.setdefault("max_gpus", 4)
    kw.setdefault("total_steps", 1000)
    kw.setdefault("name", key)
    return JobSpec(command="python train.py", key=key, **kw)


def test_schema_from_migrations_matches_the_models(broker):
    with broker.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


def test_submit_is_idempotent_on_its_key(pool):
    a1 = pool.submit(spec("dag.task.run1.-1"))
    a2 = pool.submit(spec("dag.task.run1.-1"))
    assert a1.id == a2.id
    assert len(pool.jobs()) == 1


def test_resubmitting_an_ended_key_starts_a_new_job_and_keeps_the_old_record(pool):
    a = pool.submit(spec("k"))
    pool.fail(a.id, "boom")
    b = pool.submit(spec("k"))
    assert b.id != a.id and b.status is JobStatus.RUNNING
    assert pool.job(a.id).key == f"k@{a.id}" and pool.job(a.id).status is JobStatus.FAILED


def test_an_ended_job_is_answered_to_the_attempt_that_submitted_it_and_replaced_for_any_other(pool):
    """``JobSpec.attempt``: the same task try submitting its key again after the job ended gets that
    job back (not trained twice); another try, or none named, starts a new job (a retry)."""
    first = pool.submit(spec("k", attempt="try-1"))
    pool.finish(first.id, 0, {"accuracy": 0.9})
    again = pool.submit(spec("k", attempt="try-1"))
    assert (again.id, again.status, again.metrics) == (first.id, JobStatus.SUCCEEDED, {"accuracy": 0.9})
    retry = pool.submit(spec("k", attempt="try-2"))
    assert retry.id != first.id and pool.job(first.id).key == f"k@{first.id}"
    pool.cancel(retry.id)
    assert pool.submit(spec("k")).id not in (first.id, retry.id)
    with pytest.raises(InvalidRequest, match="attempt must be at most 64 characters"):
        spec("k", attempt="x" * 65)


def test_first_job_is_published_all_free_gpus_and_ack_moves_them_in_use(pool):
    a = pool.submit(spec("a"))
    assert a.status is JobStatus.RUNNING and a.target_generation == 1
    assert len(a.target_gpus) == 4 and a.in_use_gpus == ()
    assert pool.ack(a.id, 1) is True
    a = pool.job(a.id)
    assert a.in_use_gpus == a.target_gpus and a.acked_generation == 1 and a.start_s is not None


def test_growth_waits_until_the_shrinking_job_acks(pool, clock):
    a = pool.submit(spec("a", total_steps=100_000))
    pool.ack(a.id, 1)
    clock.advance(10)
    b = pool.submit(spec("b", total_steps=100))
    a = pool.job(a.id)
    assert a.target_generation == 2 and len(a.target_gpus) < 4
    assert len(a.in_use_gpus) == 4, "a still runs on its old GPUs until it acks"
    b = pool.job(b.id)
    assert b.target_gpus == (), "b is published nothing while its GPUs are in a's in-use set"
    pool.ack(a.id, 2)
    b = pool.job(b.id)
    assert b.target_generation == 1 and len(b.target_gpus) >= 1
    assert not set(b.target_gpus) & set(pool.job(a.id).in_use_gpus)


def test_a_gpu_of_an_unacked_generation_goes_to_nobody_else_until_the_job_acks(broker, clock):
    """A job's agent starts its trainer on a new generation before it acks it: a later decision that
    shrinks the job must not hand the GPUs it drops to another job before that ack (both trainers
    would run on them). The shrink waits for the ack; the GPUs move once the job runs without them."""
    broker.register_node("n0", 4)
    broker.configure_pool(policy_params=RESIZE_AT_ONCE)
    a = broker.submit(spec("a", min_gpus=1, max_gpus=4, total_steps=100_000))
    broker.rebalance()
    assert len(broker.job(a.id).target_gpus) == 4  # generation 1, not acked yet: its trainer may be starting
    clock.advance(5)
    b = broker.submit(spec("b", min_gpus=2, max_gpus=2, total_steps=100, priority=10))
    broker.rebalance()
    assert broker.job(b.id).target_gpus == () and len(broker.job(a.id).target_gpus) == 4
    assert broker.ack(a.id, 1)  # A runs on all four
    broker.rebalance()  # A's shrink is published now; B waits for A's ack of it
    shrunk = broker.job(a.id)
    assert len(shrunk.target_gpus) == 2 and broker.job(b.id).target_gpus == ()
    assert broker.ack(a.id, shrunk.target_generation)
    broker.rebalance()
    given = set(broker.job(b.id).target_gpus)
    assert len(given) == 2 and not given & set(broker.job(a.id).in_use_gpus)


def test_stale_ack_changes_nothing(pool):
    a = pool.submit(spec("a"))
    assert pool.ack(a.id, 7) is False
    assert pool.ack(a.id, 1) is True
    assert pool.ack(a.id, 1) is False
    assert pool.job(a.id).acked_generation == 1


def test_finish_releases_gpus_records_metrics_and_lets_others_grow(pool, clock):
    a = pool.submit(spec("a", total_steps=100_000))
    pool.ack(a.id, 1)
    b = pool.submit(spec("b", total_steps=500_000))
    pool.ack(a.id, 2)
    pool.ack(b.id, 1)
    b_gpus = len(pool.job(b.id).in_use_gpus)
    clock.advance(60)
    pool.heartbeat(b.id)  # b's agent reports (one silent for half the lease would not grow)
    done = pool.finish(a.id, 0, {"accuracy": 0.97})
    assert done.status is JobStatus.SUCCEEDED and done.metrics == {"accuracy": 0.97}
    assert done.in_use_gpus == () and done.target_gpus == () and done.jct_s == pytest.approx(60)
    assert done.gpu_seconds > 0
    assert len(pool.job(b.id).target_gpus) > b_gpus, "b grows into the freed GPUs"


def test_resize_events_carry_their_reason(pool, clock):
    a = pool.submit(spec("a", total_steps=100_000))
    pool.ack(a.id, 1)
    pool.submit(spec("b", total_steps=100))
    resize = [e for e in pool.events(job_id=a.id) if e.kind == "resize"]
    assert resize and "shrink 4->" in resize[0].message
    assert resize[0].data["from_gpus"] == 4 and "restart_overhead_s" in resize[0].data


def test_progress_builds_a_throughput_model_and_measures_restart_overhead(pool, clock):
    a = pool.submit(spec("a", total_steps=100_000))
    pool.ack(a.id, 1)
    for step in (0, 100, 200):
        pool.progress(a.id, step, generation=1)
        clock.advance(10)
    assert pool.job(a.id).throughput == ((4, pytest.approx(10.0)),)
    pool.submit(spec("b", total_steps=100))
    clock.advance(7)
    pool.ack(a.id, 2)
    pool.progress(a.id, 150, generation=2)
    assert pool.job(a.id).restart_overhead_s == pytest.approx(7.0)
    assert pool.job(a.id).steps_done == 150


def test_silent_job_is_marked_lost_and_its_gpus_reclaimed(pool, clock):
    pool.configure_pool(lease_s=30)
    a = pool.submit(spec("a"))
    pool.ack(a.id, 1)
    clock.advance(20)
    pool.rebalance()  # a call within the lease (else the silence of every caller reads as an outage)
    clock.advance(11)
    b = pool.submit(spec("b"))
    a = pool.job(a.id)
    assert a.status is JobStatus.LOST and "no heartbeat" in a.reason
    assert a.in_use_gpus == ()
    assert len(pool.job(b.id).target_gpus) == 4


def test_a_job_whose_agent_is_silent_gets_no_growth_and_is_declared_lost_a_lease_after_its_last_word(pool, clock):
    """A growth is a publication, from which an agent has a whole lease to report: given to a job
    whose agent is gone each time GPUs came free, it kept the job (and its GPUs) from being
    declared lost. After half a lease of silence (its trainer fenced) its target is left alone."""
    pool.configure_pool(lease_s=60)
    b = pool.submit(spec("b", min_gpus=2, max_gpus=2))
    a = pool.submit(spec("a", min_gpus=1, max_gpus=4))
    for job in (a, b):
        pool.ack(job.id, 1)
    assert len(pool.job(a.id).in_use_gpus) == 2
    clock.advance(40)  # a's agent went silent 40 s ago; b's reports
    pool.heartbeat(b.id)
    pool.finish(b.id)  # its GPUs come free: a would grow onto them
    assert pool.job(a.id).target_generation == 1 and len(pool.job(a.id).target_gpus) == 2
    clock.advance(21)
    pool.rebalance()
    lost = pool.job(a.id)
    assert lost.status is JobStatus.LOST and lost.in_use_gpus == () and lost.target_gpus == ()


def test_a_job_placed_after_a_long_wait_grows_before_its_agent_first_reports(pool, clock):
    """Silence counts from the job's start: one that queued for longer than half the lease and
    was just placed (its pod, its agent still starting) is not taken for a job whose agent is gone."""
    pool.configure_pool(lease_s=60)
    b = pool.submit(spec("b", min_gpus=2, max_gpus=2))
    c = pool.submit(spec("c", min_gpus=2, max_gpus=2))
    a = pool.submit(spec("a", min_gpus=1, max_gpus=4))
    for job in (b, c):
        pool.ack(job.id, 1)
    assert pool.job(a.id).status is JobStatus.QUEUED
    clock.advance(40)
    pool.heartbeat(b.id)
    pool.finish(c.id)
    assert len(pool.job(a.id).target_gpus) == 2  # placed, not acked yet
    clock.advance(1)
    pool.finish(b.id)
    grown = pool.job(a.id)
    assert grown.target_generation == 2 and len(grown.target_gpus) == 4


def test_heartbeat_keeps_a_job_alive_and_reports_cancellation(pool, clock):
    pool.configure_pool(lease_s=30)
    a = pool.submit(spec("a"))
    for _ in range(3):
        clock.advance(20)
        assert pool.heartbeat(a.id).status is JobStatus.RUNNING
    pool.cancel(a.id)
    assert pool.heartbeat(a.id).status is JobStatus.CANCELLED


def test_database_rejects_a_gpu_in_use_by_two_jobs(pool):
    a = pool.submit(spec("a", max_gpus=1))
    b = pool.submit(spec("b", max_gpus=1))
    pool.ack(a.id, 1)
    with pool.engine.connect() as conn:
        gpu_id = conn.scalar(select(GpuInUse.gpu_id).where(GpuInUse.job_id == a.id))
    with pytest.raises(IntegrityError), pool.engine.begin() as conn:
        conn.execute(insert(GpuInUse).values(gpu_id=gpu_id, job_id=b.id, generation=1))


def test_drained_node_gets_no_new_jobs(broker):
    broker.register_node("n0", 2)
    broker.register_node("n1", 2)
    broker.set_node_schedulable("n1", False)
    a = broker.submit(spec("a", max_gpus=2))
    assert {g.node for g in a.target_gpus} == {"n0"}


def test_a_node_registered_in_one_pool_is_refused_in_another(broker):
    """The same machine in two pools would give a job of each its GPU 0 (kube-sync or nodes add run
    for two pools): refused, naming the pool that has it."""
    broker.register_node("gpu-node-1", 1, pool="a")
    with pytest.raises(InvalidRequest, match="node 'gpu-node-1' is already in GPU pool 'a'"):
        broker.register_node("gpu-node-1", 1, pool="b")
    assert [n.name for n in broker.nodes("a")] == ["gpu-node-1"] and broker.register_node("gpu-node-1", 2, pool="a")


def test_register_node_is_idempotent_and_records_gpu_type(broker):
    broker.register_node("n0", 2, gpu_type="NVIDIA H100")
    broker.register_node("n0", 2, gpu_type="NVIDIA H100")
    [n] = broker.nodes()
    assert len(n.gpus) == 2 and {g.gpu_type for g in n.gpus} == {"NVIDIA H100"}
    with broker.engine.connect() as conn:
        assert len(conn.execute(select(Gpu)).all()) == 2


@pytest.mark.parametrize("kw,match", [
    ({"min_gpus": 3, "max_gpus": 2}, r"min_gpus \(3\) must not be larger than max_gpus \(2\)"),
    ({"min_gpus": 0}, "min_gpus must be an integer >= 1, got 0"),
    ({"max_gpus": -1}, "max_gpus must be an integer >= 1, got -1"),
    ({"total_steps": 0}, "total_steps must be an integer >= 1"),
    ({"min_gpus": 5, "max_gpus": 8}, "min_gpus=5 is more than GPU pool 'default' has"),
    ({"progress_pattern": "step=(\\d+"}, "not a valid regex"),
    ({"progress_pattern": "(a)(b)"}, "named group"),
    ({"requested_gpus": 9}, "requested_gpus"),
    ({"backend": "slurm"}, "backend must be"),
])
def test_bad_submit_is_rejected_with_a_clear_message_and_changes_nothing(pool, kw, match):
    with pytest.raises(InvalidRequest, match=match):
        pool.submit(spec("bad", **kw))
    assert pool.jobs() == []


def test_min_gpus_larger_than_any_node_is_rejected_for_the_local_backend(broker):
    broker.register_node("n0", 2)
    broker.register_node("n1", 2)
    with pytest.raises(InvalidRequest, match="larger than any node"):
        broker.submit(spec("big", min_gpus=3))


def test_unknown_pool_names_the_known_ones(pool):
    with pytest.raises(NotFound, match="unknown GPU pool 'gpus-a100'; known pools: default"):
        pool.submit(spec("x", pool="gpus-a100"))
    with pytest.raises(NotFound, match="unknown job"):
        pool.heartbeat("nope")


def test_bad_policy_configuration_is_rejected(pool):
    with pytest.raises(InvalidRequest, match="unknown scheduling policy"):
        pool.configure_pool(policy="fifo")
    with pytest.raises(InvalidRequest, match=r"lease_s must be a number of seconds in \(0, "):
        pool.configure_pool(lease_s=0)


def test_bad_broker_url_is_a_clear_error():
    with pytest.raises(ValueError, match="invalid broker URL"):
        GpuBroker("not a url")
    with pytest.raises(ValueError, match="'mysql' is not supported"):
        GpuBroker("mysql://u@h/db")


def test_a_sqlite_file_in_a_missing_directory_is_named_and_nothing_is_made(tmp_path, monkeypatch):
    """A mistyped directory would make a new, empty broker in new directories: refused, naming it;
    only Airflow's home (the default broker file's directory) is created when missing."""
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflow"))
    typo = tmp_path / "brokr" / "state"
    with pytest.raises(ValueError, match=f"the directory '{typo}' of its SQLite file does not exist"):
        GpuBroker(f"sqlite:///{typo / 'broker.db'}")
    assert not (tmp_path / "brokr").exists()
    GpuBroker(f"sqlite:///{tmp_path / 'airflow' / 'broker.db'}").register_node("n0", 1)
    assert (tmp_path / "airflow" / "broker.db").is_file()


def test_heartbeat_and_target_tell_the_agent_the_pool_lease(broker):
    """The sidecar fences its trainer within the pool's lease: the broker says what the lease is."""
    broker.register_node("n0", 1)
    broker.configure_pool(lease_s=42)
    job = broker.submit(spec("a", max_gpus=1))
    assert broker.heartbeat(job.id).lease_s == 42
    assert broker.target(job.id).lease_s == 42


def test_a_failing_rebalance_never_loses_the_call_that_asked_for_it(pool, caplog):
    """A job call serves a due rebalance in its own transaction under a savepoint: if the policy
    raises, the call's change is still committed, the error is logged, and the request stays
    pending for the next rebalance."""

    class BrokenPolicy:
        preemptive = False

        def decide(self, state):
            raise RuntimeError("policy bug")

    pool.policy_override = BrokenPolicy()
    job = pool.submit(spec("a"))
    assert job.status is JobStatus.QUEUED and job.target_gpus == ()
    assert "policy bug" in caplog.text
    pool.policy_override = None
    assert pool.rebalance()[job.id]  # the pending request is served once the policy works
    assert pool.target(job.id).gpus


def test_a_request_committed_after_the_watermark_with_a_lower_id_is_still_pending(pool):
    """Ids are taken before commit: a request may commit after a rebalance set the watermark above
    its id. The look-back below the watermark still counts it, so the next call serves it."""
    from sqlalchemy import text

    from airflow_elastic_gpu.broker.rows import LOOKBACK_REQUESTS, read_pool, request_rebalance

    with pool.engine.begin() as conn:
        assert read_pool(conn, "default").pending == 0
        request_rebalance(conn, "default", 0.0)
        late = conn.execute(text("SELECT max(id) FROM rebalance_request")).scalar_one()
        conn.execute(text("UPDATE gpu_pool SET served_request_id = :w WHERE name = 'default'"),
                     {"w": late + LOOKBACK_REQUESTS // 2})
    with pool.engine.connect() as conn:
        assert read_pool(conn, "default").pending == 1


def test_a_heartbeat_survives_a_failing_policy(pool, clock, caplog):
    """A rebalance that raises inside a heartbeat is logged and counted; the agent still gets its
    target (a failing policy must not fence every trainer of the pool)."""

    class BrokenPolicy:
        preemptive = False

        def decide(self, state):
            raise RuntimeError("policy bug")

    job = pool.submit(spec("a"))
    pool.ack(job.id, pool.target(job.id).generation)
    pool.configure_pool(rebalance_interval_s=1.0)
    pool.policy_override = BrokenPolicy()
    clock.advance(5.0)  # the heartbeat finds an interval rebalance due
    target = pool.heartbeat(job.id)
    assert target.generation == 1 and target.gpus
    assert pool.failed_rebalances >= 1 and "policy bug" in caplog.text


def test_a_cancelled_job_s_gpus_go_to_nobody_until_its_trainer_has_stopped(pool, clock):
    """Cancel ends the job at once, but its trainer stops only after the agent's next heartbeat
    and the grace period: its GPUs wait for the agent's report (or for the lease)."""
    pool.configure_pool(lease_s=30)
    a = pool.submit(spec("a", min_gpus=4))
    pool.ack(a.id, 1)
    waiting = pool.submit(spec("waiting", min_gpus=4))
    cancelled = pool.cancel(a.id)
    assert cancelled.status is JobStatus.CANCELLED and len(cancelled.in_use_gpus) == 4
    pool.rebalance()
    assert pool.job(waiting.id).target_gpus == ()
    assert pool.heartbeat(a.id).status is JobStatus.CANCELLED  # the agent is told to stop
    clock.advance(5)
    pool.fail(a.id, "the trainer stopped")  # its report once the trainer is gone
    after = pool.job(a.id)
    assert after.status is JobStatus.CANCELLED and after.in_use_gpus == () and after.reason == "cancelled by user"
    assert len(pool.job(waiting.id).target_gpus) == 4
    (release,) = [e for e in pool.events(job_id=a.id) if e.kind == "release"]
    assert "its trainer stopped" in release.message and len(release.data["gpus"]) == 4


def test_a_cancelled_job_whose_agent_is_silent_frees_its_gpus_after_the_lease(pool, clock):
    pool.configure_pool(lease_s=30)
    a = pool.submit(spec("a", min_gpus=4))
    pool.ack(a.id, 1)
    pool.heartbeat(a.id)
    waiting = pool.submit(spec("waiting", min_gpus=4))
    pool.cancel(a.id)
    clock.advance(29)
    pool.heartbeat(a.id)  # a heartbeat of the ended job does not extend its hold
    pool.heartbeat(waiting.id)
    pool.rebalance()
    assert pool.job(waiting.id).target_gpus == ()
    clock.advance(2)
    pool.rebalance()
    assert len(pool.job(waiting.id).target_gpus) == 4 and pool.job(a.id).in_use_gpus == ()
    (release,) = [e for e in pool.events(job_id=a.id) if e.kind == "release"]
    assert "no heartbeat" in release.message
    pool.cancel(a.id)  # idempotent, holds nothing again
    assert pool.job(a.id).status is JobStatus.CANCELLED


def test_request_ids_past_32_bits_still_find_their_rebalance(pool, broker_url):
    """Every allocation-changing call inserts a rebalance request; a long-lived broker's ids pass
    2^31 (weeks at full load). Past it, a submit still inserts its request and is served."""
    from sqlalchemy import text

    with pool.engine.begin() as conn:
        if pool.engine.dialect.name == "postgresql":
            conn.execute(text("SELECT setval(pg_get_serial_sequence('rebalance_request', 'id'), 3000000000)"))
        else:
            conn.execute(text("UPDATE sqlite_sequence SET seq = 3000000000 WHERE name = 'rebalance_request'"))
            conn.execute(text("INSERT INTO sqlite_sequence (name, seq) SELECT 'rebalance_request', 3000000000 "
                              "WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'rebalance_request')"))
    a = pool.submit(spec("a"))
    assert pool.job(a.id).target_gpus, "the submit's request was served"
    with pool.engine.connect() as conn:
        assert conn.execute(text("SELECT served_request_id FROM gpu_pool")).scalar() > 2**31


@pytest.mark.parametrize("by_gain", [False, True, None])
def test_a_pool_can_start_measured_jobs_shortest_first(pool, clock, by_gain):
    """With the pool setting ``admission_by_gain`` (the default: None, a pool that does not set it),
    two new runs of a training measured before (the finished run of the same name) start one after
    the other on all GPUs, shortest first; with ``admission_by_gain=false`` both start at once and
    share them."""
    params = dict(RESIZE_AT_ONCE)
    if by_gain is not None:
        params["admission_by_gain"] = by_gain
    pool.configure_pool(policy_params=params)
    last = pool.submit(spec("run-1", min_gpus=4))
    pool.ack(last.id, 1)
    pool.progress(last.id, 0, generation=1)
    clock.advance(10)
    pool.progress(last.id, 100, generation=1)  # 10 steps/s on 4 GPUs
    pool.finish(last.id)
    hog = pool.submit(spec("hog", min_gpus=4))  # holds the GPUs while both arrive
    pool.ack(hog.id, 1)
    jobs = [pool.submit(JobSpec(name="run-1", command="python train.py", key=f"run-{n}", min_gpus=1, max_gpus=4,
                                total_steps=steps)) for n, steps in ((2, 2000), (3, 1000))]
    pool.finish(hog.id)
    sizes = [len(pool.job(j.id).target_gpus) for j in jobs]
    if by_gain is not False:
        assert sizes == [0, 4]  # the shorter one first, on every GPU; the other waits for them
    else:
        assert all(sizes) and sum(sizes) == 4


def test_a_lost_job_whose_trainer_had_finished_cleanly_succeeds_when_the_report_comes(pool, clock):
    """The trainer exits 0, and its agent cannot reach the broker's API for longer than the lease:
    the job is declared lost, and the report of the clean exit that comes later was dropped. The
    job stayed LOST without its metrics, and the task's retry trained it again."""
    pool.configure_pool(lease_s=30)
    a = _declared_lost(pool, clock, "a")
    done = pool.finish(a.id, 0, {"final": True, "step": 100, "accuracy": 0.93})
    assert done.status is JobStatus.SUCCEEDED and done.exit_code == 0 and done.metrics["accuracy"] == 0.93
    assert done.in_use_gpus == () and done.target_gpus == ()
    assert "reported after the job was declared lost" in pool.events(job_id=a.id)[-1].message
    # a failure reported late changes nothing: LOST stays
    b = _declared_lost(pool, clock, "b")
    assert pool.fail(b.id, "exit 1", 1).status is JobStatus.LOST


def _declared_lost(pool, clock, name: str):
    """A job of ``pool`` (lease 30 s) whose agent acked and was then silent until it was LOST."""
    job = pool.submit(spec(name))
    pool.ack(job.id, 1)
    clock.advance(20)
    pool.rebalance()  # a call within the lease (else the silence of every caller reads as an outage)
    clock.advance(11)
    pool.rebalance()
    assert pool.job(job.id).status is JobStatus.LOST
    return job
