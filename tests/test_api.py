"""The broker HTTP API: per-job token auth, validation, read-only views, schemathesis, and a real
agent talking to it over HTTP."""

from __future__ import annotations

import socket
import sys
import threading

import pytest
import schemathesis
import uvicorn
from conftest import RESIZE_AT_ONCE
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sidecar import TRAINER, wait_for

from airflow_elastic_gpu.backends.local import LocalBackend
from airflow_elastic_gpu.broker.api import create_app
from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.sidecar.http_transport import BrokerUnavailable, HttpBrokerTransport


@pytest.fixture
def broker(tmp_path, clock):
    """A broker on a fake clock: a call that changes nothing leaves every figure of a job as it
    was, its GPU-seconds up to now included."""
    b = GpuBroker(f"sqlite:///{tmp_path / 'broker.db'}", clock=clock)
    b.register_node("n0", 4)
    b.configure_pool(policy_params=RESIZE_AT_ONCE)
    yield b
    b.engine.dispose()


@pytest.fixture
def client(broker):
    return TestClient(create_app(broker))


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_sidecar_calls_need_the_jobs_own_token(broker, client):
    a = broker.submit(JobSpec("a", "train", 1, 2, total_steps=100))
    b = broker.submit(JobSpec("b", "train", 1, 2, total_steps=100))
    url = f"/api/v1/jobs/{a.id}"
    r = client.post(f"{url}/heartbeat")
    assert r.status_code == 401 and "missing bearer token" in r.json()["detail"]
    assert r.headers["www-authenticate"] == "Bearer"
    assert client.post(f"{url}/heartbeat", headers=auth("wrong")).status_code == 403
    other = client.post(f"{url}/ack", headers=auth(b.token), json={"generation": 1})  # b's token on a
    assert other.status_code == 403 and a.id in other.json()["detail"]
    assert broker.job(a.id).acked_generation == 0  # nothing changed
    assert client.get("/api/v1/jobs/no-such-job/target", headers=auth(a.token)).status_code == 403
    ok = client.post(f"{url}/heartbeat", headers=auth(a.token))
    assert ok.status_code == 200 and ok.json()["generation"] == 1
    assert client.post(f"{url}/ack", headers=auth(a.token), json={"generation": 1}).json() == {"accepted": True}
    # a rotated token replaces the old one
    fresh = broker.issue_token(a.id)
    assert client.get(f"{url}/target", headers=auth(a.token)).status_code == 403
    assert client.get(f"{url}/target", headers=auth(fresh)).status_code == 200


@pytest.mark.parametrize(("path", "body", "field", "message"), [
    ("progress", {"step": -1}, "step", "greater than or equal to 0"),
    ("progress", {}, "step", "Field required"),
    ("progress", {"step": 1, "generation": 0}, "generation", "greater than or equal to 1"),
    ("progress", {"step": 1, "colour": "red"}, "colour", "Extra inputs are not permitted"),
    ("ack", {"generation": "two"}, "generation", "valid integer"),
    ("fail", {"reason": ""}, "reason", "at least 1 character"),
    ("finish", {"exit_code": 300}, "exit_code", "less than or equal to 0"),  # a clean exit only
])
def test_bad_bodies_get_422_naming_the_field(broker, client, clock, path, body, field, message):
    job = broker.submit(JobSpec("a", "train", 1, 2, total_steps=100))
    broker.ack(job.id, 1)
    clock.advance(30)  # GPU-seconds held so far: a body that reset the accounting would show
    before = broker.job(job.id)
    assert before.gpu_seconds > 0
    r = client.post(f"/api/v1/jobs/{job.id}/{path}", headers=auth(job.token), json=body)
    assert r.status_code == 422
    detail = r.json()["detail"][0]
    assert detail["loc"][-1] == field and message in detail["msg"]
    assert broker.job(job.id) == before


def test_the_timeline_shows_the_newest_jobs_of_a_long_history(broker, client, monkeypatch):
    """A pool's oldest events crowded the jobs of today out of the timeline once its history was
    longer than the events it reads."""
    from airflow_elastic_gpu.broker import api_models

    for name in ("old", "older", "newest"):
        job = broker.submit(JobSpec(name, "train", 1, 4, total_steps=10))
        broker.ack(job.id, 1)
        broker.finish(job.id)
    monkeypatch.setattr(api_models, "TIMELINE_EVENTS", 4)  # the newest job's submit, start, ack, end
    segments = client.get("/api/v1/pools/default/timeline").json()["segments"]
    assert [s["name"] for s in segments] == ["newest"]
    events = broker.events(limit=2, latest=True)
    assert [e.id for e in events] == [e.id for e in broker.events()][-2:]  # oldest first, as always


