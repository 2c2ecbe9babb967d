"""rank rollups: per-layer statistics one row per statistic, and each rank's step-time
window and median, so that a batch rewrites only what it changed and the ranks panel
reads no batch

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

STATS = 8  # the rows of the old run_ranks.layer_stats blob: float64 (8, n_layers)


def upgrade() -> None:
    op.create_table(
        "rank_rollups",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("rollup", sa.Integer(), nullable=False),
        sa.Column("values", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"],
                                name=op.f("fk_rank_rollups_run_id_runs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "rank", "rollup", name=op.f("pk_rank_rollups")),
    )
    _split_layer_stats()
    with op.batch_alter_table("run_ranks", schema=None) as batch_op:
        batch_op.drop_column("layer_stats")
        batch_op.add_column(sa.Column("step_ms_median", sa.Float(), nullable=True))


def _split_layer_stats() -> None:
    """Each rank's blob becomes one row per statistic: row i of the row-major float64
    (8, n_layers) array is its bytes [i * n, (i + 1) * n), n = len / 8. The step-time
    windows and medians start empty: a rank's next batch builds them from its batches,
    and until then the ranks panel reads that rank's batches as before."""
    bind = op.get_bind()
    old = sa.table("run_ranks", sa.column("run_id"), sa.column("rank"),
                   sa.column("layer_stats", sa.LargeBinary))
    new = sa.table("rank_rollups", sa.column("run_id"), sa.column("rank"),
                   sa.column("rollup"), sa.column("values", sa.LargeBinary))
    rows = bind.execute(sa.select(old.c.run_id, old.c.rank, old.c.layer_stats)
                        .where(old.c.layer_stats.is_not(None)))
    for run_id, rank, blob in rows.all():
        blob = bytes(blob)
        width = len(blob) // STATS
        bind.execute(new.insert(), [
            {"run_id": run_id, "rank": rank, "rollup": i,
             "values": blob[i * width:(i + 1) * width]} for i in range(STATS)])


def downgrade() -> None:
    with op.batch_alter_table("run_ranks", schema=None) as batch_op:
        batch_op.drop_column("step_ms_median")
        batch_op.add_column(sa.Column("layer_stats", sa.LargeBinary(), nullable=True))
    bind = op.get_bind()
    stats = sa.table("rank_rollups", sa.column("run_id"), sa.column("rank"),
                     sa.column("rollup"), sa.column("values", sa.LargeBinary))
    ranks = sa.table("run_ranks", sa.column("run_id"), sa.column("rank"),
                     sa.column("layer_stats", sa.LargeBinary))
    joined: dict[tuple, dict[int, bytes]] = {}
    rows = bind.execute(sa.select(stats.c.run_id, stats.c.rank, stats.c.rollup,
                                  stats.c["values"]).where(stats.c.rollup < STATS))
    for run_id, rank, stat, values in rows.all():
        joined.setdefault((run_id, rank), {})[stat] = bytes(values)
    for (run_id, rank), parts in joined.items():
        if len(parts) == STATS:
            bind.execute(ranks.update().where(ranks.c.run_id == run_id, ranks.c.rank == rank)
                         .values(layer_stats=b"".join(parts[i] for i in range(STATS))))
    op.drop_table("rank_rollups")
