"""a job's family (the training it repeats), for the throughput prior of a job not yet measured

Until now the prior of an unmeasured job came from the finished and running jobs of the same
*name*: two DAGs with a task called ``train`` shared a prior, and the instances of one mapped task
(``train[0]``, ``train[1]``, ...) did not. The family is set at submit (the operator:
``dag_id.task_id``; otherwise the name without a trailing map index ``[N]``). Existing jobs get
the same: ``dag_id.task_id`` for a job the operator submitted (its idempotency key is
``dag_id/task_id/run_id/map_index``, with ``@<job id>`` added once it ended), else their name without
the map index, so a scheduled retraining keeps its previous run's prior across the upgrade. The index on (pool, name), used only by that lookup, becomes one on
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
# the operator's key: [deployment/]dag_id/task_id/run_id/map_index, "@<job id>" added when the job
# ended (the deployment came after this revision: met when a database is downgraded past it and back;
# no part holds a "/")
_OPERATOR_KEY = re.compile(r"^(?:[^/]+/)?([^/]+)/([^/]+)/[^/]+/-?\d+(@[^/]*)?$")


def family_of(name: str, key: str) -> str:
    """``dag_id.task_id`` for a job the operator submitted (as the operator now sets it), else the
    name without a trailing map index (as ``JobSpec`` does); at most 256 characters."""
    match = _OPERATOR_KEY.match(key)
    if match:
        return f"{match.group(1)}.{match.group(2)}"[:256]
    return _MAP_INDEX.sub("", name) or name


def upgrade() -> None:
    op.add_column("job", sa.Column("family", sa.String(256), nullable=True))
    bind = op.get_bind()
    bind.execute(sa.text("UPDATE job SET family = name"))
    rows = bind.execute(sa.text("SELECT id, name, key FROM job WHERE name LIKE '%]' OR key LIKE '%/%/%/%'")).all()
    for job_id, name, key in rows:
        family = family_of(name, key)
        if family != name:
            bind.execute(sa.text("UPDATE job SET family = :f WHERE id = :id"), {"f": family, "id": job_id})
    op.drop_index("ix_job_pool_name", table_name="job")
    op.create_index("ix_job_pool_family", "job", ["pool", "family"])


def downgrade() -> None:
    op.drop_index("ix_job_pool_family", table_name="job")
    op.create_index("ix_job_pool_name", "job", ["pool", "name"])
    with op.batch_alter_table("job") as batch:
        batch.drop_column("family")
