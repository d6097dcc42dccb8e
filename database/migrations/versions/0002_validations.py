"""Validations: records re-checked under another TVM version.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "validations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("record_id", sa.Integer(), nullable=False),
        sa.Column("tvm_version", sa.String(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("median_us", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.String(), nullable=False),
        sa.ForeignKeyConstraint(["record_id"], ["records.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("record_id", "tvm_version"),
    )
    with op.batch_alter_table("validations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_validations_record_id"), ["record_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("validations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_validations_record_id"))
    op.drop_table("validations")
