"""The provider's settings: one table, read through Airflow's ``conf`` (section ``[elastic_gpu]``).

Every entry point (CLI, operator, trigger, hook, API server, demo) asks these functions, so a job
started by one is found by the others. A setting is looked up, first match wins:

1. its historical environment variable (``AIRFLOW_ELASTIC_GPU_*``, still honoured);
2. Airflow's configuration, section ``[elastic_gpu]``: inside Airflow the caller hands over
   Airflow's ``conf`` (``AIRFLOW__ELASTIC_GPU__<OPTION>`` variables, ``_CMD``/``_SECRET`` forms,
   ``airflow.cfg``, secrets backends); without it (the CLI, the demo) the
   ``AIRFLOW__ELASTIC_GPU__<OPTION>`` variable, then the ``[elastic_gpu]`` section of
   ``$AIRFLOW_CONFIG`` (default ``$AIRFLOW_HOME/airflow.cfg``), which is the part of Airflow's
   lookup that needs no Airflow import;
3. the default of :data:`OPTIONS` (an empty default is computed: see the option's description).

:data:`OPTIONS` is also the ``config`` section of the provider's metadata
(:func:`airflow_elastic_gpu.get_provider_info`), so ``airflow config list`` shows it.

The pool's policy, heartbeat lease and rebalance interval are not here: they live in the broker
database (``airflow-elastic-gpu pool --lease-s ...``) so that every process shares one value.
"""

from __future__ import annotations

import configparser
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

SECTION = "elastic_gpu"
ENV_BROKER_URL = "AIRFLOW_ELASTIC_GPU_BROKER_URL"
ENV_WORK_DIR = "AIRFLOW_ELASTIC_GPU_WORK_DIR"
ENV_VIRTUAL_GPUS = "AIRFLOW_ELASTIC_GPU_VIRTUAL_GPUS"
ENV_HOST_CLAIM_DIR = "AIRFLOW_ELASTIC_GPU_HOST_CLAIM_DIR"
ENV_UI_TOKEN = "AIRFLOW_ELASTIC_GPU_UI_TOKEN"
ENV_MAX_BODY_BYTES = "AIRFLOW_ELASTIC_GPU_API_MAX_BODY_BYTES"
ENV_MAX_METRICS_BYTES = "AIRFLOW_ELASTIC_GPU_API_MAX_METRICS_BYTES"
_TRUE, _FALSE = ("true", "t", "1", "yes", "on"), ("false", "f", "0", "no", "off")


class ConfLike(Protocol):
    """What this module uses of Airflow's ``conf``."""

    def get(self, section: str, key: str, **kwargs: Any) -> str | None: ...


@dataclass(frozen=True)
class Option:
    """One setting of the ``[elastic_gpu]`` section.

    :param name: the key in ``[elastic_gpu]`` (``AIRFLOW__ELASTIC_GPU__<NAME>`` in the environment).
    :param type: ``"string"``, ``"integer"``, ``"float"`` or ``"boolean"`` (Airflow's config types).
    :param default: the value when nothing sets it; ``""``: computed, as the description says.
    :param description: what it does, with its unit.
    :param env: the historical ``AIRFLOW_ELASTIC_GPU_*`` variable, which wins when set.
    :param example: an example value for the documentation.
    :param sensitive: masked by ``airflow config list`` and in logs (credentials).
    """

    name: str
    type: str
    default: str
    description: str
    env: str | None = None
    example: str | None = None
    sensitive: bool = False

    def provider_info(self) -> dict[str, Any]:
        """This option in the provider metadata's ``config`` format (as ``provider.yaml`` has it)."""
        var = f" Also read from ``${self.env}``, which wins when set." if self.env else ""
        info: dict[str, Any] = {"description": self.description + var + "\n", "version_added": None,
                                "type": self.type, "example": self.example, "default": self.default}
        if self.sensitive:
            info["sensitive"] = True
        return info


