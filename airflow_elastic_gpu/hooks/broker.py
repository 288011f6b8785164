"""GpuBrokerHook: the Airflow connection to the GPU broker's own database.

Airflow 3 tasks may not use Airflow's metadata DB, so the broker has its own.
Its SQLAlchemy URL is read, in order, from:

1. the Airflow connection ``broker_conn_id`` (default ``elastic_gpu_default``,
   type ``elastic_gpu``): its *Broker database URL* field (extra ``{"url": ...}``), or its
   standard fields (host, login, password, port, schema: a URI such as
   ``elastic-gpu://user:pw@db:5432/broker``; a host holding a whole URL, as connections made before
   that field did);
2. :func:`airflow_elastic_gpu.config.default_broker_url`: ``[elastic_gpu] broker_url``
   (``$AIRFLOW_ELASTIC_GPU_BROKER_URL``), else a SQLite file ``elastic_gpu_broker.db`` in
   ``$AIRFLOW_HOME``. A connection that is defined but gives no URL (a malformed extra, a misspelt
   key) takes ``[elastic_gpu] broker_url`` only where that is set, and is an error otherwise.

The connection form (fields declared in :func:`airflow_elastic_gpu.get_provider_info`, as
``conn-fields``) also holds the *default GPU pool* (extra ``pool``) and the *broker API URL* that
training pods use (extra ``api_url``).

The hook owns one broker client (:attr:`GpuBrokerHook.broker`, made on first use, which creates or
migrates the schema), as ``KubernetesHook`` owns its API clients.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from airflow.sdk import BaseHook

from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.config import (
    airflow_conf,
    default_broker_api_url,
    default_broker_url,
    default_pool,
    get_option,
)
from airflow_elastic_gpu.get_provider_info import CONN_FIELDS, CONN_TYPE, HIDDEN_FIELDS

ONE_HOST_EXECUTORS = frozenset({"LocalExecutor", "SequentialExecutor", "DebugExecutor"})
"""Airflow executors that run every task on the scheduler's host."""


class NoBrokerConfigured(ValueError):
    """No connection and no ``[elastic_gpu] broker_url`` under an executor of several machines
    (:func:`_check_one_host`): a setting missing, or a connection Airflow could not read for a
    moment, which it reports as not defined (a trigger reads it again for a while)."""


def _check_one_host(conf: Any) -> None:
    """Refuse the computed default broker (a SQLite file in ``$AIRFLOW_HOME``) under an executor that
    runs tasks on several machines: each would have a broker of its own, and hand out the same GPUs
    again. Airflow 3 also reports a connection that it could not read for a moment (its API server
    away) as not defined, which made a worker of such a deployment fall back to that file.

    :raises NoBrokerConfigured: ``[core] executor`` names another executor (each of a list and of every
        team's, in any of its forms: ``CeleryExecutor``, ``alias:module.Class``, ``module.Class``)."""
    executors = (conf.get("core", "executor", fallback=None) if conf is not None else None) or "LocalExecutor"
    # "a,b" or, per team (Airflow 3's multi-team), "a;team1=b,c": every executor named
    items = [item for group in executors.split(";") for item in group.split("=", 1)[-1].split(",")]
    names = [item.strip().rsplit(":", 1)[-1].rsplit(".", 1)[-1] for item in items if item.strip()]
    if others := [n for n in names if n not in ONE_HOST_EXECUTORS]:
        raise NoBrokerConfigured(
            f"no broker database is configured, and [core] executor ({', '.join(others)}) runs tasks on several "
            "machines: each would use a SQLite broker of its own and hand out the same GPUs again. Set "
            "[elastic_gpu] broker_url ($AIRFLOW_ELASTIC_GPU_BROKER_URL) to one PostgreSQL database for every "
            "component (and the connection elastic_gpu_default's Broker database URL, if you use it)")


