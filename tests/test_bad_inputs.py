"""The bad-input catalogue: every public entry point with malformed, missing, out-of-range and
hostile values gets an error that names the problem, and changes nothing.

More of the catalogue lives next to each feature: JobSpec fields
(``test_broker.py::test_bad_submit_is_rejected_with_a_clear_message_and_changes_nothing``),
operator arguments (``test_airflow.py::test_bad_operator_arguments_fail_at_dag_parse_time``),
trace CSVs and simulator parameters (``test_simulator.py``), the broker URL
(``test_broker.py::test_bad_broker_url_is_a_clear_error``).
"""

from __future__ import annotations

import json
import math

import pytest

from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import InvalidRequest, JobSpec, NotFound
from airflow_elastic_gpu.cli import main as cli


@pytest.fixture
def broker(broker_url):
    """A broker with one 2-GPU node, on SQLite and on PostgreSQL: both must answer alike."""
    b = GpuBroker(broker_url)
    b.register_node("n0", 2)
    yield b
    b.engine.dispose()


def state(b: GpuBroker) -> tuple:
    """Everything a bad call must leave unchanged."""
    return (tuple(b.jobs()), tuple(b.nodes()), tuple(e.id for e in b.events()), tuple(b.pools()))


HOSTILE_NAME = "x'); DROP TABLE job; --"


@pytest.mark.parametrize(("spec", "message"), [
    (dict(min_gpus="2"), "min_gpus must be an integer >= 1, got '2'"),
    (dict(min_gpus=True), "min_gpus must be an integer >= 1, got True"),
    (dict(max_gpus=1.5), "max_gpus must be an integer >= 1, got 1.5"),
    (dict(min_gpus=10**12, max_gpus=10**12), "min_gpus must be at most 2147483647"),
    (dict(min_gpus=3, max_gpus=3), "more than GPU pool 'default' has"),
    (dict(total_steps=None), "total_steps must be an integer >= 1, got None"),
    (dict(command="   "), "command must not be empty"),
    ({"command": "python -c 'x"}, "does not parse (as a shell would split it): No closing quotation"),
    ({"checkpoint_dir": "ckpt"}, "checkpoint_dir 'ckpt' must be an absolute path"),
    ({"relative_speed": {"A": 1e-300, "B": 1e300}}, "the fastest type may be at most 1000 times the slowest, got inf"),
    (dict(name=""), "name must not be empty"),
    ({"family": " "}, "family must not be empty"),
    ({"family": "f" * 257}, "family must be at most 256 characters, got 257"),
    (dict(progress_pattern="(?P<step>"), "not a valid regex"),
    (dict(backend="../../bin/sh"), "backend must be one of local, kubernetes, simulated"),
    # what the database would refuse (PostgreSQL) or store silently (SQLite): refused alike, by name
    (dict(name="n" * 257), "name must be at most 256 characters, got 257"),
    (dict(key="k" * 513), "key must be at most 512 characters, got 513"),
    (dict(key=""), "key must not be empty"),
    (dict(pool="p" * 129), "pool must be at most 128 characters, got 129"),
    (dict(name="a\x00b"), "name must not contain NUL characters"),
    (dict(command="python\x00 x.py"), "command must not contain NUL characters"),
    (dict(priority=2**31), "priority must be at most 2147483647"),
    (dict(priority="high"), "priority must be an integer"),
    (dict(total_steps=2**31), "total_steps must be at most 2147483647"),
])
def test_submit_rejects_bad_fields_and_changes_nothing(broker, spec, message):
    before = state(broker)
    fields = {"name": "job", "command": "python train.py", "min_gpus": 1, "max_gpus": 2, "total_steps": 10}
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        broker.submit(JobSpec(**{**fields, **spec}))
    assert state(broker) == before


