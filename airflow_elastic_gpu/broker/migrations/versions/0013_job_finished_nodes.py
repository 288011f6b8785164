"""the nodes of a gang of pods whose trainer exited cleanly before the job ended

A gang with one agent per node (Kubernetes pods) ends when its trainers exit; only the trainer
that prints the final metrics line (global rank 0, on any node with a ``c10d`` rendezvous) can say
the job succeeded. A node whose trainer exited with 0 without that line is recorded here; the job
succeeds once the metrics come, or once every node of its generation has exited cleanly, and
until then its allocation is not changed.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("job", sa.Column("finished_nodes", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.drop_column("finished_nodes")
