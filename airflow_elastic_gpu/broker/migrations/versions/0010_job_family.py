"""a job's family (the training it repeats), for the throughput prior of a job not yet measured

Until now the prior of an unmeasured job came from the finished and running jobs of the same
*name*: two DAGs with a task called ``train`` shared a prior, and the instances of one mapped task
(``train[0]``, ``train[1]``, ...) did not. The family is set at submit (the operator:
``dag_id.task_id``; otherwise the name without a trailing map index ``[N]``); existing jobs get
their name without that index. The index on (pool, name), used only by that lookup, becomes one on
(pool, family).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25
"""

import re

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_MAP_INDEX = re.compile(r"\[\d+\]$")


def upgrade() -> None:
    op.add_column("job", sa.Column("family", sa.String(256), nullable=True))
    bind = op.get_bind()
    bind.execute(sa.text("UPDATE job SET family = name"))
    mapped = bind.execute(sa.text("SELECT id, name FROM job WHERE name LIKE '%]'")).all()
    for job_id, name in mapped:
        if _MAP_INDEX.search(name):
            bind.execute(sa.text("UPDATE job SET family = :f WHERE id = :id"),
                         {"f": _MAP_INDEX.sub("", name), "id": job_id})
    op.drop_index("ix_job_pool_name", table_name="job")
    op.create_index("ix_job_pool_family", "job", ["pool", "family"])


def downgrade() -> None:
    op.drop_index("ix_job_pool_family", table_name="job")
    op.create_index("ix_job_pool_name", "job", ["pool", "name"])
    with op.batch_alter_table("job") as batch:
        batch.drop_column("family")
