"""pending rebalance requests found without walking served ones: a per-pool watermark and a (pool, id) index

The last rebalance records the highest request id it served (``gpu_pool.served_request_id``); a
job call asks "is a request above the watermark pending?" with an index range scan that starts
there, instead of stepping over every request deleted since the table was last vacuumed.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def _requests_table(index: str, columns: list[str], **kw: object) -> None:
    op.create_table(
        "rebalance_request",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("pool", sa.String(length=128), nullable=False),
        sa.Column("time_s", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["pool"], ["gpu_pool.name"]),
        sa.PrimaryKeyConstraint("id"),
        **kw,
    )
    op.create_index(index, "rebalance_request", columns, unique=False)


def upgrade() -> None:
    with op.batch_alter_table("gpu_pool") as batch:
        batch.add_column(sa.Column("served_request_id", sa.Integer(), nullable=False, server_default="0"))
    # Re-created (requests are transient: a pending one is served by the next interval rebalance)
    # so that SQLite never reuses an id below the watermark (AUTOINCREMENT); PostgreSQL's sequence
    # never does.
    op.drop_table("rebalance_request")
    _requests_table("ix_rebalance_request_pool_id", ["pool", "id"], sqlite_autoincrement=True)


def downgrade() -> None:
    op.drop_table("rebalance_request")
    _requests_table("ix_rebalance_request_pool", ["pool"])
    with op.batch_alter_table("gpu_pool") as batch:
        batch.drop_column("served_request_id")
