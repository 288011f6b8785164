"""The agent and the launcher's pure parts, without processes: fence periods within the lease, the
log parser's refusal of non-finite steps, the classification of broker answers, and an agent that
drops rejected reports and stops its trainer once the broker no longer knows its job (the fencing
of real processes: ``test_fencing.py``)."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy.exc import OperationalError

from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.service import InvalidRequest, NotFound
from airflow_elastic_gpu.scheduling.state import GpuId
from airflow_elastic_gpu.sidecar import protocol
from airflow_elastic_gpu.sidecar.agent import Agent, Outcome, classify
from airflow_elastic_gpu.sidecar.http_transport import BrokerRejected, BrokerUnavailable, JobGone
from airflow_elastic_gpu.sidecar.logparse import LogParser, log_excerpt
from airflow_elastic_gpu.states import Target


def test_fence_periods_fit_in_the_lease():
    default = protocol.fence_periods(60.0)
    assert (default.fence_s, default.kill_s, default.lease_s) == (30.0, 54.0, 60.0)
    short = protocol.fence_periods(3.0)
    assert (short.fence_s, short.kill_s) == (1.5, 2.0)
    tiny = protocol.fence_periods(1.0)
    assert tiny.fence_s <= tiny.kill_s < tiny.lease_s
    assert protocol.fence_periods(60.0, fence_s=10.0, margin_s=5.0) == protocol.FencePeriods(60.0, 10.0, 55.0)
    with pytest.raises(ValueError, match="fence_s=58 leaves no time"):
        protocol.fence_periods(60.0, fence_s=58.0)
    with pytest.raises(ValueError, match="margin_s=60 must be shorter"):
        protocol.fence_periods(60.0, margin_s=60.0)
    with pytest.raises(ValueError, match="lease_s must be a finite number"):
        protocol.fence_periods(float("inf"))


def test_log_parser_drops_non_finite_steps(tmp_path):
    log = tmp_path / "train.log"
    log.write_text('{"step": 1}\n{"step": NaN}\n{"step": Infinity}\n{"step": 1e400}\n{"step": 2}\n'
                   '{"final": true, "step": 2, "accuracy": 0.5, "loss": NaN, '
                   '"per_class": [0.9, NaN, {"f1": -Infinity}]}\n')
    parser = LogParser()
    assert [s for _, s in parser.read(log)] == [1.0, 2.0, 2.0]
    # at any depth: one NaN in a list would make the broker refuse every metric of the report
    assert parser.metrics == {"final": True, "step": 2, "accuracy": 0.5, "loss": None,
                              "per_class": [0.9, None, {"f1": None}]}
    regex = tmp_path / "regex.log"
    regex.write_text("iter nan/100\niter inf/100\niter 7/100\n")
    assert [s for _, s in LogParser(__import__("re").compile(r"iter (\S+)/")).read(regex)] == [7.0]


def test_broker_answers_are_classified_as_ok_transient_rejected_or_ended():
    assert classify(NotFound("unknown job")) is Outcome.ENDED
    assert classify(JobGone("HTTP 403", 403)) is Outcome.ENDED
    assert classify(InvalidRequest("step must be finite")) is Outcome.REJECTED
    assert classify(BrokerRejected("HTTP 422", 422)) is Outcome.REJECTED
    assert classify(BrokerUnavailable("refused")) is Outcome.TRANSIENT
    assert classify(OperationalError("select 1", {}, Exception("the database system is shutting down"))) \
        is Outcome.TRANSIENT


class FlakyBroker:
    """A transport that fails the way a real broker can: unavailable at first, rejecting reports."""

    def __init__(self, outages: int = 2) -> None:
        self.outages = outages
        self.calls: list[tuple] = []

    def heartbeat(self, job_id: str) -> Target:
        self.calls.append(("heartbeat",))
        if self.outages:
            self.outages -= 1
            raise BrokerUnavailable("connection refused")
        return Target(job_id, JobStatus.RUNNING, 1, (GpuId("localhost", 0),))

    def progress(self, job_id, step, *, generation=None, time_s=None):
        self.calls.append(("progress", step, generation))
        if step < 0:
            raise InvalidRequest(f"step must be a finite number >= 0, got {step!r}")

    def ack(self, job_id, generation):
        self.calls.append(("ack", generation))
        raise BrokerRejected("HTTP 422: bad generation", 422)

    def finish(self, job_id, exit_code=0, metrics=None):
        self.calls.append(("finish", metrics))
        if metrics is not None:
            raise InvalidRequest("metrics too large")

    def fail(self, job_id, reason, exit_code=None, metrics=None):
        self.calls.append(("fail", reason))


def test_the_agent_drops_rejected_reports_and_reports_the_end_without_the_rejected_metrics(tmp_path):
    protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    log = tmp_path / protocol.LOG
    log.write_text(protocol.generation_line(1, "on GPUs [0]: x") + '{"step": -3}\n')
    broker = FlakyBroker()
    agent = Agent(broker, "job", tmp_path, poll_s=0.01, lease_s=3.0)

    def trainer_ends() -> None:
        with open(log, "a") as f:
            f.write('{"final": true, "step": 4, "accuracy": 1}\n')
        protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.EXITED, "exit_code": 0})

    threading.Timer(0.15, lambda: protocol.write_json(
        tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.RUNNING, "pid": None})).start()
    threading.Timer(0.4, trainer_ends).start()
    before = time.time()
    assert agent.run() == 0
    kinds = [c[0] for c in broker.calls]
    assert kinds[:3] == ["heartbeat"] * 3  # two outages ridden out
    assert broker.calls.count(("progress", -3.0, 1)) == 1  # rejected once, dropped, not retried
    assert broker.calls.count(("ack", 1)) == 1  # a rejected ack is not retried either
    assert ("progress", 4.0, 1) in broker.calls
    assert [c for c in broker.calls if c[0] == "finish"] == [("finish", {"final": True, "step": 4, "accuracy": 1}),
                                                            ("finish", None)]
    lease = protocol.read_json(tmp_path / protocol.LEASE)
    assert before <= lease["contact_s"] <= time.time()
    assert (lease["fence_s"], lease["kill_s"], lease["lease_s"]) == (1.5, 2.0, 3.0)
    assert "peer_wait_s" not in lease  # one agent for the whole job: no peers' agents to wait for


def test_the_agent_stops_the_trainer_when_the_broker_no_longer_knows_the_job(tmp_path):
    class Gone(FlakyBroker):
        def heartbeat(self, job_id):
            raise JobGone("HTTP 403: the token is not valid for this job", 403)

    protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    assert Agent(Gone(0), "job", tmp_path, poll_s=0.01, stop_timeout_s=0.2).run() == 0
    assert protocol.read_json(tmp_path / protocol.DESIRED)["stop"] is True
    assert not (tmp_path / protocol.LEASE).exists()  # no confirmed contact, ever


@pytest.mark.parametrize(("code", "headers", "raised"), [
    (404, ("x-elastic-gpu-broker", "x-elastic-gpu-job-answer"), JobGone),
    (404, (), BrokerUnavailable),  # a proxy's
    # the broker's, for a path it does not serve (a broker API URL one level too deep)
    (404, ("x-elastic-gpu-broker",), BrokerUnavailable),
    (400, ("x-elastic-gpu-broker",), BrokerRejected),
    (400, (), BrokerUnavailable),  # a proxy's: taken for rejected, an ack was never sent again
])
def test_a_404_stops_the_trainer_only_when_the_broker_itself_answered_about_the_job(code, headers, raised):
    """A proxy or ingress in front of the broker answers 404 while the API restarts: taken for "the
    job ended", that would stop a live trainer. Only the broker's own answer about the job counts
    (its headers); any other 4xx of a proxy is retried."""
    import http.server

    from airflow_elastic_gpu.sidecar.http_transport import HttpBrokerTransport

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_response(code)
            for header in headers:
                self.send_header(header, "1")
            self.end_headers()
            self.wfile.write(b"<html>404 Not Found</html>")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        transport = HttpBrokerTransport(f"http://127.0.0.1:{server.server_address[1]}", "token", timeout_s=5)
        with pytest.raises(raised, match=f"HTTP {code}"):
            transport.heartbeat("job")
    finally:
        server.shutdown()


@pytest.mark.parametrize("code", [301, 302, 307, 308])
def test_a_redirect_is_not_followed_with_the_token(code):
    """An ingress that redirects http to https (308), or any 3xx: urllib followed 301-303 to any
    host with the job's bearer token (as a GET), and took 307/308 for a refusal, dropping every
    heartbeat. The token never leaves for the redirect; the call is a transient failure that says
    where the redirect leads."""
    import http.server

    from airflow_elastic_gpu.sidecar.http_transport import BrokerUnavailable, HttpBrokerTransport

    seen: list[str | None] = []

    class Elsewhere(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)

    class Redirect(Elsewhere):
        def do_POST(self):
            self.send_response(code)
            self.send_header("Location", f"http://127.0.0.1:{other.server_address[1]}/api/v1/jobs/job/heartbeat")
            self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    for s in (server, other):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        transport = HttpBrokerTransport(f"http://127.0.0.1:{server.server_address[1]}", "SECRET", timeout_s=5)
        with pytest.raises(BrokerUnavailable, match=f"HTTP {code}, a redirect to 'http://127.0.0.1:"):
            transport.heartbeat("job")
        assert seen == []
    finally:
        server.shutdown()
        other.shutdown()


@pytest.mark.parametrize("written", [{}, {"exit_code": None}, {"exit_code": "0"}, {"exit_code": False}])
def test_an_exit_whose_code_cannot_be_read_is_reported_as_a_failure(tmp_path, written):
    """A ``status.json`` that says ``exited`` without an integer exit code (another launcher version,
    a hand edit) was taken for exit code 0: the job SUCCEEDED though nothing said the trainer had."""
    protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.EXITED, **written})
    broker = FlakyBroker(outages=0)
    assert Agent(broker, "job", tmp_path, poll_s=0.01, lease_s=3.0).run() == 0
    ends = [c for c in broker.calls if c[0] in ("finish", "fail")]
    assert ends == [("fail", "trainer exited with no readable exit code (status.json)")]


def test_a_gang_node_whose_exit_code_cannot_be_read_fails_the_gang(tmp_path):
    from airflow_elastic_gpu.sidecar.gang import Gang

    dirs = {}
    for node, state in (("a", {"state": protocol.EXITED}), ("b", {"state": protocol.EXITED, "exit_code": 0})):
        dirs[node] = tmp_path / node
        dirs[node].mkdir()
        protocol.write_json(dirs[node] / protocol.DESIRED, {"generation": 1, "gpus": [0], "nnodes": 2,
                                                             "node_rank": int(node == "b"), "stop": False})
        protocol.write_json(dirs[node] / protocol.STATUS, {"generation": 1, **state})
    status = Gang(dirs).status(1)
    assert (status["state"], status["exit_code"], status["node"]) == (protocol.EXITED, None, "a")
    assert [protocol.clean_exit(s) for s in Gang(dirs).statuses().values()] == [False, True]


def test_a_dead_launchers_failure_is_reported_with_a_log_tail_the_broker_takes(tmp_path):
    """The trainer's last lines go into the reason of a dead launcher's failure: a progress bar
    redrawn with ``\\r`` (one line of 30,000 characters) and a NUL made a reason the broker's API
    refuses (over 20,000 characters, or NUL: 422), and that report had no plain fallback, so the job
    held its GPUs for a lease and ended LOST with no reason. The tail is cut and cleaned now."""
    import subprocess

    class Strict(FlakyBroker):
        def heartbeat(self, job_id):
            return Target(job_id, JobStatus.RUNNING, 1, (GpuId("localhost", 0),))

        def fail(self, job_id, reason, exit_code=None, metrics=None):
            self.calls.append(("fail", reason))
            if len(reason) > 20_000 or "\x00" in reason:
                raise BrokerRejected("HTTP 422: reason", 422)

    dead = subprocess.Popen(["true"])
    dead.wait()
    protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.RUNNING, "pid": None,
                                                      "launcher_pid": dead.pid})
    (tmp_path / protocol.LOG).write_text(protocol.generation_line(1, "on GPUs [0]: x") + "epoch 1\n"
                                         + "\r".join(f"{i}%|\x00" for i in range(5000)) + "\n")
    broker = Strict(0)
    assert Agent(broker, "job", tmp_path, launcher_pid=dead.pid, poll_s=0.01, stop_timeout_s=1).run() == 1
    (reason,) = [c[1] for c in broker.calls if c[0] == "fail"]  # the first report was taken
    assert reason.startswith(f"the launcher (pid {dead.pid}) died") and "epoch 1" in reason
    assert len(reason) < 9_000 and "\x00" not in reason and reason.endswith("4999%|\ufffd")


def test_a_log_excerpt_cuts_each_line_and_the_whole():
    assert log_excerpt(["a", "b\x00"]) == "a\nb\ufffd"
    assert log_excerpt(["x" * 600], line_chars=500) == "x" * 500
    assert log_excerpt([str(i) * 100 for i in range(10)], total_chars=250) == \
        ("\n".join(str(i) * 100 for i in range(10)))[-250:]


def test_an_exit_is_reported_with_the_final_metrics_past_one_reads_worth_of_log(tmp_path, monkeypatch):
    """A trainer that printed more than one read's worth (READ_BYTES) before it exited: the exit
    was reported after one more read, without the final metrics line at the log's end."""
    from airflow_elastic_gpu.sidecar import logparse

    monkeypatch.setattr(logparse, "READ_BYTES", 4096)
    protocol.write_json(tmp_path / protocol.DESIRED, {"generation": 1, "gpus": [0], "stop": False})
    broker = FlakyBroker(outages=0)
    agent = Agent(broker, "job", tmp_path, poll_s=0.05, lease_s=3.0)
    done: list[int] = []
    runner = threading.Thread(target=lambda: done.append(agent.run()), daemon=True)
    runner.start()
    time.sleep(0.5)  # the agent runs; then the trainer prints a lot and exits between two polls
    (tmp_path / protocol.LOG).write_text(protocol.generation_line(1, "on GPUs [0]: x") + "".join(
        f'{{"step": {i}}}\n' for i in range(5000)) + '{"final": true, "step": 5000, "accuracy": 0.9}\n')
    protocol.write_json(tmp_path / protocol.STATUS, {"generation": 1, "state": protocol.EXITED, "exit_code": 0})
    runner.join(30)
    assert done == [0]
    assert next(c for c in broker.calls if c[0] == "finish") == ("finish", {"final": True, "step": 5000, "accuracy": 0.9})
    assert ("progress", 5000.0, 1) in broker.calls
