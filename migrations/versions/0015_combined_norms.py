"""combined_norms and combined_ranks: the worker sums a sharded run's squared grad norms
over its ranks step by step, so the combined grad norms read a few bucket rows instead
of every rank's batches (issue 31)

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # runs stored before this have no rows: their reads take every rank's batches, as
    # before (a rank without a combined_ranks row keeps the rollup unused for its run)
    op.create_table(
        "combined_norms",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("bucket", sa.BigInteger(), nullable=False),
        sa.Column("ranks", sa.LargeBinary(), nullable=False),
        sa.Column("sum_sq", sa.LargeBinary(), nullable=False),
        sa.Column("unknown", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"],
                                name=op.f("fk_combined_norms_run_id_runs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "bucket", name=op.f("pk_combined_norms")),
    )
    op.create_table(
        "combined_ranks",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("through", sa.BigInteger(), nullable=False),
        sa.Column("stuck", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"],
                                name=op.f("fk_combined_ranks_run_id_runs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "rank", name=op.f("pk_combined_ranks")),
    )
    op.create_index("ix_combined_ranks_through", "combined_ranks", ["run_id", "through"])


def downgrade() -> None:
    op.drop_index("ix_combined_ranks_through", table_name="combined_ranks")
    op.drop_table("combined_ranks")
    op.drop_table("combined_norms")