def test_a_job_running_since_before_the_events_read_keeps_its_timeline_bar(broker, client, clock, monkeypatch):
    """A long job among many short ones: its ack fell out of the newest events the timeline reads,
    and its bar vanished while it ran."""
    from airflow_elastic_gpu.broker import api_models

    long = broker.submit(JobSpec("long", "train", 2, 2, total_steps=10))
    broker.ack(long.id, 1)
    started_s = clock()
    for i in range(3):
        clock.advance(20)
        broker.heartbeat(long.id)
        short = broker.submit(JobSpec(f"short-{i}", "train", 1, 1, total_steps=10))
        broker.ack(short.id, 1)
        broker.finish(short.id)
    monkeypatch.setattr(api_models, "TIMELINE_EVENTS", 4)
    segments = {s["name"]: s for s in client.get("/api/v1/pools/default/timeline").json()["segments"]}
    assert segments["long"]["start_s"] == started_s and segments["long"]["end_s"] is None
    assert segments["long"]["num_gpus"] == 2


def test_the_timeline_is_made_again_only_after_a_new_event_of_its_pool(broker, client, clock, monkeypatch):
    """Every open page asks for the timeline every 2 s, and each one read up to 20,000 events (and
    more for long jobs); it is the same until an ack or an end, each an event, moves a bar."""
    from airflow_elastic_gpu.broker import api

    made = []
    monkeypatch.setattr(api, "timeline", lambda b, pool: made.append(pool) or api_models_timeline(b, pool))
    job = broker.submit(JobSpec("bar", "train", 1, 2, total_steps=10))
    broker.ack(job.id, 1)
    first = client.get("/api/v1/pools/default/timeline").json()
    clock.advance(20)
    again = client.get("/api/v1/pools/default/timeline").json()
    assert made == ["default"] and again["segments"] == first["segments"]
    assert again["time_s"] == first["time_s"] + 20  # an open bar is drawn up to now
    broker.finish(job.id)
    (segment,) = client.get("/api/v1/pools/default/timeline").json()["segments"]
    assert made == ["default", "default"] and segment["end_s"] == clock()



def test_an_event_committed_after_a_later_one_reaches_the_timeline(broker, client, clock):
    """On PostgreSQL an event's id is taken at its INSERT and seen at its COMMIT: an ack committed
    after another job's later event leaves the pool's newest id as it was, and the cached timeline
    missed the job's bar until the pool's next event (hours, in a quiet pool). Emulated on SQLite by
    giving the ack's events ids below the newest one."""
    import sqlite3

    with sqlite3.connect(broker.engine.url.database) as con:  # ids for the late commit, then freed
        gap = [con.execute("INSERT INTO event (time_s, pool, kind, message) VALUES (0, 'default', 'x', 'x')").lastrowid
               for _ in range(10)]
    late = broker.submit(JobSpec("late", "train", 1, 1, total_steps=10))
    broker.submit(JobSpec("later", "train", 1, 1, total_steps=10))  # the newest event
    with sqlite3.connect(broker.engine.url.database) as con:
        con.execute(f"DELETE FROM event WHERE id IN ({','.join(map(str, gap))})")
        newest = con.execute("SELECT max(id) FROM event").fetchone()[0]
    assert client.get("/api/v1/pools/default/timeline").json()["segments"] == []
    broker.ack(late.id, 1)
    with sqlite3.connect(broker.engine.url.database) as con:  # the ack's events: committed late
        for free, (new,) in zip(gap, con.execute("SELECT id FROM event WHERE id > ? ORDER BY id", (newest,)).fetchall()):
            con.execute("UPDATE event SET id = ? WHERE id = ?", (free, new))
        assert con.execute("SELECT max(id) FROM event").fetchone()[0] == newest
    clock.advance(api_timeline_max_age_s())
    names = [s["name"] for s in client.get("/api/v1/pools/default/timeline").json()["segments"]]
    assert names == ["late"], "the bar of the late-committed ack is drawn within TIMELINE_MAX_AGE_S"


def api_timeline_max_age_s() -> float:
    from airflow_elastic_gpu.broker import api

    return getattr(api, "TIMELINE_MAX_AGE_S", 30.0)


