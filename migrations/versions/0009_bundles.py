"""bundles: the flight recorder's bad steps, one row per (run, rank, step); the files lie
on disk in the server's bundle folder

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "bundles",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("trigger", sa.String(length=32), nullable=False),
        sa.Column("first_nonfinite_layer", sa.String(length=512), nullable=True),
        sa.Column("exact", sa.Boolean(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("meta", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"],
                                name=op.f("fk_bundles_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "rank", "step", name=op.f("pk_bundles")),
    )


def downgrade() -> None:
    op.drop_table("bundles")
