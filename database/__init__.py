"""The tuning database: SQLite through SQLAlchemy, upgraded by alembic migrations."""
