"""Which broker the hook gives a connection that is defined but names no broker database: never a
SQLite file of this host's own (each worker would then hand out the same GPUs again)."""

from __future__ import annotations

import json

import pytest
from airflow.sdk import Connection

from airflow_elastic_gpu.hooks.broker import GpuBrokerHook

SECRET_URL = "postgresql+psycopg://u:s3cret@db/broker"


@pytest.fixture
def no_broker_url_set(monkeypatch, tmp_path):
    """Neither ``[elastic_gpu] broker_url`` nor its variables set; an empty ``$AIRFLOW_HOME``."""
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    for name in ("AIRFLOW_ELASTIC_GPU_BROKER_URL", "AIRFLOW__ELASTIC_GPU__BROKER_URL"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def hook_with(monkeypatch, connection: Connection | None) -> GpuBrokerHook:
    """A hook whose Airflow reads ``connection`` (``None``: not defined), as a secrets backend gives it."""
    from airflow.exceptions import AirflowNotFoundException

    def get_connection(cls, conn_id):
        if connection is None:
            raise AirflowNotFoundException(f"The conn_id `{conn_id}` isn't defined")
        return connection

    monkeypatch.setattr(GpuBrokerHook, "get_connection", classmethod(get_connection))
    return GpuBrokerHook()


@pytest.mark.parametrize(("extra", "named"), [
    (json.dumps({"broker_url": SECRET_URL, "pool": "a100"}), "only the keys 'broker_url', 'pool'"),
    ('{"url": "' + SECRET_URL, "not a JSON object"),  # Airflow logs it and reads {}
    ("", "its extra is empty"),
])
def test_a_connection_that_gives_no_url_is_an_error_naming_it_and_its_keys(monkeypatch, no_broker_url_set,
                                                                          extra, named):
    hook = hook_with(monkeypatch, Connection(conn_id="elastic_gpu_default", conn_type="elastic_gpu", extra=extra))
    with pytest.raises(ValueError) as err:
        hook.get_url()
    message = " ".join(str(err.value).split())
    assert "Airflow connection 'elastic_gpu_default' gives no broker database URL" in message
    assert named in message and "s3cret" not in message
    assert not (no_broker_url_set / "elastic_gpu_broker.db").exists()


@pytest.mark.parametrize("variable", ["AIRFLOW_ELASTIC_GPU_BROKER_URL", "AIRFLOW__ELASTIC_GPU__BROKER_URL"])
def test_a_connection_that_gives_no_url_takes_the_broker_url_set_for_every_worker(monkeypatch, no_broker_url_set,
                                                                                variable):
    monkeypatch.setenv(variable, "postgresql+psycopg://db/shared")
    hook = hook_with(monkeypatch, Connection(conn_id="elastic_gpu_default", conn_type="elastic_gpu",
                                             extra=json.dumps({"broker_url": SECRET_URL})))
    assert hook.get_url() == "postgresql+psycopg://db/shared"


def test_a_connection_from_the_environment_with_a_misspelt_key_is_an_error(monkeypatch, no_broker_url_set):
    monkeypatch.setenv("AIRFLOW_CONN_ELASTIC_GPU_DEFAULT", json.dumps(
        {"conn_type": "elastic_gpu", "extra": {"broker_url": SECRET_URL}}))
    with pytest.raises(ValueError, match="only the keys 'broker_url'"):
        GpuBrokerHook().get_url()


def test_a_connection_that_gives_its_url_in_the_field_or_the_host_uses_it(monkeypatch, no_broker_url_set):
    field = Connection(conn_id="elastic_gpu_default", conn_type="elastic_gpu", extra=json.dumps({"url": SECRET_URL}))
    assert hook_with(monkeypatch, field).get_url() == SECRET_URL
    older = Connection(conn_id="elastic_gpu_default", conn_type="elastic_gpu", host=SECRET_URL)
    assert hook_with(monkeypatch, older).get_url() == SECRET_URL


def test_a_connection_that_is_not_defined_still_falls_back_to_the_default_broker(monkeypatch, no_broker_url_set):
    """Airflow 3 reports a connection it could not read for a moment as not defined: the fallback
    there is deliberate (see ``GpuBrokerHook.connection``)."""
    hook = hook_with(monkeypatch, None)
    assert hook.get_url() == f"sqlite:///{no_broker_url_set / 'elastic_gpu_broker.db'}"


@pytest.mark.parametrize("uri", [
    "elastic-gpu://u:s3cret@db.example:6543/broker",  # the standard fields: PostgreSQL with psycopg
    "elastic-gpu://postgresql+psycopg://u:s3cret@db.example:6543/broker",  # Airflow's form for a host with a scheme
])
def test_a_uri_connection_keeps_its_login_password_port_and_database(monkeypatch, no_broker_url_set, uri):
    """A connection given as a URI (``AIRFLOW_CONN_...``, a secrets backend) comes as Airflow's
    standard fields: the hook's URL has every one of them, not the host alone."""
    from sqlalchemy.engine import make_url

    monkeypatch.setenv("AIRFLOW_CONN_ELASTIC_GPU_DEFAULT", uri)
    url = make_url(GpuBrokerHook().get_url())
    assert (url.drivername, url.username, url.password, url.host, url.port, url.database) == (
        "postgresql+psycopg", "u", "s3cret", "db.example", 6543, "broker")
    monkeypatch.setenv("AIRFLOW_CONN_ELASTIC_GPU_DEFAULT", json.dumps(
        {"conn_type": "elastic_gpu", "host": "sqlite:////data/broker.db"}))  # a whole URL in the host
    assert GpuBrokerHook().get_url() == "sqlite:////data/broker.db"


@pytest.mark.parametrize(("uri", "expected"), [
    ("elastic-gpu://u:pw@db:5432/broker?sslmode=require&pool=a100",  # TLS kept; pool is the connection's own
     "postgresql+psycopg://u:pw@db:5432/broker?sslmode=require"),
    ("elastic-gpu://u:pw@%5B%3A%3A1%5D:5432/broker", "postgresql+psycopg://u:pw@[::1]:5432/broker"),
    ("elastic-gpu://u:pw@[::1]:5432/broker", "postgresql+psycopg://u:pw@[::1]:5432/broker"),
    ("elastic-gpu://u:pw@%2Fvar%2Frun%2Fpostgresql/broker", "postgresql+psycopg://u:pw@/broker?host=%2Fvar%2Frun%2Fpostgresql"),
])
def test_a_uri_connection_keeps_its_query_and_an_ipv6_or_socket_host(monkeypatch, no_broker_url_set, uri, expected):
    from sqlalchemy.engine import make_url

    monkeypatch.setenv("AIRFLOW_CONN_ELASTIC_GPU_DEFAULT", uri)
    assert make_url(GpuBrokerHook().get_url()) == make_url(expected)


def test_a_broker_url_from_a_command_has_no_trailing_newline(monkeypatch, no_broker_url_set):
    """``[elastic_gpu] broker_url`` from ``_CMD`` (Airflow keeps the command's newline)."""
    monkeypatch.setenv("AIRFLOW__ELASTIC_GPU__BROKER_URL_CMD", "echo postgresql+psycopg://u:pw@db/broker")
    assert GpuBrokerHook("absent").get_url() == "postgresql+psycopg://u:pw@db/broker"


def test_a_host_that_is_no_url_is_named_as_the_connections(monkeypatch, no_broker_url_set):
    monkeypatch.setenv("AIRFLOW_CONN_ELASTIC_GPU_DEFAULT", json.dumps(
        {"conn_type": "elastic_gpu", "host": "postgresql+psycopg://db:notaport/broker"}))
    with pytest.raises(ValueError, match="connection 'elastic_gpu_default': its host is not a database URL"):
        GpuBrokerHook().get_url()


@pytest.mark.parametrize(("executor", "refused"), [
    ("LocalExecutor", False), ("CeleryExecutor", True), ("LocalExecutor,KubernetesExecutor", True),
    ("airflow.providers.celery.executors.celery_executor.CeleryExecutor", True),
    ("fast:airflow.executors.local_executor.LocalExecutor", False),
    ("LocalExecutor;team_a=LocalExecutor", False), ("LocalExecutor;team_a=CeleryExecutor", True),
])
def test_the_computed_sqlite_broker_is_refused_under_an_executor_of_several_machines(
        monkeypatch, no_broker_url_set, executor, refused):
    """No connection (or one Airflow could not read for a moment, which it reports as not defined)
    and no ``[elastic_gpu] broker_url``: each Celery worker made a SQLite broker of its own."""
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", executor)
    hook = hook_with(monkeypatch, None)
    if refused:
        with pytest.raises(ValueError, match=r"runs tasks on several machines.*Set \[elastic_gpu\] broker_url"):
            hook.get_url()
    else:
        assert hook.get_url() == f"sqlite:///{no_broker_url_set / 'elastic_gpu_broker.db'}"
    monkeypatch.setenv("AIRFLOW__ELASTIC_GPU__BROKER_URL", SECRET_URL)  # set: any executor
    assert hook_with(monkeypatch, None).get_url() == SECRET_URL
