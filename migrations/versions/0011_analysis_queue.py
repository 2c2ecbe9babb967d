"""analysis queue: stored batches waiting for the detectors (server/worker/analysis_worker.py)

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "analysis_queue",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                  autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("rank_last_step", sa.BigInteger(), nullable=True),
        sa.Column("current", sa.Boolean(), nullable=False),
        sa.Column("fp8", sa.Boolean(), nullable=False),
        sa.Column("spikes", sa.Boolean(), nullable=False),
        sa.Column("ranks_through", sa.BigInteger(), nullable=True),
        sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"],
                                name=op.f("fk_analysis_queue_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_analysis_queue")),
    )
    op.create_index("ix_analysis_queue_run_id_id", "analysis_queue", ["run_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_analysis_queue_run_id_id", table_name="analysis_queue")
    op.drop_table("analysis_queue")
