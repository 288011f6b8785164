"""the job records its Airflow DAG run's clear_number when it was submitted

A retry of a task whose job succeeded gets that success back; a cleared task trains again. The
two were told apart by the task's ``max_tries`` alone, which a clear leaves as it was when the
task's ``retries`` were lowered before it, or when the task was cleared while it still ran (the
seconds between its job's success and its end): such a clear got the old success back. Airflow
adds one to the run's ``clear_number`` on every clear, never on a retry.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("job", sa.Column("clear_number", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.drop_column("clear_number")
