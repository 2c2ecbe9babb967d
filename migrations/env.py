"""Alembic environment: runs on the connection `server.db.upgrade` passes in, or on
`sqlalchemy.url` when called from the alembic command line."""

from alembic import context
from sqlalchemy import create_engine

from ampwatch.server.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    run_migrations(connection)
else:
    with create_engine(config.get_main_option("sqlalchemy.url")).begin() as conn:
        run_migrations(conn)