OPTIONS: tuple[Option, ...] = (
    Option("broker_url", "string", "",
           "SQLAlchemy URL of the broker's own database when the broker connection "
           "(``elastic_gpu_default``) does not give one. Empty: a SQLite file "
           "``elastic_gpu_broker.db`` in ``$AIRFLOW_HOME``. Use PostgreSQL when tasks run on more "
           "than one machine.", env=ENV_BROKER_URL,
           example="postgresql+psycopg://user:password@db-host:5432/broker", sensitive=True),
    Option("work_dir", "string", "",
           "Parent directory of the local backend's job directories (logs, shared files, "
           "checkpoints by default). Empty: ``elastic_gpu_jobs`` in ``$AIRFLOW_HOME``.",
           env=ENV_WORK_DIR, example="/data/elastic_gpu_jobs"),
    Option("host_claim_dir", "string", "",
           "Directory, one per host, where the local backend records which broker hands out this "
           "host's real GPUs (``host-gpus.json``); every Airflow installation and user on the host "
           "must see the same one. Empty: ``/var/tmp/airflow-elastic-gpu``.",
           env=ENV_HOST_CLAIM_DIR, example="/var/lib/airflow-elastic-gpu"),
    Option("deployment", "string", "",
           "Name of this Airflow deployment to the broker, for deployments that share one broker "
           "(staging and production, two teams): it is part of every training job's key, so that a "
           "task of one never reattaches to, or cancels as no longer followed, a job of another whose "
           "DAG, task and run ids are the same (a scheduled run's id is). Letters, digits, ``.``, "
           "``_`` and ``-``, at most 64 characters, and the same on every component of the deployment "
           "(workers, triggerers, API server). Empty: one Airflow per broker. Change it only while no "
           "training runs: a task does not find its job submitted under the old name.",
           example="staging"),
    Option("default_pool", "string", "default",
           "GPU pool of a training whose operator names none and whose broker connection has no "
           "``pool`` field; also the pool of the CLI's ``pool``, ``status``, ``run-local`` and "
           "``nodes add``/``detect`` when ``--pool`` is not given."),
    Option("poll_interval", "float", "5.0",
           "Seconds between two polls of a training job (by the trigger, or by the worker when "
           "``deferrable=False``) when the operator gives no ``poll_interval``."),
    Option("default_deferrable", "boolean", "True",
           "Default of ``ElasticTrainingOperator(deferrable=...)``. Airflow's own "
           "``[operators] default_deferrable`` is false out of the box, which would make every "
           "training hold a worker slot for its whole length, so this provider has its own switch; "
           "set it to false where no triggerer runs."),
    Option("virtual_gpus", "integer", "4",
           "Virtual GPUs registered for the local backend on a host without NVIDIA GPUs (each one "
           "a training process on the CPU), when the operator gives no ``virtual_gpus``.",
           env=ENV_VIRTUAL_GPUS),
    Option("broker_api_url", "string", "",
           "The broker's HTTP API as seen from training pods (``backend='kubernetes'``) when neither "
           "the operator's ``kubernetes={'broker_api_url': ...}`` nor the broker connection's "
           "``api_url`` field gives one. Empty: ``http://elastic-gpu-broker:8793``.",
           example="http://elastic-gpu-broker.airflow.svc:8793"),
    Option("ui_token", "string", "",
           "Bearer token the broker API's read-only views and GPU pool page require (stand-alone "
           "``airflow-elastic-gpu broker serve``). Empty: open, which only a loopback address allows.",
           env=ENV_UI_TOKEN, sensitive=True),
    Option("api_max_body_bytes", "integer", "262144",
           "Largest request body the broker API accepts, bytes.", env=ENV_MAX_BODY_BYTES),
    Option("api_max_metrics_bytes", "integer", "16384",
           "Largest trainer metrics a job may report to the broker API, bytes (at most "
           "``api_max_body_bytes``).", env=ENV_MAX_METRICS_BYTES),
)
_BY_NAME = {o.name: o for o in OPTIONS}


def provider_config() -> dict[str, Any]:
    """The ``config`` entry of :func:`airflow_elastic_gpu.get_provider_info`: section ``elastic_gpu``."""
    return {SECTION: {"description": "Settings of the Elastic GPU provider (broker, jobs, API).\n",
                      "options": {o.name: o.provider_info() for o in OPTIONS}}}


def airflow_conf() -> ConfLike | None:
    """Airflow's ``conf`` (the Task SDK's where it exists, else the core's), or ``None`` when
    Airflow is not installed. Importing it takes seconds: the CLI does without."""
    try:
        from airflow.sdk.configuration import conf
    except ImportError:
        try:
            from airflow.configuration import conf
        except ImportError:
            return None
    return conf


def airflow_home(environ: Mapping[str, str] = os.environ) -> Path:
    """``$AIRFLOW_HOME``, else ``~/airflow`` (Airflow's own default).

    :param environ: the environment to read (default this process's; the demo passes the one it
        gives Airflow).
    """
    return Path(environ.get("AIRFLOW_HOME") or Path.home() / "airflow").expanduser()


def _config_path(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("AIRFLOW_CONFIG") or airflow_home(environ) / "airflow.cfg").expanduser()


