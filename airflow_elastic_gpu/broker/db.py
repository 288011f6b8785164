"""Broker database: engine creation (SQLite or PostgreSQL) and Alembic migrations.

SQLite writers take the database lock up front (``BEGIN IMMEDIATE``, the
recipe of SQLAlchemy's pysqlite dialect docs), so two writers never interleave
a read-then-write; PostgreSQL writers lock their GPU pool's row instead
(``SELECT ... FOR NO KEY UPDATE`` in :mod:`airflow_elastic_gpu.broker.transactions`).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.pool import StaticPool

from airflow_elastic_gpu.config import (  # noqa: F401 - ENV_BROKER_URL, default_broker_url re-exported
    ENV_BROKER_URL,
    airflow_home,
    default_broker_url,
    mask_url,
)

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def _check_directory(path: Path, url: str) -> None:
    """The directory of a broker's SQLite file exists; :func:`airflow_home` (the default one) is
    created when it does not, any other is an error that names it."""
    directory = path.parent
    if directory.is_dir():
        return
    if directory.resolve() == airflow_home().expanduser().resolve():
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # e.g. a link to a directory that is gone
            raise ValueError(f"broker URL {mask_url(url)!r}: its directory {str(directory)!r} (Airflow's "
                             f"home) cannot be created: {exc}") from None
        return
    raise ValueError(
        f"broker URL {mask_url(url)!r}: the directory {str(directory)!r} of its SQLite file does not "
        "exist; create it (mkdir -p) or correct the path"
    )


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite broker URL (``sqlite:///PATH``, ``~`` expanded); None for any other
    URL: in memory, a ``file:`` URI (SQLite opens it as it says), another database, or one that
    does not parse (:func:`create_broker_engine` names the problem)."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return None
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or database in ("", ":memory:") or database.startswith("file:"):
        return None
    return Path(database).expanduser()


def in_memory(url: str) -> bool:
    """Whether ``url`` is an in-memory SQLite database (``sqlite://``, ``:memory:``; a ``file:`` URI,
    ``uri=true``, named ``:memory:`` or with ``mode=memory`` or ``vfs=memdb``): one of this process only."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return False
    database, query = parsed.database or "", parsed.query
    if parsed.get_backend_name() != "sqlite":
        return False
    if database in ("", ":memory:"):
        return True
    return (database.startswith("file:") and query.get("uri") == "true"
            and (database == "file::memory:" or query.get("mode") == "memory" or query.get("vfs") == "memdb"))


POSTGRES_CONNECT_DEFAULTS: dict[str, int] = {
    "connect_timeout": 10, "keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10,
    "keepalives_count": 3, "tcp_user_timeout": 60_000,
}
"""libpq connection parameters a PostgreSQL broker URL gets unless it sets them (its query, or a
``service`` there or in ``$PGSERVICE``, whose file then decides all of them; ``$PGCONNECT_TIMEOUT``
for the first): a connection
attempt gives up after 10 s; a server gone silent is given up on after about a minute, on an idle
connection (keepalive probes after 30 s, three 10 s apart) and on one waiting for the answer to
what it sent (``tcp_user_timeout``, milliseconds), rather than after the kernel's retransmissions
(about 15 minutes). Override any of them in the URL, e.g. ``...?connect_timeout=3``."""


