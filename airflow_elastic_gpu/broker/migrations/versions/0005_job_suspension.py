"""suspension of preemptible jobs: the job's opt-in, its latest start or resume, its suspensions

A preemptible job (``preemptible``, off by default) may be resized to zero GPUs when its pool
allows suspension; ``last_start_s`` (the minimum runtime between suspensions counts from it) and
``suspensions`` (publish times, for the per-hour cap) are what the policy reads of its history.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.add_column(sa.Column("preemptible", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("last_start_s", sa.Float(), nullable=True))
        batch.add_column(sa.Column("suspensions", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.drop_column("suspensions")
        batch.drop_column("last_start_s")
        batch.drop_column("preemptible")
