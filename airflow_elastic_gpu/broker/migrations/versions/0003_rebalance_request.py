"""coalesced rebalances: allocation-changing calls insert a request that the next rebalance serves

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rebalance_request",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("pool", sa.String(length=128), nullable=False),
        sa.Column("time_s", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["pool"], ["gpu_pool.name"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_rebalance_request_pool"), "rebalance_request", ["pool"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_rebalance_request_pool"), table_name="rebalance_request")
    op.drop_table("rebalance_request")
