"""The broker's Alembic migrations with data in the database: every step down and back up keeps the
pool, its jobs, their GPUs and history, and the broker works on the result (an upgrade of a running
deployment goes through the same steps)."""

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from airflow_elastic_gpu.broker.db import _alembic_config, run_migration, schema_is_current
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.states import JobStatus


def revisions() -> list[str]:
    """Every revision after the first, newest first (downgrading to the first drops the tables)."""
    script = ScriptDirectory.from_config(_alembic_config())
    return [r.revision for r in script.walk_revisions() if r.down_revision is not None]


def snapshot(broker: GpuBroker) -> dict:
    jobs = {j.id: (j.name, j.status, j.target_gpus, j.in_use_gpus, j.steps_done) for j in broker.jobs()}
    return {"jobs": jobs, "nodes": sorted((n.name, len(n.gpus)) for n in broker.nodes()),
            "events": [(e.id, e.kind, e.job_id) for e in broker.events(limit=10_000)]}


@pytest.mark.parametrize("revision", revisions())
def test_every_migration_step_down_and_up_keeps_the_data(broker, clock, revision):
    broker.register_node("n0", 4)
    running = broker.submit(JobSpec(name="train", command="python train.py", key="a", min_gpus=1, max_gpus=2,
                                    total_steps=1000))
    broker.ack(running.id, 1)
    broker.progress(running.id, 0, generation=1)
    clock.advance(10)
    broker.progress(running.id, 100, generation=1)
    done = broker.submit(JobSpec(name="train", command="python train.py", key="b", total_steps=10))
    broker.finish(done.id)
    before = snapshot(broker)

    run_migration(broker.engine, "downgrade", _previous(revision))
    assert not schema_is_current(broker.engine)
    run_migration(broker.engine, "upgrade", "head")
    assert schema_is_current(broker.engine)

    assert snapshot(broker) == before
    job = broker.job(running.id)
    assert job.status is JobStatus.RUNNING and len(job.in_use_gpus) == 2
    new = broker.submit(JobSpec(name="train", command="python train.py", key="c", total_steps=1000))
    broker.rebalance()
    assert broker.job(new.id).target_gpus, "the broker allocates after the round trip"
    held = [g for j in broker.jobs() for g in (*j.target_gpus,) if j.status is JobStatus.RUNNING]
    assert len(held) == len(set(held)) <= 4


def test_the_family_column_is_filled_from_the_names_of_existing_jobs(broker):
    """Migration 0010: jobs submitted before it get the family they would get now."""
    broker.register_node("n0", 1)
    for key, name in (("a", "sweep[3]"), ("b", "train"), ("c", "odd[name]"), ("d", "[3]"),
                      ("nightly/train/scheduled__2026-11-24T00:00:00+00:00/-1", "train"),
                      ("nightly/sweep/manual__1/2@8f3c", "sweep[2]"),
                      ("prod/nightly/eval/scheduled__2026-11-24T00:00:00+00:00/-1", "eval")):
        broker.submit(JobSpec(name=name, command="python train.py", key=key, total_steps=10))
    run_migration(broker.engine, "downgrade", "0009")
    run_migration(broker.engine, "upgrade", "head")
    with broker.engine.connect() as conn:
        families = dict(conn.execute(text("SELECT key, family FROM job")).all())
    assert families == {"a": "sweep", "b": "train", "c": "odd[name]", "d": "[3]",  # as JobSpec sets them
                        # the operator's jobs: dag_id.task_id, as the operator now sets it
                        "nightly/train/scheduled__2026-11-24T00:00:00+00:00/-1": "nightly.train",
                        "nightly/sweep/manual__1/2@8f3c": "nightly.sweep",
                        # with a deployment (a database taken below 0010 and back): not "prod.nightly"
                        "prod/nightly/eval/scheduled__2026-11-24T00:00:00+00:00/-1": "nightly.eval"}


def _previous(revision: str) -> str:
    script = ScriptDirectory.from_config(_alembic_config())
    return script.get_revision(revision).down_revision


