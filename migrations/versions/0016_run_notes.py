"""run_notes: people's notes on a run and on its incidents, and incidents marked handled
(issue 50)

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "run_notes",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("incident", sa.Integer(), nullable=True),
        sa.Column("handled", sa.Boolean(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_run_notes_run_id_runs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_run_notes")),
    )
    op.create_index(op.f("ix_run_notes_run_id"), "run_notes", ["run_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_run_notes_run_id"), table_name="run_notes")
    op.drop_table("run_notes")