def test_hostile_text_is_stored_verbatim_and_harms_nothing(broker):
    job = broker.submit(JobSpec(HOSTILE_NAME, "python train.py; rm -rf /", 1, 1, total_steps=5,
                                key="../../etc/passwd"))
    assert broker.job(job.id).name == HOSTILE_NAME
    assert broker.job_by_key("../../etc/passwd").id == job.id
    assert len(broker.jobs()) == 1 and broker.nodes()[0].name == "n0"


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda b: b.register_node("", 2), InvalidRequest, "node name must not be empty"),
    (lambda b: b.register_node("n1", 0), InvalidRequest, "num_gpus must be an integer >= 1, got 0"),
    (lambda b: b.register_node("n1", -3), InvalidRequest, "num_gpus must be an integer >= 1, got -3"),
    (lambda b: b.register_node("n1", 2, pool=""), InvalidRequest, "GPU pool name must not be empty"),
    (lambda b: b.set_node_schedulable("ghost", False), NotFound, "unknown node 'ghost'"),
    (lambda b: b.configure_pool(policy="tiresias"), InvalidRequest, "preempts running jobs"),
    (lambda b: b.configure_pool(policy_params={"hysteresis": -1}), InvalidRequest, "hysteresis must be a number >= 0"),
    (lambda b: b.configure_pool(policy_params={"warp": 9}), InvalidRequest,
     "bad parameters for policy 'adaptive': unknown 'warp'; its parameters: hysteresis, min_resize_interval_s"),
    (lambda b: b.pool_settings("nope"), NotFound, "unknown GPU pool 'nope'; known pools: default"),
    (lambda b: b.configure_pool(rebalance_interval_s=-1), InvalidRequest, r"rebalance_interval_s must be a number of seconds in \(0, "),
    (lambda b: b.configure_pool("nope"), NotFound, "unknown GPU pool 'nope'"),
    (lambda b: b.configure_pool(rebalance_interval_s="5"), InvalidRequest, "rebalance_interval_s must be a number"),
    (lambda b: b.configure_pool(lease_s=math.inf), InvalidRequest, "lease_s must be a number of seconds"),
    (lambda b: b.configure_pool(lease_s=math.nan), InvalidRequest, "lease_s must be a number of seconds"),
    (lambda b: b.register_node("x" * 254, 2), InvalidRequest, "node name must be at most 253 characters"),
    (lambda b: b.register_node("n1", 2, pool="p" * 129), InvalidRequest, "GPU pool name must be at most 128"),
    (lambda b: b.register_node("n1", 2, pool="team/a"), InvalidRequest, "GPU pool name must not contain '/'"),
    (lambda b: b.register_node("n1", 2, pool="team-a "), InvalidRequest,
     "GPU pool name must not start or end with a space"),
    (lambda b: b.register_node("n1", gpu_indices=[2**40]), InvalidRequest, "GPU index must be at most 1023"),
    (lambda b: b.register_node("n1", 1_000_000), InvalidRequest, "num_gpus must be at most 1024"),
    (lambda b: b.register_node("n\x001", 2), InvalidRequest, "node name must not contain NUL"),
    (lambda b: b.register_node("n1", 2, gpu_type="t" * 129), InvalidRequest, "gpu_type must be at most 128"),
    # out-of-service indices that are not the node's were dropped without a word
    (lambda b: b.register_node("n1", 2, out_of_service=[5]), InvalidRequest, "has no GPU 5 to put out of service"),
    (lambda b: b.register_node("n1", gpu_indices=3), InvalidRequest, "GPU indices must be a list of integers, got 3"),
    (lambda b: b.set_gpus_healthy("n0", 1, False), InvalidRequest, "GPU indices must be a list of integers, got 1"),
    (lambda b: b.set_gpus_healthy("n0", [True], False), InvalidRequest, "GPU index must be an integer >= 0, got True"),
    (lambda b: b.progress("no-such-job", 1.0), NotFound, "unknown job"),
    (lambda b: b.ack("no-such-job", 1), NotFound, "unknown job"),
    (lambda b: b.finish("no-such-job"), NotFound, "unknown job"),
    (lambda b: b.cancel("no-such-job"), NotFound, "unknown job"),
    (lambda b: b.job("no-such-job"), NotFound, "unknown job"),
])
def test_broker_calls_with_bad_arguments_name_the_problem_and_change_nothing(broker, call, error, message):
    before = state(broker)
    with pytest.raises(error, match=message):
        call(broker)
    assert state(broker) == before


