"""64-bit rebalance request ids: every allocation-changing call inserts a request, and a 32-bit
sequence runs out after 2^31 of them (about seven weeks at 500 calls a second)

The request table is re-created (requests are transient: a pending one is served by the pool's
next interval rebalance) with a 64-bit id, and every pool's watermark reset to 0 to match the new,
empty table (its sequence starts again at 1).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def _requests_table(id_type: sa.types.TypeEngine) -> None:
    op.create_table(
        "rebalance_request",
        sa.Column("id", id_type, autoincrement=True, nullable=False),
        sa.Column("pool", sa.String(length=128), nullable=False),
        sa.Column("time_s", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["pool"], ["gpu_pool.name"]),
        sa.PrimaryKeyConstraint("id"),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_rebalance_request_pool_id", "rebalance_request", ["pool", "id"], unique=False)


def _watermark_type(type_: sa.types.TypeEngine, existing: sa.types.TypeEngine) -> None:
    # SQLite's INTEGER holds 64 bits whatever the declared type; altering it there would re-create
    # gpu_pool, which the other tables' foreign keys forbid once they hold rows
    if op.get_bind().dialect.name != "sqlite":
        op.alter_column("gpu_pool", "served_request_id", type_=type_, existing_type=existing,
                        existing_nullable=False, existing_server_default="0")


def upgrade() -> None:
    op.drop_table("rebalance_request")
    _requests_table(sa.BigInteger().with_variant(sa.Integer(), "sqlite"))
    _watermark_type(sa.BigInteger(), sa.Integer())
    op.execute("UPDATE gpu_pool SET served_request_id = 0")


def downgrade() -> None:
    op.drop_table("rebalance_request")
    _requests_table(sa.Integer())
    op.execute("UPDATE gpu_pool SET served_request_id = 0")  # first: a watermark past 2^31 fits no integer
    _watermark_type(sa.Integer(), sa.BigInteger())