@pytest.mark.postgres
@pytest.mark.parametrize("broker_url", ["postgresql"], indirect=True)
def test_event_and_sample_ids_are_64_bit_on_postgresql(broker, clock):
    """Events and progress samples accumulate for a deployment's whole life: past 2^31 rows their
    ids (and their sequences) must keep going."""
    with broker.engine.begin() as conn:
        for table in ("event", "progress_sample"):
            conn.execute(text(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), 3000000000)"))
    broker.register_node("n0", 1)
    job = broker.submit(JobSpec(name="train", command="python train.py", key="a", total_steps=100))
    broker.ack(job.id, 1)
    broker.progress(job.id, 10, generation=1)
    assert broker.events()[-1].id > 2**31
    assert broker.events(after_id=2**31 + 5)[-1].id > 2**31
    with broker.engine.connect() as conn:
        assert conn.execute(text("SELECT max(id) FROM progress_sample")).scalar() > 2**31


@pytest.mark.postgres
@pytest.mark.parametrize("broker_url", ["postgresql"], indirect=True)
def test_a_rebalance_watermark_past_2_31_goes_down_below_its_64_bit_revision_and_back(broker):
    """0008's downgrade made the watermark a 32-bit integer before zeroing it: out of range."""
    broker.register_node("n0", 1)
    with broker.engine.begin() as conn:
        conn.execute(text("UPDATE gpu_pool SET served_request_id = 3000000000"))
    run_migration(broker.engine, "downgrade", "0007")
    run_migration(broker.engine, "upgrade", "head")
    job = broker.submit(JobSpec(name="train", command="python train.py", key="a", total_steps=10))
    broker.rebalance()
    assert broker.job(job.id).target_gpus


