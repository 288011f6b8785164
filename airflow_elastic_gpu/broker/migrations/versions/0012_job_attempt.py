"""the job records the Airflow task try that submitted it

A trigger that submits its own job (``start_from_trigger``) and is made again after a triggerer
restart submits the same key again; once that job has ended, the broker would start a second job
for the key and the training would run twice. With the submitting try recorded, the same try gets
its ended job back, and only a new try (a retry) starts a new one.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("job", sa.Column("attempt", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.drop_column("attempt")
