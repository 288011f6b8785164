"""per-node acks of jobs that run one agent per node (a gang of pods on Kubernetes)

``node_ack`` holds, per job and node, the generation that node's agent last acked; the broker
moves the job's in-use set once every node of the target and of the in-use set has acked the
target's generation.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_ack",
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("node", sa.String(length=253), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["job.id"]),
        sa.PrimaryKeyConstraint("job_id", "node"),
    )


def downgrade() -> None:
    op.drop_table("node_ack")
