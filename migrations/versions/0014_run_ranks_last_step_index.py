"""run_ranks (run_id, last_step) index: ingest reads the run's lowest last steps from it,
instead of an aggregate over every rank of the run on every batch (issue 31: a batch
cost more at 4,096 ranks than at 64)

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-26
"""

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_run_ranks_last_step", "run_ranks", ["run_id", "last_step"])


def downgrade() -> None:
    op.drop_index("ix_run_ranks_last_step", table_name="run_ranks")
