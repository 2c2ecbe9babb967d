"""Pydantic schemas of API v1, apart from the ORM models (server/models.py).
docs/wire-format.md explains them; non-finite floats travel as "NaN", "Infinity",
"-Infinity" in both directions. They import nothing of the server but `fields`: storage
and every layer above may use them."""

