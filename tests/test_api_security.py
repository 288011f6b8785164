"""The broker API against hostile and careless clients: body size limits enforced before the body is
read, the token checked before the body is parsed, finite numbers only, capped metrics, the broker's
clock for progress and finished jobs' tokens (the page's headers and who can reach what:
``test_api_page_security.py``)."""

from __future__ import annotations

import json
import math
import os
import re
import select
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from test_api import auth, broker, client, free_port  # noqa: F401 - fixtures
from test_sidecar import wait_for

from airflow_elastic_gpu.broker.api import create_app
from airflow_elastic_gpu.broker.api_guards import ApiLimits, parse_body
from airflow_elastic_gpu.broker.api_models import AckIn, FailIn, FinishIn, ProgressIn
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.states import JobStatus

MiB = 1024 * 1024
HOSTILE = "<img src=x onerror=document.title='XSS-'+document.domain>"


def running_job(broker: GpuBroker, name: str = "a"):  # noqa: F811
    job = broker.submit(JobSpec(name, "train", 1, 2, total_steps=100))
    broker.ack(job.id, 1)
    return job


# --------------------------------------------------------------------------- size limits


def test_a_declared_body_over_the_limit_gets_413_before_anything_else(broker, client):  # noqa: F811
    job = running_job(broker)
    huge = {"Content-Length": str(100 * MiB), "Content-Type": "application/json"}
    for headers in (huge, {**huge, **auth(job.token)}, {**huge, **auth("wrong")}):
        # TestClient sends the declared length with a short body: the server must not wait for the rest
        r = client.post(f"/api/v1/jobs/{job.id}/finish", headers=headers, content=b"{}")
        assert r.status_code == 413
        assert "larger than the 262144 bytes" in r.json()["detail"]
        assert r.headers["x-content-type-options"] == "nosniff"
        # the broker's own answer: an agent retries a 4xx without it (a proxy's), and a too large
        # finish was then never sent again without its metrics
        assert r.headers["x-elastic-gpu-broker"] == "1"
    assert broker.job(job.id).status.value == "running"


def test_a_streamed_body_over_the_limit_gets_413_and_changes_nothing(broker):  # noqa: F811
    job = running_job(broker)
    c = TestClient(create_app(broker, limits=ApiLimits(max_body_bytes=4096, max_metrics_bytes=1024)))

    def chunks():  # no Content-Length: the limit is counted as the body is read
        yield b'{"exit_code": 0, "metrics": {"x": "'
        for _ in range(10):
            yield b"a" * 1024
        yield b'"}}'

    r = c.post(f"/api/v1/jobs/{job.id}/finish", headers=auth(job.token), content=chunks())
    assert r.status_code == 413 and "4096 bytes" in r.json()["detail"]
    assert broker.job(job.id).status.value == "running"


def test_limits_are_checked_and_read_from_the_environment():
    assert ApiLimits.from_env({}) == ApiLimits(max_body_bytes=256 * 1024, max_metrics_bytes=16 * 1024)
    env = {"AIRFLOW_ELASTIC_GPU_API_MAX_BODY_BYTES": "65536", "AIRFLOW_ELASTIC_GPU_API_MAX_METRICS_BYTES": "100"}
    assert ApiLimits.from_env(env) == ApiLimits(max_body_bytes=65536, max_metrics_bytes=100)
    # a setting the command line replaces (broker serve --max-body-bytes) is not read
    malformed = {"AIRFLOW_ELASTIC_GPU_API_MAX_BODY_BYTES": "64k"}
    assert ApiLimits.from_env(malformed, given={"max_body_bytes": 65536}) == ApiLimits(65536, 16 * 1024)
    with pytest.raises(ValueError, match="AIRFLOW_ELASTIC_GPU_API_MAX_BODY_BYTES must be a positive integer"):
        ApiLimits.from_env({"AIRFLOW_ELASTIC_GPU_API_MAX_BODY_BYTES": "64k"})
    with pytest.raises(ValueError, match="max_body_bytes must be a positive integer"):
        ApiLimits(max_body_bytes=0)
    with pytest.raises(ValueError, match="must not exceed max_body_bytes"):
        ApiLimits(max_body_bytes=1000, max_metrics_bytes=2000)
    # a metrics limit above the body limit names where each came from, as a malformed one does
    with pytest.raises(ValueError, match=r"^\$AIRFLOW_ELASTIC_GPU_API_MAX_METRICS_BYTES \(2000\) must not exceed "
                                         r"--max-body-bytes \(1000\): the metrics travel in the body$"):
        ApiLimits.from_env({"AIRFLOW_ELASTIC_GPU_API_MAX_METRICS_BYTES": "2000"}, given={"max_body_bytes": 1000})
    with pytest.raises(ValueError, match=r"^--max-metrics-bytes \(300000\) must not exceed the default of "
                                         r"\[elastic_gpu\] api_max_body_bytes \(262144\)"):
        ApiLimits.from_env({}, given={"max_metrics_bytes": 300_000})
    with pytest.raises(ValueError, match=r"^--max-body-bytes must be a positive integer \(bytes\), got 0$"):
        ApiLimits.from_env({}, given={"max_body_bytes": 0})