def _from_config_file(name: str, environ: Mapping[str, str]) -> str | None:
    path = _config_path(environ)
    parser = configparser.ConfigParser()  # interpolation as Airflow's: a literal % is written %%
    try:
        parser.read(path, encoding="utf-8")
        return parser.get(SECTION, name, fallback=None)
    except configparser.InterpolationError:
        # its message quotes the rest of the value: a URL-encoded password (p%40ss) in broker_url
        raise ValueError(f"cannot read [{SECTION}] {name} from {path}: its value has a % that is not "
                         "written %% (in airflow.cfg write % as %%)") from None
    except configparser.ParsingError as exc:  # its message quotes the lines, which may hold a secret
        numbers = [lineno for lineno, _line in getattr(exc, "errors", ())] or [getattr(exc, "lineno", "?")]
        lines = ", ".join(map(str, numbers))
        raise ValueError(f"cannot read [{SECTION}] {name}: {path} cannot be parsed (line {lines}: "
                         "expected [section] or key = value)") from None
    except (OSError, configparser.Error) as exc:  # a duplicate section or key: no value in the message
        raise ValueError(f"cannot read [{SECTION}] {name} from {path}: {exc}") from None


def lookup_option(name: str, environ: Mapping[str, str] = os.environ,
                  conf: ConfLike | None = None) -> tuple[str, str]:
    """The value of ``[elastic_gpu] name`` as a string, and where it came from, for messages about it.

    :param name: an option of :data:`OPTIONS`.
    :param environ: the environment to read (default this process's).
    :param conf: Airflow's ``conf`` (:func:`airflow_conf`); ``None``: read the
        ``AIRFLOW__ELASTIC_GPU__<NAME>`` variable and ``airflow.cfg`` directly.
    :returns: ``(value, source)``; ``source`` is ``$VARIABLE``, ``[elastic_gpu] name`` (Airflow's
        configuration), ``[elastic_gpu] name (PATH)`` (``airflow.cfg`` read directly) or
        ``the default of [elastic_gpu] name``.
    :raises KeyError: ``name`` is not an option.
    :raises ValueError: ``airflow.cfg`` cannot be parsed.
    """
    option = _BY_NAME[name]
    # stripped: a value from a command or a secret (``_CMD``, ``_SECRET``) keeps the newline that
    # the command printed (Airflow does not strip it), and a URL or path never ends in one
    if option.env and environ.get(option.env, "").strip():
        return environ[option.env].strip(), f"${option.env}"
    var = f"AIRFLOW__{SECTION.upper()}__{name.upper()}"
    if environ.get(var, "").strip():
        return environ[var].strip(), f"${var}"
    if conf is not None:
        value, source = conf.get(SECTION, name, fallback=None), f"[{SECTION}] {name}"
    else:
        value, source = _from_config_file(name, environ), f"[{SECTION}] {name} ({_config_path(environ)})"
    value = value.strip() if isinstance(value, str) else value
    return (value, source) if value else (option.default, f"the default of [{SECTION}] {name}")


def get_option(name: str, environ: Mapping[str, str] = os.environ, conf: ConfLike | None = None) -> str:
    """The value of ``[elastic_gpu] name`` as a string (see the module docstring for the order;
    :func:`lookup_option` also says where it came from).

    :param name: an option of :data:`OPTIONS`.
    :param environ: the environment to read (default this process's).
    :param conf: Airflow's ``conf`` (:func:`airflow_conf`); ``None``: read the
        ``AIRFLOW__ELASTIC_GPU__<NAME>`` variable and ``airflow.cfg`` directly.
    :raises KeyError: ``name`` is not an option.
    :raises ValueError: ``airflow.cfg`` cannot be parsed.
    """
    return lookup_option(name, environ, conf)[0]


def _typed(name: str, kind: type, environ: Mapping[str, str], conf: ConfLike | None) -> Any:
    raw, source = lookup_option(name, environ, conf)
    try:
        if kind is bool:
            if raw.strip().lower() in _TRUE + _FALSE:
                return raw.strip().lower() in _TRUE
            raise ValueError(raw)
        return kind(raw)
    except ValueError:
        option = _BY_NAME[name]
        article = "an" if option.type[0] in "aeiou" else "a"
        raise ValueError(f"{source} must be {article} {option.type}, got {raw!r}") from None


def default_broker_url(environ: Mapping[str, str] = os.environ, conf: ConfLike | None = None) -> str:
    """``[elastic_gpu] broker_url`` (``$AIRFLOW_ELASTIC_GPU_BROKER_URL``), else a SQLite file
    ``elastic_gpu_broker.db`` in :func:`airflow_home`."""
    return (get_option("broker_url", environ, conf)
            or f"sqlite:///{airflow_home(environ) / 'elastic_gpu_broker.db'}")