def api_models_timeline(b, pool):
    from airflow_elastic_gpu.broker.api_models import timeline

    return timeline(b, pool)


def test_read_only_views_show_holders_progress_timeline_and_reasons(broker, client):
    a = broker.submit(JobSpec("alpha", "train", 1, 4, total_steps=100))
    broker.ack(a.id, 1)
    broker.progress(a.id, 10.0, generation=1)
    broker.submit(JobSpec("beta", "train", 1, 4, total_steps=10))  # alpha shrinks for beta
    snap = client.get("/api/v1/pools/default/snapshot").json()
    holders = {g["gpu"]: g["in_use_by"] for n in snap["nodes"] for g in n["gpus"]}
    assert set(holders.values()) == {a.id}
    assert {j["name"] for j in snap["jobs"]} == {"alpha", "beta"}
    assert any(e["kind"] == "resize" and "shrink" in e["message"] for e in snap["events"])
    timeline = client.get("/api/v1/pools/default/timeline").json()
    assert [(s["name"], s["num_gpus"]) for s in timeline["segments"]] == [("alpha", 4)]
    assert timeline["resizes"] == []  # published, not yet run: no resize of alpha's yet
    assert broker.ack(a.id, 2)
    timeline = client.get("/api/v1/pools/default/timeline").json()
    first, second = timeline["segments"]
    assert (first["name"], first["num_gpus"], second["name"]) == ("alpha", 4, "alpha") and second["num_gpus"] < 4
    [resize] = timeline["resizes"]
    assert resize["job_id"] == a.id and "shrink" in resize["message"]
    assert resize["time_s"] == second["start_s"]  # where alpha's smaller bar starts
    steps = {j["name"]: j["steps_done"] for j in client.get("/api/v1/jobs", params={"active": True}).json()}
    assert steps["alpha"] == 10.0
    suspendable = broker.submit(JobSpec("gamma", "train", 1, 4, total_steps=10, preemptible=True))
    opted_in = {j["name"]: j["preemptible"] for j in client.get("/api/v1/jobs").json()}
    assert opted_in == {"alpha": False, "beta": False, "gamma": True}
    broker.cancel(suspendable.id)
    assert client.get("/api/v1/pools/nope/snapshot").status_code == 404
    assert client.get("/api/v1/events", params={"limit": 0}).status_code == 422
    page = client.get("/ui")
    assert page.status_code == 200 and "plotly.min.js" in page.text
    assert client.get("/ui/plotly.min.js").headers["content-type"].startswith("text/javascript")  # RFC 9239
    # the server's address leads to the page (it answered 404), its query (a token, a pool) kept
    for query, location in (("", "ui"), ("?pool=default&token=t", "ui?pool=default&token=t")):
        root = client.get(f"/{query}", follow_redirects=False)
        assert (root.status_code, root.headers["location"]) == (307, location)


def test_ui_token_guards_the_read_only_part_when_set(broker, monkeypatch):
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_UI_TOKEN", "s3cret")
    c = TestClient(create_app(broker))
    assert c.get("/api/v1/pools").status_code == 401
    assert c.get("/api/v1/pools", headers=auth("s3cret")).json() == ["default"]
    assert c.get("/ui", params={"token": "s3cret"}).status_code == 200
    # in a view's URL (and the next-page link repeating it) the token would reach proxies' logs
    assert c.get("/api/v1/pools", params={"token": "s3cret"}).status_code == 401
    assert c.get("/api/v1/jobs", params={"token": "s3cret"}).status_code == 401


schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(broker_url="sqlite://"))
# One pytest item per API operation, each with its own id: schemathesis's own ``schema.parametrize()``
# gives all of them one node id, which stops pytest's progress short of 100% and confuses xdist.
OPERATIONS = [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.label for op in OPERATIONS])
@given(data=st.data())
@settings(derandomize=True, max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_schemathesis_finds_no_server_error(operation, data):
    case = data.draw(operation.as_strategy())
    case.call_and_validate(checks=[schemathesis.checks.not_a_server_error])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def api_server(broker):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(broker), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 20, "API server to start")
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_a_real_agent_runs_a_job_over_http_without_the_database(tmp_path, broker, api_server, monkeypatch):
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    job = broker.submit(JobSpec("http", f"{sys.executable} {trainer} x 30", 1, 2, total_steps=30))
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_API", api_server)
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_JOB_TOKEN", job.token)
    # a DB URL the agent cannot use: the job can only succeed through the API
    backend = LocalBackend(tmp_path / "jobs", broker, broker_url="sqlite:////nonexistent/dir/broker.db",
                           poll_s=0.2)
    backend.start(job)
    handle = backend.handle(job.id)
    done = wait_for(lambda: broker.job(job.id).status.terminal and broker.job(job.id), 60, "job end")
    assert done.status is JobStatus.SUCCEEDED, done.reason + (handle.job_dir / "agent.log").read_text()[-2000:]
    assert done.steps_done == 30 and done.metrics["accuracy"] == 0.95
    assert protocol.read_json(handle.job_dir / protocol.STATUS)["generation"] == 1


