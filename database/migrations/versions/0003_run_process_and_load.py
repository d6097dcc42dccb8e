"""A run's process id (to tell a run whose process died from one still working) and the machine's
load while each record was timed.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("pid", sa.Integer(), nullable=True))
    with op.batch_alter_table("records", schema=None) as batch_op:
        batch_op.add_column(sa.Column("machine_load", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("records", schema=None) as batch_op:
        batch_op.drop_column("machine_load")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("pid")
