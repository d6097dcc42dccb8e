"""Alembic environment: runs migrations on the connection autosched passes in (store.py), or on the
URL of alembic.ini when a developer runs `alembic` by hand."""

from alembic import context
from sqlalchemy import engine_from_config, pool

from autosched.database.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations(connection) -> None:
    # Batch mode: SQLite cannot ALTER most things in place, alembic copies the table instead.
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    run_migrations(connection)
else:
    engine = engine_from_config(config.get_section(config.config_ini_section), prefix="sqlalchemy.", poolclass=pool.NullPool)
    with engine.connect() as conn:
        run_migrations(conn)