# --------------------------------------------------------------------------- a real server process


class ServerProcess:
    """``airflow-elastic-gpu broker serve`` in a subprocess, as in production."""

    def __init__(self, url: str, port: int) -> None:
        self.port = port
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        env.pop("AIRFLOW_ELASTIC_GPU_UI_TOKEN", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "airflow_elastic_gpu.cli", "--broker-url", url, "broker", "serve",
             "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)


@pytest.fixture
def server(tmp_path, broker):  # noqa: F811
    s = ServerProcess(str(broker.engine.url), free_port())

    def up() -> bool:
        try:
            s.connect().close()
            return True
        except OSError:
            assert s.proc.poll() is None, s.proc.stdout.read().decode()
            return False

    wait_for(up, 60, "broker serve to listen")
    yield s
    s.proc.terminate()
    s.proc.wait(10)


def send_headers(sock: socket.socket, path: str, headers: dict[str, str]) -> None:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    sock.sendall("\r\n".join(lines).encode())


def answered(sock: socket.socket, within_s: float) -> bytes | None:
    """The server's answer if it comes within ``within_s`` seconds, else None."""
    if not select.select([sock], [], [], within_s)[0]:
        return None
    return sock.recv(65536)


def stream(sock: socket.socket, total: int, chunked: bool) -> int:
    """Send up to ``total`` body bytes (1 MiB at a time, the same buffer: the client's memory stays
    flat); returns how many the server took before it closed the connection."""
    block = b"x" * MiB
    framed = b"%x\r\n%s\r\n" % (len(block), block) if chunked else block
    sent = 0
    try:
        while sent < total:
            sock.sendall(framed)
            sent += len(block)
        if chunked:
            sock.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent


def test_a_100_mb_unauthenticated_post_is_answered_before_its_body_is_sent(server, broker):  # noqa: F811
    job = running_job(broker)
    path = f"/api/v1/jobs/{job.id}/finish"
    with server.connect() as warm:  # the first request migrates and warms up; measure after it
        send_headers(warm, path, {"Content-Length": "2", "Authorization": "Bearer wrong"})
        warm.sendall(b"{}")
        assert b" 403 " in answered(warm, 30)
    before = server.rss_bytes()

    with server.connect() as sock:  # declared 100 MB: 413 at once, nothing read
        send_headers(sock, path, {"Content-Length": str(100 * MiB), "Content-Type": "application/json"})
        head = answered(sock, 10)
        assert head is not None and head.startswith(b"HTTP/1.1 413 "), head
        stream(sock, 100 * MiB, chunked=False)  # a client that sends it anyway

    with server.connect() as sock:  # streamed without a length, no token: 401 before the body
        send_headers(sock, path, {"Transfer-Encoding": "chunked", "Content-Type": "application/json"})
        head = answered(sock, 10)
        assert head is not None and head.startswith(b"HTTP/1.1 401 "), head
        stream(sock, 100 * MiB, chunked=True)

    with server.connect() as sock:  # streamed with the job's token: cut off at the limit
        send_headers(sock, path, {"Transfer-Encoding": "chunked", "Authorization": f"Bearer {job.token}"})
        sent, head = 0, None
        while head is None and sent < 100 * MiB:
            sent += stream(sock, MiB, chunked=True)
            head = answered(sock, 0.05)
        assert head is not None and head.startswith(b"HTTP/1.1 413 "), head
        assert sent <= 8 * MiB  # answered as soon as the limit (256 KiB) was passed, give or take buffers

    grew = server.rss_bytes() - before
    assert grew < 8 * MiB, f"the server grew by {grew / MiB:.1f} MiB"
    assert broker.job(job.id).status.value == "running"


# --------------------------------------------------------------------------- token before body


@pytest.mark.parametrize("body", [b"{", b"\xff\xfe", b'{"exit_code": NaN}', b"[" * 10_000, b""])
def test_the_token_is_checked_before_the_body_is_parsed(broker, client, body):  # noqa: F811
    job = running_job(broker)
    other = running_job(broker, "b")
    for path in ("progress", "ack", "finish", "fail"):
        url = f"/api/v1/jobs/{job.id}/{path}"
        assert client.post(url, content=body).status_code == 401
        assert client.post(url, content=body, headers=auth("wrong")).status_code == 403
        assert client.post(url, content=body, headers=auth(other.token)).status_code == 403
        assert client.post(url, content=body, headers=auth(job.token)).status_code == 422


# --------------------------------------------------------------------------- malformed bodies


@pytest.mark.parametrize(("path", "body", "message"), [
    ("progress", b'{"step": NaN}', "NaN is not a finite number"),
    ("progress", b'{"step": Infinity}', "Infinity is not a finite number"),
    ("progress", b'{"step": -Infinity}', "-Infinity is not a finite number"),
    ("progress", b'{"step": 1e400}', "1e400 is not a finite number"),
    ("progress", b'{"step": 1, "time_s": NaN}', "NaN is not a finite number"),
    ("progress", b'{"step": 1e16}', "less than or equal to 9007199254740992"),
    ("progress", b'{"step": 1, "generation": 99999999999}', "less than or equal to 2147483647"),
    ("finish", b'{"metrics": {"loss": NaN}}', "NaN is not a finite number"),
    ("finish", b'{"metrics": {"curve": [1, 2, {"x": 1e999}]}}', "1e999 is not a finite number"),
    ("finish", b'{"metrics": {"n": 1' + b"0" * 400 + b"}}", "metrics['n'] is not a finite number"),
    ("finish", b'{"metrics": {"n": 1' + b"0" * 5000 + b"}}", "JSON decode error"),
    ("fail", b'{"reason": "x", "metrics": {"loss": Infinity}}', "Infinity is not a finite number"),
    ("finish", b'{"metrics": ' + b'{"a": ' * 40 + b"1" + b"}" * 41, "nests deeper than 32 levels"),
    ("finish", b"[" * 10_000 + b"]" * 10_000, "JSON decode error"),
    ("finish", b"", "JSON decode error"),
    ("finish", b"\xff\xfe\xfd", "JSON decode error"),
    ("finish", b"{'exit_code': 0}", "JSON decode error"),
    ("finish", b"[]", "valid dictionary"),
    ("finish", b"null", "valid dictionary"),
    ("finish", b'"finished"', "valid dictionary"),
    ("ack", b'{"generation": 1.5}', "valid integer"),
    ("fail", b'{"reason": "' + b"x" * 20_001 + b'"}', "at most 20000 characters"),
    ("fail", b'{"reason": "a\\u0000b"}', "must not contain NUL"),
    ("fail", b'{"reason": "x", "metrics": {"log": ["ok", "a\\u0000"]}}', "must not contain NUL"),
    ("finish", b'{"metrics": {"k\\u0000": 1}}', "must not contain NUL"),
    ("finish", b'{"metrics": {"k\\ud800": 1}}', "lone surrogate"),
    ("progress", b'{"step": 1, "\\udfff": 2}', "lone surrogate"),
    # pydantic's lax mode read these as numbers (true as 1) and stored them
    ("progress", b'{"step": true}', "valid number"),
    ("progress", b'{"step": "12.5"}', "valid number"),
    ("progress", b'{"step": 1, "generation": true}', "valid integer"),
    ("progress", b'{"step": 1, "generation": "1"}', "valid integer"),
    ("ack", b'{"generation": "1"}', "valid integer"),
    ("fail", b'{"reason": "x", "exit_code": true}', "valid integer"),
    ("fail", b'{"reason": "   "}', "should match pattern"),
    ("fail", b'{"reason": 1}', "valid string"),
])
def test_every_malformed_body_gets_422_and_changes_nothing(broker, client, clock, path, body, message):  # noqa: F811
    job = running_job(broker)
    clock.advance(30)  # GPU-seconds held so far: a body that reset the accounting would show
    before = broker.job(job.id)
    assert before.gpu_seconds > 0
    r = client.post(f"/api/v1/jobs/{job.id}/{path}", content=body,
                    headers={**auth(job.token), "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    errors = r.json()["detail"]
    assert errors[0]["loc"][0] == "body" and any(message in e["msg"] for e in errors), errors
    assert all("input" not in e for e in errors)  # the body is not echoed back
    assert broker.job(job.id) == before


FIELDS = st.sampled_from(["step", "generation", "time_s", "exit_code", "reason", "metrics", "accuracy"])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(FIELDS | st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(body=st.binary(max_size=64) | JSON_VALUES.map(lambda v: json.dumps(v).encode()),
       model=st.sampled_from([ProgressIn, AckIn, FinishIn, FailIn]))
def test_any_body_is_a_model_with_finite_numbers_or_a_sendable_422(body, model):
    try:
        parsed = parse_body(body, model)
    except RequestValidationError as exc:
        json.dumps(jsonable_encoder({"detail": exc.errors()}), allow_nan=False).encode()  # the 422 can be sent
    else:
        json.dumps(parsed.model_dump(), allow_nan=False).encode()  # finite numbers, valid text


@pytest.fixture
def db_broker(broker_url):
    """A broker on SQLite, and on PostgreSQL when the test server answers."""
    b = GpuBroker(broker_url)
    b.register_node("n0", 4)
    yield b
    b.engine.dispose()


@pytest.mark.parametrize(("path", "body"), [
    ("fail", b'{"reason": "trainer died\\u0000"}'),
    ("fail", b'{"reason": "x", "metrics": {"loss": NaN}}'),
    ("finish", b'{"metrics": {"k\\u0000": 1}}'),
    ("finish", b'{"metrics": {"n": 1' + b"0" * 400 + b"}}"),
    ("finish", b'{"metrics": {"k": "\\udc80"}}'),
    ("progress", b'{"step": 1e300}'),
])
def test_bad_reports_get_422_on_both_databases(db_broker, path, body):
    job = running_job(db_broker)
    c = TestClient(create_app(db_broker), raise_server_exceptions=False)
    r = c.post(f"/api/v1/jobs/{job.id}/{path}", content=body, headers=auth(job.token))
    assert r.status_code == 422, r.text
    assert db_broker.job(job.id).status.value == "running"


def test_odd_but_valid_metrics_are_stored_and_read_back_alike_on_both_databases(db_broker):
    job = running_job(db_broker)
    c = TestClient(create_app(db_broker), raise_server_exceptions=False)
    metrics = {"accuracy": HOSTILE, "max": 1.7976931348623157e308, "tiny": 5e-324, "neg_zero": -0.0,
               "big_int": 2**63, "text": "\u2028\u2029\U0001f525 \\ \" '", "nested": {"a": [1, None, True, "x"]}}
    r = c.post(f"/api/v1/jobs/{job.id}/finish", headers=auth(job.token), json={"metrics": metrics})
    assert r.status_code == 200, r.text
    assert r.json()["metrics"] == metrics
    assert c.get(f"/api/v1/jobs/{job.id}").json()["metrics"] == metrics


def test_metrics_over_the_cap_get_422_naming_the_size(broker, client):  # noqa: F811
    job = running_job(broker)
    fits = {"history": "x" * (16 * 1024 - 20)}
    too_big = {"history": "x" * (16 * 1024)}
    r = client.post(f"/api/v1/jobs/{job.id}/finish", headers=auth(job.token), json={"metrics": too_big})
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "metrics"]
    assert "more than the 16384 allowed" in r.json()["detail"][0]["msg"]
    r = client.post(f"/api/v1/jobs/{job.id}/fail", headers=auth(job.token), json={"reason": "x", "metrics": too_big})
    assert r.status_code == 422
    assert broker.job(job.id).status.value == "running"
    r = client.post(f"/api/v1/jobs/{job.id}/finish", headers=auth(job.token), json={"metrics": fits})
    assert r.status_code == 200 and r.json()["metrics"] == fits


def test_the_metrics_cap_is_configurable(broker):  # noqa: F811
    job = running_job(broker)
    c = TestClient(create_app(broker, limits=ApiLimits(max_metrics_bytes=64)))
    r = c.post(f"/api/v1/jobs/{job.id}/finish", headers=auth(job.token), json={"metrics": {"x": "y" * 60}})
    assert r.status_code == 422 and "more than the 64 allowed" in r.json()["detail"][0]["msg"]


# --------------------------------------------------------------------------- time and throughput


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_progress_is_timed_by_the_brokers_clock_not_the_clients(tmp_path):
    clock = Clock(1_000_000.0)
    b = GpuBroker(f"sqlite:///{tmp_path / 'broker.db'}", clock=clock)
    b.register_node("n0", 4)
    c = TestClient(create_app(b))
    job = running_job(b)
    url = f"/api/v1/jobs/{job.id}/progress"
    # a client claiming the far future, then the far past, then the same instant twice
    for step, time_s, advance in ((0, 1e12, 10.0), (100, 0.0, 10.0), (200, 1e12, 0.0), (300, 1e12, 10.0)):
        assert c.post(url, headers=auth(job.token), json={"step": step, "generation": 1, "time_s": time_s}
                      ).status_code == 204
        clock.now += advance
    out = c.get(f"/api/v1/jobs/{job.id}")
    assert "Infinity" not in out.text and "NaN" not in out.text
    [(num_gpus, steps_per_s)] = out.json()["throughput"]
    assert num_gpus == 2 and math.isfinite(steps_per_s) and 9.0 <= steps_per_s <= 20.0


def test_a_non_finite_throughput_never_reaches_the_json(broker, client):  # noqa: F811
    job = running_job(broker)
    # the database path (a local agent) can still give its own times: a forged pair of samples
    broker.progress(job.id, 0.0, generation=1, time_s=1e-300)
    broker.progress(job.id, 1e308, generation=1, time_s=2e-300)
    assert broker.job(job.id).throughput == ()  # an infinite speed is no sample (throughput.SPEED_RANGE)
    for path in (f"/api/v1/jobs/{job.id}", "/api/v1/jobs", "/api/v1/pools/default/snapshot"):
        text = client.get(path).text
        assert "Infinity" not in text and "NaN" not in text and "null]" not in text
    assert client.get(f"/api/v1/jobs/{job.id}").json()["throughput"] == []


# --------------------------------------------------------------------------- a finished job's token


def test_a_finished_jobs_token_changes_nothing(broker, client):  # noqa: F811
    job = running_job(broker)
    url = f"/api/v1/jobs/{job.id}"
    done = client.post(f"{url}/finish", headers=auth(job.token), json={"metrics": {"accuracy": 0.9}})
    assert done.status_code == 200 and done.json()["status"] == "succeeded"
    for path, body in (("progress", {"step": 99}), ("ack", {"generation": 1})):
        r = client.post(f"{url}/{path}", headers=auth(job.token), json=body)
        assert r.status_code == 403 and "has ended (succeeded)" in r.json()["detail"]
    # a retried end report is answered with the job as it ended, and changes nothing
    again = client.post(f"{url}/finish", headers=auth(job.token), json={"metrics": {"accuracy": 0.1}})
    assert again.status_code == 200 and again.json()["metrics"] == {"accuracy": 0.9}
    late = client.post(f"{url}/fail", headers=auth(job.token), json={"reason": "late"})
    assert late.status_code == 200 and late.json()["status"] == "succeeded" and late.json()["reason"] != "late"
    # a running agent still learns that the job ended, so it stops its trainer
    beat = client.post(f"{url}/heartbeat", headers=auth(job.token))
    assert beat.status_code == 200 and beat.json()["status"] == "succeeded" and beat.json()["gpus"] == []
    assert broker.job(job.id).steps_done == done.json()["steps_done"]


def test_a_finish_is_a_clean_exit_only(broker, client):  # noqa: F811
    """``finish`` with exit code 137 recorded a SUCCEEDED job (a LOST one too): a trainer that
    exited otherwise is a failure, which ``fail`` reports."""
    from airflow_elastic_gpu.broker.types import InvalidRequest

    job = running_job(broker)
    r = client.post(f"/api/v1/jobs/{job.id}/finish", headers=auth(job.token), json={"exit_code": 137})
    assert r.status_code == 422 and broker.job(job.id).status is JobStatus.RUNNING
    with pytest.raises(InvalidRequest, match="finish is a clean exit .*got exit_code=1"):
        broker.finish(job.id, 1)
    assert broker.job(job.id).status is JobStatus.RUNNING
    ok = client.post(f"/api/v1/jobs/{job.id}/finish", headers=auth(job.token), json={"exit_code": 0})
    assert ok.status_code == 200 and ok.json()["status"] == "succeeded"


def test_a_cancelled_jobs_token_cannot_report_progress(broker, client):  # noqa: F811
    job = running_job(broker)
    broker.cancel(job.id)
    r = client.post(f"/api/v1/jobs/{job.id}/progress", headers=auth(job.token), json={"step": 5})
    assert r.status_code == 403 and "has ended (cancelled)" in r.json()["detail"]
    assert client.get(f"/api/v1/jobs/{job.id}/target", headers=auth(job.token)).json()["status"] == "cancelled"


@pytest.mark.parametrize(("method", "path", "code"), [
    ("post", "/api/v1/jobs/{id}%00/heartbeat", 403),
    ("get", "/api/v1/jobs/{id}%00/target", 403),
    ("post", "/api/v1/jobs/{id}%00/finish", 403),
    ("get", "/api/v1/jobs/{id}%00", 404),
    ("get", "/api/v1/pools/default%00/snapshot", 404),
    ("get", "/api/v1/jobs?pool=default%00", 422),
    ("get", "/api/v1/events?job_id={id}%00", 422),
    ("get", "/api/v1/events?pool=default%00", 422),
])
def test_a_nul_in_a_job_id_or_pool_is_refused_before_the_database_on_both_databases(db_broker, method, path, code):
    """PostgreSQL refuses NUL in text: ``%00`` in a job id or a pool was a 500, without any token."""
    job = running_job(db_broker)
    c = TestClient(create_app(db_broker), raise_server_exceptions=False)
    r = c.request(method, path.format(id=job.id), headers=auth(job.token), content=b"{}")
    assert r.status_code == code, r.text
    if code == 403:  # without a token it is still the token that is missing
        assert c.request(method, path.format(id=job.id), content=b"{}").status_code == 401
    assert db_broker.job(job.id).status.value == "running"


def test_progress_of_a_generation_not_yet_published_gets_422_and_is_not_stored(broker, client):  # noqa: F811
    """Its sample would pair with the real generation's first report: no restart overhead measured,
    and a throughput across the publication."""
    job = running_job(broker)
    r = client.post(f"/api/v1/jobs/{job.id}/progress", json={"step": 5, "generation": 2}, headers=auth(job.token))
    assert r.status_code == 422 and "generation 2 of job" in r.text and "its latest is 1" in r.text, r.text
    assert broker.job(job.id).steps_done == 0
    assert client.post(f"/api/v1/jobs/{job.id}/progress", json={"step": 5, "generation": 1},
                       headers=auth(job.token)).status_code == 204


def test_a_request_without_a_token_gets_401_even_when_the_database_is_away(tmp_path):
    """The broker (a migration on first use) was made before the credentials were looked at: 500."""
    c = TestClient(create_app(broker_url=f"sqlite:///{tmp_path / 'no' / 'such' / 'dir.db'}"),
                   raise_server_exceptions=False)
    r = c.post("/api/v1/jobs/abc/heartbeat")
    assert r.status_code == 401 and "missing bearer token" in r.text
    assert c.post("/api/v1/jobs/abc/heartbeat", headers=auth("some-token")).status_code == 500
