"""rank finished: when a rank's agent detached (the run ended), so pages stop calling it live

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("run_ranks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("run_ranks", schema=None) as batch_op:
        batch_op.drop_column("finished_at")
