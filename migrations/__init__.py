"""Alembic migrations of the ampwatch schema (applied by `ampwatch db upgrade` and on start)."""
