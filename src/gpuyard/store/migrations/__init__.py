"""Alembic migrations of the state store (applied by Store.migrate on first use)."""
