"""the job records its Airflow task's max_tries when it was submitted

A task try that fails after its job succeeded (its worker lost while it returned the result) is
retried; the retry submitted the key again and trained anew, for hours. Airflow raises a task's
``max_tries`` when a user clears the task, never on a retry: a retry whose ``max_tries`` is the
succeeded job's gets that job back, and a cleared task trains again.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("job", sa.Column("max_tries", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.drop_column("max_tries")
