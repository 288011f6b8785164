"""the family index also orders by end time: the prior's history is each family's latest finished run

The broker reads, on every rebalance, each family's latest finished run with samples (the prior of a
scheduled retraining's next run). With the index on (pool, family) alone the database sorts all of
a family's finished jobs to find it, a growing set for a training retrained every hour; with
``end_s`` in the index it reads them in order.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25
"""

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_job_pool_family_end", "job", ["pool", "family", "end_s"])
    op.drop_index("ix_job_pool_family", table_name="job")


def downgrade() -> None:
    op.create_index("ix_job_pool_family", "job", ["pool", "family"])
    op.drop_index("ix_job_pool_family_end", table_name="job")
