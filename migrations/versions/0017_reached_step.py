"""run_ranks.reached_step: the last step a rank's training loop said it closed (the agent's
heartbeat between batches), so a killed run tells the steps that never arrived (issue 50)

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("run_ranks") as batch:
        batch.add_column(sa.Column("reached_step", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("run_ranks") as batch:
        batch.drop_column("reached_step")
