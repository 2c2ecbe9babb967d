"""fp8 samples: per-layer FP8 cast statistics of sampled steps

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fp8_samples",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("n_layers", sa.Integer(), nullable=False),
        sa.Column("values", sa.LargeBinary(), nullable=False),
        sa.Column("present", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_fp8_samples_run_id_runs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "rank", "step", name=op.f("pk_fp8_samples")),
    )


def downgrade() -> None:
    op.drop_table("fp8_samples")
