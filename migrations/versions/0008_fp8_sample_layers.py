"""fp8_samples.layers: a sample holds only its FP8 layers' columns, compressed

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("fp8_samples", schema=None) as batch_op:
        batch_op.add_column(sa.Column("layers", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("fp8_samples", schema=None) as batch_op:
        batch_op.drop_column("layers")