def test_parameters_given_alone_are_checked_against_the_pools_own_policy(broker):
    """A static pool's parameters are static's: adaptive's hysteresis would have been stored and
    then failed every rebalance of the pool."""
    broker.configure_pool(policy="static")
    before = state(broker)
    with pytest.raises(InvalidRequest, match="bad parameters for policy 'static'"):
        broker.configure_pool(policy_params={"hysteresis": 1.0})
    assert state(broker) == before
    assert broker.pool_settings() == ("static", {})
    job = broker.submit(JobSpec("j", "python train.py", 1, 2, total_steps=5))
    assert len(broker.job(job.id).target_gpus) == 2  # the pool still schedules, on its request


@pytest.mark.parametrize("step", [-1.0, math.nan, math.inf])
def test_progress_rejects_impossible_steps(broker, step):
    job = broker.submit(JobSpec("j", "python train.py", 1, 1, total_steps=5))
    with pytest.raises(InvalidRequest, match="step must be a finite number >= 0"):
        broker.progress(job.id, step)
    assert broker.job(job.id).steps_done == 0


@pytest.mark.parametrize(("argv", "message"), [
    (["nodes", "add", "gpu-1"], "--gpus"),
    (["pool", "--param", "hysteresis"], "NAME=VALUE"),
    (["pool", "--policy", "fifo"], "unknown scheduling policy 'fifo'; the broker runs adaptive, optimus, static, termination"),
    (["pool", "--param", "name=1"], "bad parameters for policy 'adaptive': unknown 'name'"),
    (["pool", "--param", "hysteresis=abc"], "the value of hysteresis must be a finite number, true or false, got 'abc'"),
    (["pool", "--param", "hysteresis=true"], "hysteresis must be a number >= 0, got True"),  # was stored as True
    # what the policy is, not a setting: it was stored and shown, and changed nothing
    (["pool", "--param", "elastic=false"], "bad parameters for policy 'adaptive': unknown 'elastic'"),
    (["pool", "--policy", "optimus", "--param", "min_resize_interval_s=true"],
     "min_resize_interval_s must be a number of seconds >= 0, got True"),  # was stored as True
    (["pool", "--lease-s", "1"], "--lease-s must be at least 10 s, got 1"),  # fenced every trainer
    (["pool", "--rebalance-interval-s", "1e-06"], "--rebalance-interval-s must be at least 1 s"),
    (["pool", "--param", "type_aware=0"], "type_aware must be true or false, got 0"),
    (["status", "--pool", "nosuch"], "unknown GPU pool 'nosuch'; known pools: default"),
    (["jobs", "--pool", "nosuch"], "unknown GPU pool 'nosuch'"),
    (["run-local", "--total-steps", "10"], "command"),
    (["run-local", "--total-steps", "0", "--", "python", "x.py"], "total_steps must be an integer >= 1"),
    (["run-local", "--total-steps", "50", "--progress-pattern", r"step \d+", "--", "python", "x.py"],
     "must have a named group (?P<step>...)"),
    (["cancel", "no-such-job"], "unknown job"),
    (["run-local", "--max-gpus", "2", "--requested-gpus", "3", "--total-steps", "5", "--", "python", "x.py"],
     "requested_gpus (3) must lie between min_gpus (1) and max_gpus (2)"),
    (["simulate", "--trace", "missing.csv"], "does not exist"),
    (["simulate", "--trace", "missing.csv", "--policy", "adaptive,nope"],
     "unknown scheduling policy 'nope'; choose one of adaptive, afs_l, gavel"),
    (["simulate", "--trace", "missing.csv", "--policy", ","], "--policy names no policy: ','"),
    (["simulate", "--trace", "missing.csv", "--policy", "static", "--out", "o", "--timeline-policy", "adaptive"],
     "--timeline-policy 'adaptive' is not among --policy static"),
    (["workload", "--trace", "missing.csv", "--out", "w.csv"], "does not exist"),
    (["nodes", "add", "n9", "--gpus", "0"], "needs --gpus N, the node's GPU count (1 or more)"),  # not "num_gpus"
])
def test_cli_errors_name_the_problem_and_exit_2(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    GpuBroker(url).register_node("n0", 2)
    code = cli(["--broker-url", url, *argv])
    out = capsys.readouterr()
    assert code == 2
    assert message in out.out + out.err
    assert GpuBroker(url).jobs() == []


def test_cli_names_an_unreachable_database_in_one_line_with_the_password_masked(monkeypatch, capsys):
    import airflow_elastic_gpu.cli as cli_module

    monkeypatch.setattr(cli_module, "CLI_RECONNECT_DEADLINE_S", 1.0)
    code = cli(["--broker-url", "postgresql+psycopg://user:s3cret@127.0.0.1:1/broker", "jobs"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 2
    assert "cannot reach the broker database postgresql+psycopg://user:***@127.0.0.1:1/broker" in text
    assert "s3cret" not in text and "Traceback" not in text
    assert "$AIRFLOW_ELASTIC_GPU_BROKER_URL or [elastic_gpu] broker_url" in " ".join(text.split())
    # while it retries, it says so once (it sat silent for the whole deadline)
    assert out.err.count("the broker database does not answer; retrying for up to 1 s") == 1


def test_a_sqlite_broker_on_a_full_or_read_only_disk_is_not_said_to_be_a_server_away():
    """A full disk (``disk I/O error``) and a read-only one (``unable to open database file``) were
    told to check that "the server runs"."""
    from sqlalchemy.exc import OperationalError

    from airflow_elastic_gpu.cli_broker import database_error

    for cause in ("disk I/O error", "unable to open database file"):
        said = database_error(OperationalError("SELECT 1", {}, Exception(cause)), "sqlite:////data/b.db", None)
        assert said.startswith(f"cannot use the broker database sqlite:////data/b.db: {cause}. Check that its disk "
                               "has room and its files may be written")
    locked = database_error(OperationalError("SELECT 1", {}, Exception("database is locked")), "sqlite:///b.db", None)
    assert locked.startswith("the broker database is busy sqlite:///b.db: database is locked. Check that no process")
    full = database_error(OperationalError("INSERT", {}, Exception('could not extend file "base/1": No space left on '
                                                                   "device")), "postgresql+psycopg://db/b", None)
    assert "Check that its disk has room" in full
    away = database_error(OperationalError("SELECT 1", {}, Exception("connection refused")),
                          "postgresql+psycopg://u:secret@db/b", "elastic_gpu_default")
    assert away == ("cannot reach the broker database postgresql+psycopg://u:***@db/b: connection refused. Check "
                    "that the server runs and the URL (the Airflow connection 'elastic_gpu_default') is right.")


def test_cli_names_a_file_that_is_not_a_database_in_one_line(tmp_path, capsys):
    """SQLite's "file is not a database" is a DatabaseError, not the OperationalError the CLI caught:
    it ended in a traceback."""
    (tmp_path / "notadb.db").write_text("some other file\n")
    assert cli(["--broker-url", f"sqlite:///{tmp_path / 'notadb.db'}", "jobs"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"cannot use the broker database sqlite:///{tmp_path / 'notadb.db'}: file is not a database" in err
    assert "Traceback" not in err


def test_simulate_refuses_an_out_it_cannot_create_before_it_simulates(tmp_path, capsys, monkeypatch):
    from airflow_elastic_gpu.simulator.trace import TraceJob, write_trace

    trace = write_trace(tmp_path / "t.csv", [TraceJob("a", 0, 1, 60, "ncf")])
    (tmp_path / "file").write_text("")
    monkeypatch.setattr("airflow_elastic_gpu.simulator.engine.simulate",
                        lambda *a, **k: pytest.fail("simulated before --out was made"))
    assert cli(["simulate", "--trace", str(trace), "--policy", "static", "--out", str(tmp_path / "file" / "x")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--out {tmp_path / 'file' / 'x'}: cannot create the directory (Not a directory)" in err


def test_a_file_the_cli_cannot_write_is_one_line_not_a_traceback(tmp_path, capsys):
    from airflow_elastic_gpu.simulator.trace import TraceJob, write_trace

    trace = write_trace(tmp_path / "t.csv", [TraceJob(str(i), 60.0 * i, 1, 60, "ncf") for i in range(50)])
    (tmp_path / "file").write_text("")
    assert cli(["workload", "--trace", str(trace), "--gpus", "2", "--hours", "1",
                "--out", str(tmp_path / "file" / "w.csv")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "error:" in err and str(tmp_path / "file") in err and "Traceback" not in err


def test_broker_serve_rejects_a_port_out_of_range(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["broker", "serve", "--port", "99999"])
    assert exit_.value.code == 2
    assert "--port: must be between 1 and 65535, got 99999" in capsys.readouterr().err


def test_broker_serve_on_a_port_another_server_has_is_one_line_before_it_says_it_listens(tmp_path, capsys):
    """It said "broker API on http://..." first, then uvicorn's bind error, and exited with 3."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli(["--broker-url", f"sqlite:///{tmp_path / 'b.db'}", "broker", "serve", "--port", str(port)]) == 2
    captured = capsys.readouterr()
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use; give another --port" in captured.err
    assert "broker API on" not in captured.out


def test_broker_serve_refuses_a_database_it_cannot_use_before_it_listens(capsys, monkeypatch):
    """A bad or unreachable broker URL is one line and exit 2 at start-up: the server used to start,
    load its page and answer every API call with 500."""
    import airflow_elastic_gpu.cli as cli_module

    monkeypatch.setattr(cli_module, "CLI_RECONNECT_DEADLINE_S", 1.0)
    monkeypatch.setattr("uvicorn.run", lambda *a, **k: pytest.fail("the server started"))
    assert cli(["--broker-url", "foo://x", "broker", "serve"]) == 2
    assert "database 'foo' is not supported" in capsys.readouterr().err
    assert cli(["--broker-url", "postgresql+psycopg://nobody@127.0.0.1:1/none", "broker", "serve"]) == 2
    assert "cannot reach the broker database" in capsys.readouterr().err


def test_kube_sync_without_a_cluster_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-config"))
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # no in-cluster configuration either
    assert cli(["--broker-url", f"sqlite:///{tmp_path / 'b.db'}", "nodes", "kube-sync"]) == 2
    err = capsys.readouterr().err
    assert "no Kubernetes cluster to read through connection 'kubernetes_default'" in " ".join(err.split())
    assert "Traceback" not in err
    # a connection that is not defined, and a cluster that does not answer: a traceback of 49 and 102 lines
    url = f"sqlite:///{tmp_path / 'b.db'}"
    assert cli(["--broker-url", url, "nodes", "kube-sync", "--kubernetes-conn-id", "nosuch"]) == 2
    assert "no Airflow connection 'nosuch': define it" in capsys.readouterr().err
    (tmp_path / "kubeconfig").write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters:\n- name: c\n  cluster: {server: "
        "'https://127.0.0.1:1', insecure-skip-tls-verify: true}\ncontexts:\n- name: c\n  context: {cluster: c, "
        "user: u}\nusers:\n- name: u\n  user: {token: abc}\n")
    monkeypatch.setenv("AIRFLOW_CONN_KUBERNETES_DEFAULT", json.dumps(
        {"conn_type": "kubernetes", "extra": {"kube_config_path": str(tmp_path / "kubeconfig")}}))
    assert cli(["--broker-url", url, "nodes", "kube-sync"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the cluster of connection 'kubernetes_default' at https://127.0.0.1:1" in err
    assert "Traceback" not in err
    from kubernetes.client.exceptions import ApiException

    from airflow_elastic_gpu.backends import kubernetes_nodes

    def forbidden(*args, **kwargs):  # the connection's account may not list nodes
        raise ApiException(status=403, reason="Forbidden")

    monkeypatch.setattr(kubernetes_nodes, "register_nodes_from_cluster", forbidden)
    assert cli(["--broker-url", url, "nodes", "kube-sync"]) == 2
    assert "refused to list its nodes: 403 Forbidden" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    # a misspelled option before run-local's command is named, not swallowed into the command
    (["run-local", "--min_gpus", "1", "--total-steps", "50", "--", "python", "x.py"],
     "unknown option --min_gpus; did you mean --min-gpus?"),
    # an abbreviation is not taken for the option it starts
    (["run-local", "--max-gpu", "2", "--total-steps", "50", "--", "python", "x.py"],
     "unknown option --max-gpu; did you mean --max-gpus?"),
    (["--broker-ur", "sqlite://", "jobs"], "unknown option --broker-ur; did you mean --broker-url?"),
    (["jobs", "--activ"], "unknown option --activ; did you mean --active?"),
    (["simulate", "--trace", "w.csv", "--polcy", "static"], "unknown option --polcy; did you mean --policy?"),
    (["status", "--frobnicate"], "unknown option --frobnicate; see airflow-elastic-gpu status --help"),
    # the program's own option after the command: said where it goes, not "unknown"
    (["jobs", "--broker-url", "sqlite://"],
     "--broker-url goes before the command: airflow-elastic-gpu --broker-url ... jobs ..."),
])
def test_cli_names_an_unknown_option_and_the_nearest_known_one(tmp_path, capsys, argv, message):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    with pytest.raises(SystemExit) as exit_:
        cli(argv if argv[0].startswith("--broker") else ["--broker-url", url, *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "cli.db").exists()  # rejected before anything was opened


def test_run_local_leaves_the_words_of_its_command_alone(tmp_path, capsys):
    """Options of the training command, after ``--`` or after its first word, are not the CLI's."""
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    for command in (["--", "true", "--min_gpus", "-m"], ["true", "--max-gpu", "2"]):
        assert cli(["--broker-url", url, "run-local", "--total-steps", "5", "--detach", "--virtual-gpus", "1",
                    "--work-dir", str(tmp_path / "jobs"), *command]) == 0
    jobs = GpuBroker(url).jobs()
    assert sorted(j.command for j in jobs) == ["true --max-gpu 2", "true --min_gpus -m"]
    for j in jobs:
        GpuBroker(url).cancel(j.id)


@pytest.mark.parametrize(("argv", "blocked", "extra"), [
    (["broker", "serve"], "uvicorn", "[api]"),
    (["nodes", "kube-sync"], "airflow.providers.cncf.kubernetes.hooks.kubernetes", "[airflow]"),
])
def test_a_command_whose_extra_is_not_installed_names_the_extra(tmp_path, capsys, monkeypatch, argv, blocked, extra):
    import builtins

    real_import = builtins.__import__

    def missing(name, *args, **kwargs):
        if name == blocked:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", missing)
    assert cli(["--broker-url", f"sqlite:///{tmp_path / 'b.db'}", *argv]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"pip install 'airflow-elastic-gpu{extra}'" in err and "Traceback" not in err


def test_a_misspelt_command_is_named_with_the_nearest_one(capsys):
    for argv, message in ((["staus"], "unknown command 'staus'; did you mean status?"),
                          (["frob"], "unknown command 'frob'; choose one of broker, cancel"),
                          (["nodes", "lst"], "argument ACTION: invalid choice: 'lst'")):
        with pytest.raises(SystemExit) as done:
            cli(argv)
        assert done.value.code == 2 and message in capsys.readouterr().err


def test_a_pool_change_where_there_is_no_broker_makes_no_empty_database(tmp_path, monkeypatch, capsys):
    """``pool --lease-s 30`` with a mistyped ``$AIRFLOW_HOME`` failed on the unknown pool, but left an
    empty SQLite broker there, which later commands then read as a broker with no jobs."""
    for var in ("AIRFLOW_ELASTIC_GPU_BROKER_URL", "AIRFLOW__ELASTIC_GPU__BROKER_URL", "AIRFLOW_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "no-such-home"))
    assert cli(["pool", "--lease-s", "30"]) == 2
    assert "no broker database" in capsys.readouterr().err
    assert not (tmp_path / "no-such-home" / "elastic_gpu_broker.db").exists()


@pytest.mark.parametrize(("policy", "stored", "shown"), [
    ("adaptive", {"elastic": False, "hysteresis": 3}, "hysteresis=3"),  # a parameter no longer taken
    ("optimus", {"min_resize_interval_s": True}, "min_resize_interval_s=600.0"),  # a value no longer valid
])
def test_a_pool_whose_stored_settings_an_earlier_version_took_still_schedules(tmp_path, capsys, policy, stored,
                                                                             shown):
    """Settings stored before they were refused (``--param elastic=false`` was taken and changed
    nothing) made every rebalance of the pool fail: its jobs stayed queued, and ``pool`` showed the
    error. They are left out (or the policy's defaults serve), with a warning."""
    from sqlalchemy import update

    from airflow_elastic_gpu.broker.models import GpuPool

    url = f"sqlite:///{tmp_path / 'b.db'}"
    broker = GpuBroker(url)
    broker.register_node("n0", 2)
    with broker.engine.begin() as conn:
        conn.execute(update(GpuPool).values(policy=policy, policy_params=stored))
    job = broker.submit(JobSpec("queued", "python train.py", 1, 2, total_steps=10))
    broker.rebalance()
    assert broker.job(job.id).target_gpus
    assert cli(["--broker-url", url, "pool"]) == 0 and shown in capsys.readouterr().out
