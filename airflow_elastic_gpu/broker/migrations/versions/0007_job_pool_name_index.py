"""jobs found by pool and name: the throughput of a finished job is the prior of the next job
of the same name (a scheduled retraining) until that one is measured

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_job_pool_name", "job", ["pool", "name"])


def downgrade() -> None:
    op.drop_index("ix_job_pool_name", table_name="job")
