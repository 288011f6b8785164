"""64-bit ids for events and progress samples: both are inserted for the life of a deployment (a
progress sample per report of every running job, an event per state change), and PostgreSQL's
32-bit ``serial`` runs out after 2^31 rows (about four months at 200 reports a second)

PostgreSQL only: the columns become ``bigint`` and so do their sequences (a ``serial`` column's
sequence is typed too; its limit is what runs out). SQLite's ``INTEGER PRIMARY KEY`` holds 64 bits
already. Existing rows keep their ids. A downgrade fails once an id is past 2^31 - 1.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

TABLES = ("event", "progress_sample")


def _ids(type_: sa.types.TypeEngine, existing: sa.types.TypeEngine, sql_type: str) -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    for table in TABLES:
        op.alter_column(table, "id", type_=type_, existing_type=existing, existing_nullable=False)
        sequence = bind.execute(sa.text("SELECT pg_get_serial_sequence(:t, 'id')"), {"t": table}).scalar()
        if sequence:
            op.execute(f"ALTER SEQUENCE {sequence} AS {sql_type}")


def upgrade() -> None:
    _ids(sa.BigInteger(), sa.Integer(), "bigint")


def downgrade() -> None:
    _ids(sa.Integer(), sa.BigInteger(), "integer")