def default_work_dir(environ: Mapping[str, str] = os.environ, conf: ConfLike | None = None) -> Path:
    """Parent of the local backend's job directories: ``[elastic_gpu] work_dir``
    (``$AIRFLOW_ELASTIC_GPU_WORK_DIR``), else ``elastic_gpu_jobs`` in :func:`airflow_home`."""
    return Path(get_option("work_dir", environ, conf) or airflow_home(environ) / "elastic_gpu_jobs").expanduser()


DEFAULT_HOST_CLAIM_DIR = Path("/var/tmp/airflow-elastic-gpu")
"""Where a host's GPU claim lives when ``[elastic_gpu] host_claim_dir`` is empty: outside every
``$AIRFLOW_HOME``, so that two installations on one host see one claim, and kept across reboots."""


def default_host_claim_dir(environ: Mapping[str, str] = os.environ, conf: ConfLike | None = None) -> Path:
    """Directory of this host's GPU claim: ``[elastic_gpu] host_claim_dir``
    (``$AIRFLOW_ELASTIC_GPU_HOST_CLAIM_DIR``), else :data:`DEFAULT_HOST_CLAIM_DIR`."""
    return Path(get_option("host_claim_dir", environ, conf) or DEFAULT_HOST_CLAIM_DIR).expanduser()


DEPLOYMENT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""What ``[elastic_gpu] deployment`` may be: no ``/`` (it is a segment of a job's key) and no space."""


def default_deployment(environ: Mapping[str, str] = os.environ, conf: ConfLike | None = None) -> str:
    """``[elastic_gpu] deployment``: this Airflow deployment's name to a shared broker, ``""`` for none.

    :raises ValueError: not a name of :data:`DEPLOYMENT_PATTERN` (the message says where it was set).
    """
    raw, source = lookup_option("deployment", environ, conf)
    name = raw.strip()
    if name and not DEPLOYMENT_PATTERN.fullmatch(name):
        raise ValueError(f"{source} must be a name of letters, digits, '.', '_' and '-' (at most 64 characters, "
                         f"starting with a letter or digit), got {raw!r}")
    return name


def default_pool(environ: Mapping[str, str] = os.environ, conf: ConfLike | None = None) -> str:
    """``[elastic_gpu] default_pool``: the GPU pool name when neither the operator nor the
    connection names one (default ``"default"``)."""
    return get_option("default_pool", environ, conf)


def default_poll_interval_s(environ: Mapping[str, str] = os.environ, conf: ConfLike | None = None) -> float:
    """``[elastic_gpu] poll_interval``, seconds (default 5).

    :raises ValueError: not a number.
    """
    return _typed("poll_interval", float, environ, conf)


def default_deferrable(environ: Mapping[str, str] = os.environ, conf: ConfLike | None = None) -> bool:
    """``[elastic_gpu] default_deferrable`` (default true).

    :raises ValueError: not a boolean (true/false, t/f, 1/0, yes/no, on/off).
    """
    return _typed("default_deferrable", bool, environ, conf)


def default_virtual_gpus(environ: Mapping[str, str] = os.environ, conf: ConfLike | None = None) -> int:
    """``[elastic_gpu] virtual_gpus`` (``$AIRFLOW_ELASTIC_GPU_VIRTUAL_GPUS``, default 4), GPUs.

    :raises ValueError: not an integer.
    """
    return _typed("virtual_gpus", int, environ, conf)


def default_broker_api_url(environ: Mapping[str, str] = os.environ, conf: ConfLike | None = None) -> str | None:
    """``[elastic_gpu] broker_api_url``, or ``None`` (the Kubernetes backend's own default)."""
    return get_option("broker_api_url", environ, conf) or None


#: query parameters of a database URL that hold a secret (libpq's, which psycopg passes on)
_SECRET_QUERY = re.compile(r"([?&](?:password|sslpassword|sslkey)=)[^&#]*", re.IGNORECASE)


def mask_url(url: str) -> str:
    """``url`` fit to print or log: its password, and the query's ``password``, ``sslpassword`` and
    ``sslkey`` values, replaced by ``***``.

    A URL SQLAlchemy parses is rendered by it (``render_as_string(hide_password=True)``). One it cannot
    parse (a typo such as ``postgresql//u:pw@h``), or whose host holds an ``@`` (a password with an
    unencoded ``@``, which SQLAlchemy splits at the first one), loses everything up to its last ``@``
    (after ``scheme://`` where there is one).
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    text = str(url)
    try:
        parsed = make_url(text)
    except (ArgumentError, ValueError, TypeError):
        parsed = None
    if parsed is not None and "@" not in (parsed.host or ""):
        text = parsed.render_as_string(hide_password=True)
    elif "@" in text:
        head, _, tail = text.rpartition("@")
        scheme = head[:head.index("://") + 3] if "://" in head else ""
        text = f"{scheme}***@{tail}"
    return _SECRET_QUERY.sub(r"\1***", text)