def test_the_real_brokers_answers_about_a_job_end_it_and_a_wrong_api_url_does_not(broker, api_server):
    """An agent given the broker API URL one level too deep (``.../api/v1``) got the broker's 404 for
    a path it does not serve, took it for "the job ended" and stopped a live trainer; the job was
    then LOST with no word of the URL. Only the broker's answers about the job end it."""
    from airflow_elastic_gpu.sidecar.http_transport import JobGone

    job = broker.submit(JobSpec("url", "python train.py", 1, 1, total_steps=10))
    with pytest.raises(BrokerUnavailable, match=r"the broker serves no such path: is the broker API URL .*/api/v1"):
        HttpBrokerTransport(f"{api_server}/api/v1", job.token, timeout_s=5).heartbeat(job.id)
    assert HttpBrokerTransport(api_server, job.token, timeout_s=5).heartbeat(job.id).status is JobStatus.RUNNING
    with pytest.raises(JobGone, match="HTTP 403"):  # another job's token: about this job
        HttpBrokerTransport(api_server, "not-the-token", timeout_s=5).heartbeat(job.id)
    broker.cancel(job.id, "ended")
    with pytest.raises(JobGone, match="has ended"):
        HttpBrokerTransport(api_server, job.token, timeout_s=5).progress(job.id, 1)


def test_http_transport_errors_are_clear():
    with pytest.raises(ValueError, match="must start with http"):
        HttpBrokerTransport("broker:8793", "t")
    with pytest.raises(ValueError, match="token is empty"):
        HttpBrokerTransport("http://127.0.0.1:1", "")
    with pytest.raises(BrokerUnavailable, match="unreachable"):
        HttpBrokerTransport("http://127.0.0.1:1", "t", timeout_s=2).heartbeat("job")


def test_broker_serve_reads_the_ui_token_through_airflows_conf(tmp_path, monkeypatch):
    """``AIRFLOW__ELASTIC_GPU__UI_TOKEN_CMD`` (and ``_SECRET``) are forms only Airflow's conf knows: the
    stand-alone server read the environment only, and refused --host 0.0.0.0 for want of a token."""
    from airflow_elastic_gpu.cli import main

    for name in ("AIRFLOW_ELASTIC_GPU_UI_TOKEN", "AIRFLOW__ELASTIC_GPU__UI_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AIRFLOW__ELASTIC_GPU__UI_TOKEN_CMD", "echo t0ken-from-cmd")
    served = []
    monkeypatch.setattr("uvicorn.run", lambda app, **kwargs: served.append(app))
    assert main(["--broker-url", f"sqlite:///{tmp_path / 'b.db'}", "broker", "serve", "--host", "0.0.0.0"]) == 0
    c = TestClient(served[0])
    assert c.get("/api/v1/pools").status_code == 401
    assert c.get("/api/v1/pools", headers=auth("t0ken-from-cmd")).status_code == 200


