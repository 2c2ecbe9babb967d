"""runs.last_seen_at dropped: a run was last seen when its newest rank was

Every batch updated the run's row, so the ranks of one run committed one at a time on
Postgres (issue 31). The run's value is now read as the newest of its ranks'
`run_ranks.last_seen_at`, which every batch already sets on its own rank's row.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # ranks that never carried their own time take the run's, so reads lose nothing
    op.execute("UPDATE run_ranks SET last_seen_at = (SELECT runs.last_seen_at FROM runs "
               "WHERE runs.id = run_ranks.run_id) WHERE last_seen_at IS NULL")
    # a plain ALTER (SQLite >= 3.35 too): a batch-mode copy of `runs` would drop the old
    # table, and SQLite's DROP TABLE deletes its rows through ON DELETE CASCADE
    op.execute("ALTER TABLE runs DROP COLUMN last_seen_at")


def downgrade() -> None:
    op.add_column("runs", sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE runs SET last_seen_at = (SELECT max(run_ranks.last_seen_at) FROM "
               "run_ranks WHERE run_ranks.run_id = runs.id)")
