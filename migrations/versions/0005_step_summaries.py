"""step summaries (multi-resolution reads of long runs) and archived runs

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "step_summaries",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("bucket", sa.BigInteger(), nullable=False),
        sa.Column("n_steps", sa.Integer(), nullable=False),
        sa.Column("n_layers", sa.Integer(), nullable=False),
        sa.Column("scalars", sa.LargeBinary(), nullable=True),
        sa.Column("present", sa.LargeBinary(), nullable=True),
        sa.Column("grad_max", sa.LargeBinary(), nullable=True),
        sa.Column("grad_min", sa.LargeBinary(), nullable=True),
        sa.Column("act_max", sa.LargeBinary(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"],
                                name=op.f("fk_step_summaries_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "rank", "bucket", name=op.f("pk_step_summaries")),
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("archived_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("archived_at")
    op.drop_table("step_summaries")