def test_the_job_of_a_task_instance_is_found_by_its_ids(client, broker):
    """``/jobs/by-task``: the job an Airflow task instance submitted (the operator's key), its retry's
    when a try replaced it; a task that submitted none is a 404 that names it; ids are checked."""
    from airflow_elastic_gpu.broker.types import task_key

    mapped = broker.submit(JobSpec("train", "train", 1, 1, total_steps=10, key=task_key("etl", "train", "r1", 3)))
    plain = broker.submit(JobSpec("eval", "eval", 1, 1, total_steps=10, key=task_key("etl", "eval", "r1", -1)))
    r = client.get("/api/v1/jobs/by-task", params={"dag_id": "etl", "task_id": "train", "run_id": "r1", "map_index": 3})
    assert r.status_code == 200 and r.json()["id"] == mapped.id
    r = client.get("/api/v1/jobs/by-task", params={"dag_id": "etl", "task_id": "eval", "run_id": "r1"})
    assert r.status_code == 200 and r.json()["id"] == plain.id
    r = client.get("/api/v1/jobs/by-task", params={"dag_id": "etl", "task_id": "train", "run_id": "r1"})
    assert r.status_code == 404 and "etl.train (run r1) has submitted no GPU job" in r.text
    long_id = "x" * 250  # Airflow's longest ids: the key is cut and hashed as the operator cuts it
    cut = broker.submit(JobSpec("long", "t", 1, 1, total_steps=10, key=task_key(long_id, long_id, long_id, 0)))
    r = client.get("/api/v1/jobs/by-task", params={"dag_id": long_id, "task_id": long_id, "run_id": long_id,
                                                   "map_index": 0})
    assert r.status_code == 200 and r.json()["id"] == cut.id
    for bad in ({"dag_id": "", "task_id": "t", "run_id": "r"}, {"dag_id": "d", "task_id": "t", "run_id": "r" * 251},
                {"dag_id": "d", "task_id": "t", "run_id": "r", "map_index": -2}, {"dag_id": "d", "task_id": "t"}):
        assert client.get("/api/v1/jobs/by-task", params=bad).status_code == 422, bad


def test_the_jobs_list_comes_in_pages_with_the_total_and_a_link_to_the_next(client, broker, clock):
    """``/api/v1/jobs`` answers at most ``limit`` jobs (default 1,000) in submit order; the total and a
    relative link to the next page (RFC 8288) come as headers, the filters kept in the link."""
    from urllib.parse import urljoin

    ids = []
    for i in range(5):
        ids.append(broker.submit(JobSpec(f"j{i}", "j", 1, 1, total_steps=10)).id)
        clock.advance(1)
    broker.cancel(ids[1])
    seen, url = [], "/api/v1/jobs?limit=2"
    while url:
        r = client.get(url)
        assert r.status_code == 200 and len(r.json()) <= 2 and r.headers["X-Total-Count"] == "5"
        seen += [j["id"] for j in r.json()]
        link = r.headers.get("Link")
        url = urljoin(url, link[1:link.index(">")]) if link else None
        assert link is None or link.endswith('; rel="next"')
    assert seen == ids
    r = client.get("/api/v1/jobs", params={"active": True, "limit": 3, "pool": "default"})
    assert [j["id"] for j in r.json()] == [ids[0], *ids[2:4]] and r.headers["X-Total-Count"] == "4"
    assert "active=true" in r.headers["Link"] and "pool=default" in r.headers["Link"]
    r = client.get("/api/v1/jobs", params={"offset": 4})
    assert [j["id"] for j in r.json()] == ids[4:] and "Link" not in r.headers
    r = client.get("/api/v1/jobs", params={"order": "desc", "limit": 2})
    assert [j["id"] for j in r.json()] == ids[:-3:-1] and "order=desc" in r.headers["Link"]
    for bad in ({"limit": 0}, {"limit": 1001}, {"offset": -1}, {"order": "newest"}):
        assert client.get("/api/v1/jobs", params=bad).status_code == 422, bad
    # up to 36 KiB of JSON a job: at most 1,000 a page, the snapshot's ended ones too
    assert client.get("/api/v1/pools/default/snapshot", params={"ended": 1001}).status_code == 422


def test_a_job_that_ends_between_two_pages_of_active_jobs_moves_no_other_out_of_them(client, broker, clock):
    """With offset paging, a job of the first page that ended shifted the next page by one: its first
    job was on neither page. The next page is the jobs after the last one shown (either order)."""
    from urllib.parse import urljoin

    ids = []
    for i in range(5):
        ids.append(broker.submit(JobSpec(f"j{i}", "j", 1, 1, total_steps=10)).id)
        clock.advance(1)
    # ascending: j0 ends after the first page; descending (j0 ended): j4 ends after the first page
    for order, pages in (("asc", ids[:4]), ("desc", [ids[4], ids[3], ids[2], ids[1]])):
        url = f"/api/v1/jobs?active=true&limit=2&order={order}"
        first = client.get(url)
        broker.cancel(first.json()[0]["id"])  # ends while the client reads the first page
        link = first.headers["Link"]
        assert "offset" not in link and f"after={first.json()[-1]['id']}" in link
        second = client.get(urljoin(url, link[1:link.index(">")]))
        assert [j["id"] for j in first.json() + second.json()] == pages, order
    r = client.get("/api/v1/jobs", params={"after": "no-such-job"})
    assert r.status_code == 404 and "no-such-job" in r.text
