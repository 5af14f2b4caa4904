"""Alembic environment: runs migrations on the connection that Store.migrate hands over."""

from alembic import context

from gpuyard.store.tables import Base

connection = context.config.attributes.get("connection")
if connection is None:  # run from the alembic command line: connect to the configured URL
    from sqlalchemy import create_engine

    connection = create_engine(context.config.get_main_option("sqlalchemy.url") or "").connect()

context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
