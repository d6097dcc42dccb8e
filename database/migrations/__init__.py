"""Alembic migrations of the tuning database (run by autosched.database.store)."""
