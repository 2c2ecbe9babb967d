"""bundles.bisect: what `ampwatch replay --bisect` found for the bundle's step (the
upcast that fixes it, or that none does), so the incident's fix can agree with it
(issue 49)

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("bundles") as batch:
        batch.add_column(sa.Column("bisect", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("bundles") as batch:
        batch.drop_column("bisect")