def create_broker_engine(url: str) -> Engine:
    """Engine for a broker URL (``sqlite:///PATH``, ``sqlite://`` in memory, ``postgresql+psycopg://...``).

    :raises ValueError: the URL is malformed, names a driver that is not installed, a SQLite
        file in a directory that does not exist (only the default one, :func:`airflow_home`, is
        created: a mistyped path would otherwise make a new, empty broker in new directories),
        or a database other than SQLite or PostgreSQL.
    """
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ValueError(
            f"invalid broker URL {mask_url(url)!r}: {exc}. Expected e.g. sqlite:////path/broker.db "
            "or postgresql+psycopg://user:password@host:5432/dbname"
        ) from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        database = parsed.database or ""
        in_memory = database in ("", ":memory:")
        if not in_memory:
            _check_directory(Path(database.removeprefix("file:").split("?")[0]).expanduser(), url)
            if (path := sqlite_file(url)) is not None:
                _create_private(path)
        engine = create_engine(
            parsed,
            connect_args={"timeout": 60, "check_same_thread": False},
            poolclass=StaticPool if in_memory else None,
        )

        @event.listens_for(engine, "connect")
        def _connect(dbapi_conn, _record) -> None:  # pragma: no cover - driver glue
            dbapi_conn.isolation_level = None  # let the "begin" hook issue BEGIN
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            if not in_memory:
                cur.execute("PRAGMA journal_mode=WAL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn) -> None:  # pragma: no cover - driver glue
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    if backend == "postgresql":
        try:
            # No pre-ping round trip per checkout: a connection the server dropped fails its first
            # statement, SQLAlchemy invalidates the pool, and the broker redoes the whole
            # transaction (see transactions.BrokerBase._retrying). Without the defaults a server
            # that accepts the TCP connection and never answers holds a connection attempt for
            # psycopg's 130 s (for ever before psycopg 3.2), and a dead peer of an open connection
            # a call for the kernel's retransmissions: a caller (the clock's re-read, a trigger's
            # poll) would hang that long.
            defaults = {} if "service" in parsed.query or os.environ.get("PGSERVICE") else {
                k: v for k, v in POSTGRES_CONNECT_DEFAULTS.items()
                if k not in parsed.query and not (k == "connect_timeout" and os.environ.get("PGCONNECT_TIMEOUT"))}
            return create_engine(parsed, connect_args=defaults)
        except (NoSuchModuleError, ModuleNotFoundError) as exc:
            raise ValueError(
                f"broker URL {parsed.render_as_string(hide_password=True)!r} needs a "
                f"PostgreSQL driver that is not installed ({exc}); "
                "pip install 'airflow-elastic-gpu[postgres]' and use postgresql+psycopg://"
            ) from None
    raise ValueError(
        f"broker URL {parsed.render_as_string(hide_password=True)!r}: database "
        f"{backend!r} is not supported; use sqlite or postgresql"
    )


def _create_private(path: Path) -> None:
    """Create ``path`` empty with mode 0600 when it does not exist, so that a new SQLite database is
    readable by its owner only (SQLite gives its journal and WAL files the database file's mode)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    os.close(fd)


def broker_engine(url: str) -> Engine:
    """The engine for ``url``, shared by every broker client of this process that names it (one
    connection pool per database, like a hook's cached client); an in-memory SQLite URL gets a new
    database each time.

    :raises ValueError: as :func:`create_broker_engine`.
    """
    try:
        parsed = make_url(url)
    except ArgumentError:
        return create_broker_engine(url)  # raises the explanatory error
    if parsed.get_backend_name() == "sqlite" and (parsed.database or ":memory:") == ":memory:":
        return create_broker_engine(url)
    return _cached_engine(url)


@functools.lru_cache(maxsize=32)
def _cached_engine(url: str) -> Engine:
    return create_broker_engine(url)


def _alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def schema_is_current(engine: Engine) -> bool:
    """True if the database's schema is at the latest revision (one query)."""
    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision() == head


def ensure_schema(engine: Engine) -> None:
    """Migrate the broker schema if it is behind: a version check, and the migrations only when needed."""
    if not schema_is_current(engine):
        migrate(engine)


def migrate(engine: Engine) -> None:
    """Create or upgrade the broker schema to the latest Alembic revision (safe to call concurrently)."""
    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    with engine.connect() as conn:
        if MigrationContext.configure(conn).get_current_revision() == head:
            return
    run_migration(engine, "upgrade", head)


def run_migration(engine: Engine, direction: str, revision: str) -> None:
    """Move the broker schema ``"upgrade"`` or ``"downgrade"`` to ``revision`` in one transaction
    (PostgreSQL: under an advisory lock, so concurrent callers migrate once).

    SQLite alters a table by copying it (Alembic's batch mode): with foreign keys enforced, dropping
    the old ``job`` table fails while other tables' rows refer to it, so, as Alembic's documentation
    advises, enforcement is off during the migration (the pragma works only outside a transaction)
    and ``PRAGMA foreign_key_check`` must find no dangling reference before the commit.

    :raises RuntimeError: a migration left rows that refer to missing ones (SQLite), or the
        database is at a revision this version does not know (:class:`SchemaError`, :func:`_check_known`).
    """
    cfg = _alembic_config()
    step = {"upgrade": command.upgrade, "downgrade": command.downgrade}[direction]
    sqlite = engine.dialect.name == "sqlite"
    with engine.connect() as conn:
        # on the driver's connection, not in a SQLAlchemy transaction (which would begin one)
        pragma = conn.connection.driver_connection.execute if sqlite else None
        if pragma:
            pragma("PRAGMA foreign_keys=OFF")
        try:
            with conn.begin():
                if engine.dialect.name == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(724101)"))
                current = MigrationContext.configure(conn).get_current_revision()
                if direction == "upgrade" and current == revision:
                    return
                _check_known(cfg, current, engine, conn)
                cfg.attributes["connection"] = conn
                step(cfg, revision)
                if sqlite and (dangling := conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()):
                    raise RuntimeError(f"the broker schema migration left rows that refer to missing ones: "
                                       f"{dangling[:5]}")
        finally:
            if pragma:
                pragma("PRAGMA foreign_keys=ON")


class SchemaError(RuntimeError):
    """The broker database is at a schema revision this version does not know, or has tables of
    the broker's names but no revision."""


def _check_known(cfg: Config, current: str | None, engine: Engine, conn: Connection) -> None:
    """:raises SchemaError: ``current`` (the database's Alembic revision) is none of this version's:
    a newer version of the broker migrated it, or it is another application's database (Airflow's
    metadata database has an ``alembic_version`` table too); or there is none, but tables of the
    broker's names exist (another application's, or a broker's whose revision was lost: creating
    the schema failed on the first of them, with the driver's error). Nothing is changed then."""
    if current is None:
        from airflow_elastic_gpu.broker.models import Base

        if found := sorted(set(inspect(conn).get_table_names()) & set(Base.metadata.tables)):
            raise SchemaError(
                f"the broker database {engine.url.render_as_string(hide_password=True)} has tables named as the "
                f"broker's ({', '.join(found)}) but no schema revision: it is not a broker database (give the "
                "broker a database of its own), or its alembic_version table was lost; nothing was changed")
        return
    if current in {r.revision for r in ScriptDirectory.from_config(cfg).walk_revisions()}:
        return
    raise SchemaError(
        f"the broker database {engine.url.render_as_string(hide_password=True)} is at schema revision "
        f"{current!r}, which this version of airflow-elastic-gpu does not know: a newer version migrated it "
        "(install that version here too), or it is not a broker database (e.g. Airflow's metadata database: "
        "give the broker a database of its own); nothing was changed")
