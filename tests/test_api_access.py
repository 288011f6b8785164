"""Per-DAG permissions on the read-only views: inside Airflow the GPU pool page checked only the
plugins view permission, so a user allowed some DAGs read every job, with its reason (the trainer's
last log lines) and metrics. A job of a DAG the user may not read is shown without its story; the
pool's GPUs, and which job holds them, stay visible."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from airflow_elastic_gpu.broker.api import create_app
from airflow_elastic_gpu.broker.api_access import HIDDEN, Viewer, dag_of
from airflow_elastic_gpu.broker.types import JobSpec, task_key

SECRET = "secret-model-x"
LOG = "loss exploded at step 7 on the private dataset"


def _jobs(pool):
    """A job of DAG ``etl`` (readable), one of DAG ``secret`` that ended with a reason and metrics and
    was resized, one of no DAG (the CLI's), all of pool ``default``."""
    etl = pool.submit(JobSpec("train-etl", "t", 1, 2, total_steps=100, family="etl.train",
                              key=task_key("etl", "train", "r1", -1, deployment="prod")))
    secret = pool.submit(JobSpec(SECRET, "t", 1, 2, total_steps=100, family="secret.train",
                                 key=task_key("secret", "train", "r1", -1, deployment="prod")))
    cli = pool.submit(JobSpec("from-the-cli", "t", 1, 1, total_steps=100))
    pool.rebalance()
    for job in (etl, secret, cli):
        pool.ack(job.id, pool.job(job.id).target_generation)
    pool.fail(secret.id, LOG, metrics={"private_score": 0.123})
    return etl, secret, cli


def test_a_job_of_a_dag_the_viewer_may_not_read_is_shown_without_its_story(pool):
    etl, secret, cli = _jobs(pool)
    # the same DAG id in another deployment sharing the broker: another DAG
    staging = pool.submit(JobSpec("staging-etl", "t", 1, 1, total_steps=100, family="etl.train",
                                  key=task_key("etl", "train", "r1", -1, deployment="staging")))
    client = TestClient(create_app(pool, ui_viewer=lambda: Viewer(frozenset({"etl"})), deployment="prod"))
    texts = []
    for path in ("/api/v1/jobs", f"/api/v1/jobs/{secret.id}", "/api/v1/pools/default/snapshot",
                 "/api/v1/pools/default/timeline", "/api/v1/events"):
        r = client.get(path)
        assert r.status_code == 200, path
        texts.append(r.text)
    for text in texts:
        assert SECRET not in text and LOG not in text and "private_score" not in text and "secret/train" not in text
    jobs = {j["id"]: j for j in client.get("/api/v1/jobs").json()}
    assert jobs[secret.id]["name"] == HIDDEN and jobs[secret.id]["reason"] is None
    assert jobs[secret.id]["status"] == "failed" and jobs[secret.id]["metrics"] is None
    assert jobs[etl.id]["name"] == "train-etl" and jobs[cli.id]["name"] == "from-the-cli"  # its DAG's; no DAG
    events = client.get("/api/v1/events").json()
    assert any(e["job_id"] == secret.id and e["message"] == HIDDEN for e in events)
    assert any(e["job_id"] == etl.id and "train-etl" in e["message"] for e in events)
    assert client.get("/api/v1/jobs/by-task", params={"dag_id": "secret", "task_id": "train", "run_id": "r1"}
                      ).status_code == 404
    assert jobs[staging.id]["name"] == HIDDEN and "staging-etl" not in client.get("/api/v1/events").text
    assert client.get("/api/v1/jobs/by-task", params={"dag_id": "etl", "task_id": "train", "run_id": "r1",
                                                      "deployment": "staging"}).status_code == 404
    # the stand-alone server's viewers read everything
    everything = TestClient(create_app(pool, deployment="prod"))
    assert SECRET in everything.get("/api/v1/jobs").text and LOG in everything.get("/api/v1/events").text
    assert everything.get("/api/v1/jobs/by-task", params={"dag_id": "secret", "task_id": "train",
                                                          "run_id": "r1"}).json()["id"] == secret.id


@pytest.mark.parametrize(("key", "family", "dag"), [
    ("etl/train/r1/-1", "etl.train", "etl"),
    ("prod/etl/train/r1/3", "etl.train", "etl"),  # a named deployment's
    ("etl/train/r1/-1@0123", "etl.train", "etl"),  # a try a retry replaced
    ("a.b/c/r1/-1", "a.b.c", "a.b"),  # a DAG id with dots
    ("x" * 100 + "/t/r#0123456789abcdef", "x" * 100 + ".t", ""),  # cut for length: its DAG unknown
    ("4f0c3d2e-uuid", "train", None),  # the CLI's
    ("my/own/key/1", "other", None),  # a key of the user's that is no task's
    ("/etl/train/r1/-1", "etl.train", None),  # no task_key makes it (an empty deployment adds no "/")
])
def test_the_dag_of_a_job_is_read_from_its_key_and_family(key, family, dag):
    assert dag_of(key, family) == dag
    deployment = "prod" if key.startswith("prod/") else ""
    assert Viewer(frozenset({"etl"}), deployment).hides(key, family) is (dag is not None and dag != "etl")
    assert Viewer().hides(key, family) is False
    if dag == "":  # a cut key: in full to a viewer of the DAG its key and family begin with
        assert not Viewer(frozenset({"etl", "x" * 100})).hides(key, family)
        assert Viewer(frozenset({"x" * 100}), "prod").hides(key, family)  # another deployment's


@pytest.mark.parametrize(("key", "family", "dag_ids", "deployment", "hidden"), [
    # a broker deployments share: staging's etl is not prod's etl
    ("prod/etl/train/r1/-1", "etl.train", {"etl"}, "staging", True),
    ("prod/etl/train/r1/-1", "etl.train", {"etl"}, "", True),
    ("etl/train/r1/-1", "etl.train", {"etl"}, "prod", True),
    ("staging/etl/train/r1/-1", "etl.train", {"etl"}, "staging", False),
    # a cut key: a readable DAG "a" does not open DAG "a.b"'s jobs, nor another deployment's
    ("a.b/" + "t" * 80 + "#0123456789abcdef", "a.b." + "t" * 80, {"a"}, "", True),
    ("a.b/" + "t" * 80 + "#0123456789abcdef", "a.b." + "t" * 80, {"a.b"}, "", False),
    ("prod/a.b/" + "t" * 80 + "#0123456789abcdef", "a.b." + "t" * 80, {"a.b"}, "staging", True),
    ("prod/a.b/" + "t" * 80 + "#0123456789abcdef", "a.b." + "t" * 80, {"a.b"}, "prod", False),
])
def test_a_viewer_reads_the_jobs_of_its_dags_of_its_deployment_only(key, family, dag_ids, deployment, hidden):
    assert Viewer(frozenset(dag_ids), deployment).hides(key, family) is hidden


def test_inside_airflow_the_viewer_is_the_users_readable_dags_asked_at_most_every_30_s(pool, monkeypatch):
    """The plugin's dependency: Airflow's user (its login) and its auth manager's per-DAG permissions,
    kept 30 s per user (the page refreshes every 2 s)."""
    import airflow.api_fastapi.app as airflow_app
    from airflow.api_fastapi.core_api import security

    from airflow_elastic_gpu import plugins

    asked = []

    class AuthManager:
        def get_authorized_dag_ids(self, *, user, method="GET"):
            asked.append((user.get_id(), method))
            return {"etl"} if user.get_id() == "ann" else {"etl", "secret"}

    monkeypatch.setattr(airflow_app, "get_auth_manager", lambda: AuthManager())
    monkeypatch.setattr(plugins, "_READABLE", {})
    _jobs(pool)
    app = create_app(pool, ui_viewer=plugins._ui_viewer(), deployment="prod")
    client = TestClient(app)
    for name, shown in (("ann", False), ("bob", True)):
        app.dependency_overrides[security.get_user] = lambda name=name: SimpleNamespace(get_id=lambda: name)
        for _ in range(3):
            assert (SECRET in client.get("/api/v1/jobs").text) is shown
    assert asked == [("ann", "GET"), ("bob", "GET")]
    user = SimpleNamespace(get_id=lambda: "ann")
    assert plugins.readable_dags(AuthManager(), user, now_s=1e9) == frozenset({"etl"})  # 30 s passed: asked again
    assert len(asked) == 3 and json.dumps(sorted(plugins._READABLE)) == '["ann", "bob"]'