def test_a_database_at_a_revision_this_version_does_not_know_is_refused_with_what_to_do(broker_url, clock):
    """A newer version's schema (or another application's Alembic table, e.g. Airflow's metadata
    database): Alembic's own error named only the revision, and a worker could not tell why."""
    GpuBroker(broker_url, clock=clock).engine.dispose()
    engine = create_engine(broker_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = '0099'"))
        with pytest.raises(RuntimeError, match=r"at schema revision '0099', which this version of "
                                               r"airflow-elastic-gpu does not know: a newer version"):
            GpuBroker(broker_url, clock=clock)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0099"
    finally:
        engine.dispose()


def test_a_database_with_tables_of_the_brokers_names_but_no_revision_is_refused_with_what_to_do(broker_url, clock):
    """Another application's database (or a broker's that lost its alembic_version): creating the
    schema failed on the first table that exists, with the driver's error (``table event already exists``)."""
    engine = create_engine(broker_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE event (id INTEGER PRIMARY KEY, what TEXT)"))
        with pytest.raises(RuntimeError, match=r"has tables named as the broker's \(event\) but no schema revision: "
                                               r"it is not a broker database"):
            GpuBroker(broker_url, clock=clock)
        with engine.connect() as conn:
            assert set(inspect(conn).get_table_names()) == {"event"}  # nothing was changed
    finally:
        engine.dispose()


def test_a_sqlite_migration_that_would_leave_a_dangling_reference_is_refused_and_rolled_back(tmp_path, clock):
    """SQLite migrations run with foreign keys off (a table is altered by copying it), so
    ``PRAGMA foreign_key_check`` guards the commit: a row that refers to a missing one (here a GPU
    target of a job that is not in the table, written by hand) stops the migration with an error
    that names the table, and nothing of it is kept (the schema stays where it was)."""
    import sqlite3

    path = tmp_path / "broker.db"
    broker = GpuBroker(f"sqlite:///{path}", clock=clock)
    try:
        broker.register_node("n0", 2)
        job = broker.submit(JobSpec(name="train", command="python train.py", key="a", total_steps=100))
        raw = sqlite3.connect(path)  # foreign keys are off on a plain connection
        moved = raw.execute("UPDATE gpu_target SET job_id = 'no-such-job' WHERE job_id = ?", (job.id,)).rowcount
        raw.commit()
        assert moved >= 1  # the GPUs published to the job
        raw.close()
        head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
        with pytest.raises(RuntimeError, match="left rows that refer to missing ones.*gpu_target"):
            run_migration(broker.engine, "downgrade", _previous(head))
        assert schema_is_current(broker.engine)  # the step was rolled back: its index is still there
        assert "ix_job_pool_family_end" in {ix["name"] for ix in inspect(broker.engine).get_indexes("job")}
        with broker.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM gpu_target WHERE job_id = 'no-such-job'")).scalar() == moved
    finally:
        broker.engine.dispose()


def test_a_database_written_by_the_first_release_upgrades_with_its_jobs_gpus_and_history(broker, clock):
    """Rows as the first schema (0001) held them, written by hand: a running job on one of two GPUs,
    a finished job with its metrics, progress samples and events. After ``upgrade head`` the broker
    reads them as they were, the running job keeps its GPU (a new job gets the other one only), its
    progress goes on from the step recorded and is measured."""
    engine = broker.engine
    run_migration(engine, "downgrade", "0001")
    now = clock()
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO gpu_pool (name, last_rebalance_s, created_s, policy, policy_params, lease_s, "
            "rebalance_interval_s) VALUES ('default', :t, :t, 'adaptive', NULL, 60, 30)"), {"t": now - 100})
        # ids from the tables' own sequences, as the first release's inserts took them
        conn.execute(text("INSERT INTO node (pool, name, schedulable) VALUES ('default', 'n0', :yes)"), {"yes": True})
        node_id = conn.execute(text("SELECT id FROM node WHERE name = 'n0'")).scalar_one()
        for i in (0, 1):
            conn.execute(text("INSERT INTO gpu (node_id, \"index\", gpu_type, healthy) "
                              "VALUES (:n, :i, 'NVIDIA A100', :yes)"), {"n": node_id, "i": i, "yes": True})
        gpu0 = conn.execute(text("SELECT id FROM gpu WHERE \"index\" = 0")).scalar_one()
        common = ("key, pool, name, command, min_gpus, max_gpus, requested_gpus, total_steps, priority, backend, "
                  "status, steps_done, target_generation, acked_generation, num_resizes, gpu_seconds, submit_s, "
                  "last_heartbeat_s")
        conn.execute(text(
            f"INSERT INTO job (id, {common}, start_s, in_use_since_s, published_s) VALUES ('old-running', "
            "'k1', 'default', 'train', 'python train.py', 1, 1, 1, 1000, 0, 'local', 'running', 100, 1, 1, 0, 0, "
            ":t, :now, :t, :t, :t)"), {"t": now - 90, "now": now})
        conn.execute(text(
            f"INSERT INTO job (id, {common}, metrics, start_s, end_s) VALUES ('old-done', 'k2', 'default', "
            "'sweep[1]', 'python train.py', 1, 1, 1, 10, 0, 'local', 'succeeded', 10, 1, 1, 0, 5, :t, :t, "
            "'{\"accuracy\": 0.97}', :t, :t)"), {"t": now - 95})
        for gpu_table in ("gpu_in_use", "gpu_target"):
            conn.execute(text(f"INSERT INTO {gpu_table} (gpu_id, job_id, generation) VALUES (:g, 'old-running', 1)"),
                         {"g": gpu0})
        for time_s, step in ((now - 80, 0.0), (now - 40, 50.0), (now, 100.0)):
            conn.execute(text("INSERT INTO progress_sample (job_id, time_s, step, num_gpus, generation) "
                              "VALUES ('old-running', :t, :s, 1, 1)"), {"t": time_s, "s": step})
        conn.execute(text("INSERT INTO event (time_s, pool, job_id, kind, message, data) VALUES "
                          "(:t, 'default', 'old-running', 'submit', 'submitted', NULL)"), {"t": now - 90})

    run_migration(engine, "upgrade", "head")
    assert schema_is_current(engine)
    upgraded = GpuBroker(engine.url.render_as_string(hide_password=False), clock=clock)
    running, done = upgraded.job("old-running"), upgraded.job("old-done")
    assert (running.status, running.steps_done, [g.index for g in running.in_use_gpus]) == (JobStatus.RUNNING, 100, [0])
    assert (done.status, done.metrics, done.family) == (JobStatus.SUCCEEDED, {"accuracy": 0.97}, "sweep")
    assert [(e.job_id, e.kind) for e in upgraded.events(limit=10)][:1] == [("old-running", "submit")]
    new = upgraded.submit(JobSpec(name="eval", command="python eval.py", key="k3", total_steps=100))
    upgraded.rebalance()
    assert [g.index for g in upgraded.job(new.id).target_gpus] == [1], "the old job's GPU stays its own"
    clock.advance(40)
    upgraded.progress("old-running", 200, generation=1)
    after = upgraded.job("old-running")
    assert after.steps_done == 200
    # measured on from the step the first release recorded: 100 steps in 40 s on one GPU
    assert [(n, round(speed, 2)) for n, speed in after.throughput] == [(1, 2.5)]
    upgraded.engine.dispose()
