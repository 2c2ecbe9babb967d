"""step_summaries.step_ms_sum, first_step_ms and elapsed: each bucket's share of the step
clock, kept at ingest, so that a time axis (?x=relative, ?x=wall) reads the summaries
rather than every stored step of the rank (issue 59). Buckets folded before this have
NULLs and are read from their steps.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("step_summaries") as batch:
        batch.add_column(sa.Column("step_ms_sum", sa.Float(), nullable=True))
        batch.add_column(sa.Column("first_step_ms", sa.Float(), nullable=True))
        batch.add_column(sa.Column("elapsed", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("step_summaries") as batch:
        batch.drop_column("elapsed")
        batch.drop_column("first_step_ms")
        batch.drop_column("step_ms_sum")