class GpuBrokerHook(BaseHook):
    """Gives operators and triggers a :class:`GpuBroker` for a connection id.

    :param broker_conn_id: Airflow connection id; a missing connection falls back
        to ``[elastic_gpu]`` settings (:mod:`airflow_elastic_gpu.config`).
    """

    conn_name_attr = "broker_conn_id"
    default_conn_name = "elastic_gpu_default"
    conn_type = CONN_TYPE
    hook_name = "Elastic GPU broker"

    def __init__(self, broker_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.broker_conn_id = broker_conn_id

    @classmethod
    def get_connection_form_widgets(cls) -> dict[str, Any]:
        """The form's extra fields for Airflow < 3.2 (later versions read ``conn-fields``)."""
        from flask_appbuilder.fieldwidgets import BS3PasswordFieldWidget, BS3TextFieldWidget
        from flask_babel import lazy_gettext
        from wtforms import PasswordField, StringField

        def field(name: str) -> Any:
            spec = CONN_FIELDS[name]
            secret = spec["schema"].get("format") == "password"
            return (PasswordField if secret else StringField)(
                lazy_gettext(spec["label"]), description=spec["description"],
                widget=BS3PasswordFieldWidget() if secret else BS3TextFieldWidget())

        return {name: field(name) for name in CONN_FIELDS}

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        """The standard fields hidden, for Airflow < 3.2 (later versions read ``ui-field-behaviour``)."""
        return {"hidden_fields": list(HIDDEN_FIELDS), "relabeling": {}}

    @cached_property
    def connection(self) -> Any | None:
        """The Airflow connection ``broker_conn_id``, or ``None`` when it is not defined (read once).

        Only a connection that is not defined falls back to the ``[elastic_gpu]`` settings, since
        falling back would give this process another broker than the rest of the deployment's (the
        same GPUs handed out twice): what Airflow raises reading one that may exist is raised. But
        Airflow 3 reports a connection that a secrets backend or its API server could not read
        for a moment as not defined too: a deployment that uses the connection should set
        ``[elastic_gpu] broker_url`` to the same URL. Against the rest, a trigger whose broker has
        no such job reads the connection again for a while, and the local backend refuses to give
        this host's real GPUs to a second broker (:func:`.local_host.claim_host_gpus`).

        :raises Exception: whatever Airflow raised reading a connection that may exist (an access
            denied by a secrets backend).
        """
        from airflow.exceptions import AirflowNotFoundException

        try:
            return self.get_connection(self.broker_conn_id)
        except AirflowNotFoundException:
            self.log.debug("no connection %r: the broker is the [elastic_gpu] section's", self.broker_conn_id)
            return None

    def _field(self, name: str) -> str | None:
        """The connection's extra field ``name`` (also in its pre-Airflow-3 ``extra__elastic_gpu__``
        form), or ``None``."""
        extra = self._extra
        return extra.get(name) or extra.get(f"extra__{CONN_TYPE}__{name}") or None

    @cached_property
    def _extra(self) -> dict[str, Any]:
        """The connection's extra as a dict (read once: a malformed one is logged by Airflow at each
        read); ``{}`` without a connection or for an extra that is not a JSON object."""
        extra = self.connection.extra_dejson if self.connection is not None else {}
        return extra if isinstance(extra, dict) else {}

    def get_url(self) -> str:
        """The broker DB URL (see the module docstring for the order of sources).

        A connection that is defined but gives no URL (an extra that is not JSON, which Airflow only
        logs and reads as ``{}``; a misspelt key such as ``broker_url``) falls back to
        ``[elastic_gpu] broker_url`` only where that is set: the computed default, a SQLite file on
        this host, would give each worker a broker of its own (the same GPUs handed out twice).

        :raises ValueError: an ``airflow.cfg`` that cannot be parsed; no connection nor
            ``[elastic_gpu] broker_url`` under an executor of several machines; a connection whose host is not
            a URL or a host name; a connection that is defined, gives no URL, while ``[elastic_gpu] broker_url`` is not set either.
        """
        conf = airflow_conf()
        if self.connection is None:
            if not get_option("broker_url", conf=conf):
                _check_one_host(conf)
            return default_broker_url(conf=conf)
        url = self._field("url") or self._url_of_fields()
        if url:
            return url
        configured = get_option("broker_url", conf=conf)  # "" unless set: its default is computed
        if configured:
            self.log.warning("connection %r gives no broker URL (its extra has no \"url\"): using "
                             "[elastic_gpu] broker_url", self.broker_conn_id)
            return configured
        has = (f"its extra has only the keys {', '.join(map(repr, sorted(self._extra)))}" if self._extra else
               "its extra is empty, or not a JSON object: Airflow logs why it could not read it")
        raise ValueError(
            f"Airflow connection {self.broker_conn_id!r} gives no broker database URL ({has}): set its "
            'Broker database URL field (extra {"url": "postgresql+psycopg://..."}), or set '
            "[elastic_gpu] broker_url ($AIRFLOW_ELASTIC_GPU_BROKER_URL) for every worker")

    def _url_of_fields(self) -> str | None:
        """The URL in the connection's standard fields, for a connection without a *Broker database
        URL* field: its host holding a whole URL (connections made before that field existed), a
        host name or address (``postgresql+psycopg`` then) or a Unix socket directory, with its
        login, password, port and schema (the database) where set, and the extra's other keys as
        the URL's query (``sslmode``...). A URI such as ``elastic-gpu://user:pw@db:5432/broker?sslmode=require``
        or ``elastic-gpu://postgresql+psycopg://user:pw@db:5432/broker`` comes as such fields: Airflow
        keeps only ``driver://host`` of it as the host, and its query as the extra."""
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        c = self.connection
        if not c.host:
            return None
        host = c.host
        try:
            if "://" in host:
                url = make_url(host)
            elif host.startswith("/"):  # a socket directory (%2Fvar%2Frun%2Fpostgresql in a URI)
                url = make_url("postgresql+psycopg://").update_query_dict({"host": host})
            else:
                bare_ipv6 = ":" in host and not host.startswith("[")
                url = make_url(f"postgresql+psycopg://{f'[{host}]' if bare_ipv6 else host}")
        except (ArgumentError, ValueError) as exc:
            raise ValueError(f"Airflow connection {self.broker_conn_id!r}: its host is not a database URL "
                             f"or a host name ({exc})") from None
        fields = {"username": c.login, "password": c.password, "port": c.port, "database": c.schema}
        query = {k: str(v) for k, v in self._extra.items() if k not in CONN_FIELDS and not k.startswith("extra__")
                 and isinstance(v, (str, int, float)) and not isinstance(v, bool)}
        return (url.set(**{k: v for k, v in fields.items() if v}).update_query_dict(query)
                .render_as_string(hide_password=False))

    def default_pool(self) -> str:
        """The GPU pool of a training that names none: the connection's ``pool`` field, else
        ``[elastic_gpu] default_pool`` (``"default"``)."""
        return self._field("pool") or default_pool(conf=airflow_conf())

    def broker_api_url(self) -> str | None:
        """The broker HTTP API for training pods: the connection's ``api_url`` field, else
        ``[elastic_gpu] broker_api_url``, else ``None`` (the Kubernetes backend's default)."""
        return self._field("api_url") or default_broker_api_url(conf=airflow_conf())

    @cached_property
    def broker(self) -> GpuBroker:
        """This hook's broker client, made on first use (the schema is created or migrated then).

        :raises ValueError: a malformed URL or a missing database driver.
        """
        return GpuBroker(self.get_url())

    def get_conn(self) -> GpuBroker:
        """:attr:`broker` (the same client on every call)."""
        return self.broker
