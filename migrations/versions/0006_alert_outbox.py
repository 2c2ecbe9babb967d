"""alert outbox: notifications to send and every attempt at sending them

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "alert_notifications",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("event", sa.String(length=16), nullable=False),
        sa.Column("rule", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=64), nullable=False),
        sa.Column("finding_id", sa.Integer(), nullable=True),
        sa.Column("run_id", sa.String(length=128), nullable=True),
        sa.Column("severity", sa.String(length=16), nullable=True),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("claim", sa.String(length=64), nullable=True),
        sa.Column("claimed_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alert_notifications")),
    )
    with op.batch_alter_table("alert_notifications", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_alert_notifications_finding_id"), ["finding_id"],
                              unique=False)
        batch_op.create_index("ix_alert_notifications_status_due",
                              ["status", "next_attempt_at"], unique=False)

    op.create_table(
        "alert_attempts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("notification_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("duration_ms", sa.Float(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["notification_id"], ["alert_notifications.id"],
            name=op.f("fk_alert_attempts_notification_id_alert_notifications"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alert_attempts")),
    )
    with op.batch_alter_table("alert_attempts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_alert_attempts_notification_id"),
                              ["notification_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("alert_attempts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_alert_attempts_notification_id"))
    op.drop_table("alert_attempts")
    with op.batch_alter_table("alert_notifications", schema=None) as batch_op:
        batch_op.drop_index("ix_alert_notifications_status_due")
        batch_op.drop_index(batch_op.f("ix_alert_notifications_finding_id"))
    op.drop_table("alert_notifications")
