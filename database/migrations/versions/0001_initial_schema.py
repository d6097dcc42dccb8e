"""Initial schema: workloads, targets, runs and records.

Revision ID: 0001
Revises: 
Create Date: 2026-11-29 20:49:29.187142
"""

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.String(), nullable=False),
    sa.Column('finished_at', sa.String(), nullable=True),
    sa.Column('status', sa.String(), nullable=False),
    sa.Column('host', sa.String(), nullable=False),
    sa.Column('command', sa.Text(), nullable=False),
    sa.Column('seed', sa.Integer(), nullable=True),
    sa.Column('autosched_version', sa.String(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('targets',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('match_key', sa.String(), nullable=False),
    sa.Column('kind', sa.String(), nullable=False),
    sa.Column('arch', sa.String(), nullable=False),
    sa.Column('device_name', sa.String(), nullable=False),
    sa.Column('num_cores', sa.Integer(), nullable=False),
    sa.Column('max_shared_memory', sa.Integer(), nullable=False),
    sa.Column('tvm_version', sa.String(), nullable=False),
    sa.Column('driver_version', sa.String(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('match_key', 'tvm_version', 'driver_version')
    )
    with op.batch_alter_table('targets', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_targets_match_key'), ['match_key'], unique=False)

    op.create_table('workloads',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('key', sa.String(), nullable=False),
    sa.Column('op', sa.String(), nullable=False),
    sa.Column('shape_json', sa.Text(), nullable=False),
    sa.Column('dtype', sa.String(), nullable=False),
    sa.Column('attrs_json', sa.Text(), nullable=False),
    sa.Column('structural_hash', sa.String(), nullable=False),
    sa.Column('func_json', sa.Text(), nullable=True),
    sa.Column('flops', sa.Float(), nullable=False),
    sa.Column('min_bytes', sa.Float(), nullable=False),
    sa.Column('created_at', sa.String(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('key')
    )
    with op.batch_alter_table('workloads', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_workloads_op'), ['op'], unique=False)
        batch_op.create_index(batch_op.f('ix_workloads_structural_hash'), ['structural_hash'], unique=False)

    op.create_table('records',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('uid', sa.String(length=32), nullable=False),
    sa.Column('workload_id', sa.Integer(), nullable=False),
    sa.Column('target_id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=True),
    sa.Column('space', sa.String(), nullable=False),
    sa.Column('point_json', sa.Text(), nullable=False),
    sa.Column('latencies_json', sa.Text(), nullable=False),
    sa.Column('median_us', sa.Float(), nullable=True),
    sa.Column('error_kind', sa.String(), nullable=True),
    sa.Column('error_msg', sa.Text(), nullable=True),
    sa.Column('rel_error', sa.Float(), nullable=True),
    sa.Column('build_seconds', sa.Float(), nullable=False),
    sa.Column('run_seconds', sa.Float(), nullable=False),
    sa.Column('created_at', sa.String(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ),
    sa.ForeignKeyConstraint(['target_id'], ['targets.id'], ),
    sa.ForeignKeyConstraint(['workload_id'], ['workloads.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('uid')
    )
    with op.batch_alter_table('records', schema=None) as batch_op:
        batch_op.create_index('ix_records_lookup', ['workload_id', 'target_id', 'median_us'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('records', schema=None) as batch_op:
        batch_op.drop_index('ix_records_lookup')

    op.drop_table('records')
    with op.batch_alter_table('workloads', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_workloads_structural_hash'))
        batch_op.drop_index(batch_op.f('ix_workloads_op'))

    op.drop_table('workloads')
    with op.batch_alter_table('targets', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_targets_match_key'))

    op.drop_table('targets')
    op.drop_table('runs')
