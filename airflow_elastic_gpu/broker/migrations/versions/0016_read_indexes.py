"""indexes for the pool page's reads: a pool's latest ended jobs, its events, jobs in submit order

The page polls every 2 seconds per viewer. Its snapshot sorted every ended job of the pool to find
the latest ones (no index ordered them by ``end_s``; jobs are never deleted), and read a quiet
pool's latest events by walking back through every newer event of the other pools (``event`` had
no index on ``pool``). ``/api/v1/jobs`` sorted every job by submit time the same way.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-29
"""

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_job_pool_end_id", "job", ["pool", "end_s", "id"])
    op.create_index("ix_job_pool_submit_id", "job", ["pool", "submit_s", "id"])
    op.create_index("ix_job_submit_id", "job", ["submit_s", "id"])
    op.create_index("ix_event_pool_id", "event", ["pool", "id"])


def downgrade() -> None:
    op.drop_index("ix_event_pool_id", table_name="event")
    op.drop_index("ix_job_submit_id", table_name="job")
    op.drop_index("ix_job_pool_submit_id", table_name="job")
    op.drop_index("ix_job_pool_end_id", table_name="job")
