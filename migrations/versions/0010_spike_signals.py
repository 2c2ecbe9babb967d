"""spike samples: per-layer signals that precede loss spikes, of sampled steps

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "spike_samples",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("n_layers", sa.Integer(), nullable=False),
        sa.Column("values", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"],
                                name=op.f("fk_spike_samples_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "rank", "step", name=op.f("pk_spike_samples")),
    )


def downgrade() -> None:
    op.drop_table("spike_samples")
