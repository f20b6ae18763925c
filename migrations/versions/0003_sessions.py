"""session_segments and session_turns: the sessions projection of `<ns>.rollouts`

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-27 20:00:00

- `session_segments`: one row per rollout record (a session's segment, or a one-call record),
  keyed by the record's Kafka key (`request_id`, `<request_id>|<spec>` when relabelled), with
  its place on the topic (partition, offset) for the trainer's lineage ranges.
- `session_turns`: one row per model call of a segment (its TurnSpan, or the record itself).

Both are projected by app/projector/sessions.py and emptied by `flywheel projections rebuild`
(no append-only guard: a rebuild replays them from the topic). deployment_events is untouched,
so its SQLite guard triggers stay as migration 0002 made them.
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('session_segments',
    sa.Column('record_key', sa.String(length=256), nullable=False),
    sa.Column('session_id', sa.String(length=128), nullable=False),
    sa.Column('request_id', sa.String(length=128), nullable=False),
    sa.Column('relabel_run', sa.String(length=64), nullable=True),
    sa.Column('reward_spec', sa.String(length=64), nullable=False),
    sa.Column('model_version', sa.String(length=32), nullable=False),
    sa.Column('opened_by', sa.String(length=32), nullable=True),
    sa.Column('closed_by', sa.String(length=32), nullable=True),
    sa.Column('turn_count', sa.Integer(), nullable=False),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('completion_tokens', sa.Integer(), nullable=False),
    sa.Column('sampled_tokens', sa.Integer(), nullable=False),
    sa.Column('reward', sa.Float(), nullable=False),
    sa.Column('components', sa.JSON(), nullable=True),
    sa.Column('outcome', sa.String(length=16), nullable=True),
    sa.Column('outcome_reward', sa.Float(), nullable=True),
    sa.Column('generated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('labelled_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('kafka_partition', sa.Integer(), nullable=False),
    sa.Column('kafka_offset', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('record_key')
    )
    with op.batch_alter_table('session_segments', schema=None) as batch_op:
        batch_op.create_index('ix_session_segments_session', ['session_id', 'generated_at'], unique=False)

    op.create_table('session_turns',
    sa.Column('record_key', sa.String(length=256), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('session_id', sa.String(length=128), nullable=False),
    sa.Column('request_id', sa.String(length=128), nullable=False),
    sa.Column('model_version', sa.String(length=32), nullable=False),
    sa.Column('reward', sa.Float(), nullable=True),
    sa.Column('components', sa.JSON(), nullable=True),
    sa.Column('sampled_tokens', sa.Integer(), nullable=False),
    sa.Column('finish_reason', sa.String(length=16), nullable=True),
    sa.Column('generated_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['record_key'], ['session_segments.record_key'], ),
    sa.PrimaryKeyConstraint('record_key', 'position')
    )
    with op.batch_alter_table('session_turns', schema=None) as batch_op:
        batch_op.create_index('ix_session_turns_version', ['model_version', 'session_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('session_turns', schema=None) as batch_op:
        batch_op.drop_index('ix_session_turns_version')

    op.drop_table('session_turns')
    with op.batch_alter_table('session_segments', schema=None) as batch_op:
        batch_op.drop_index('ix_session_segments_session')

    op.drop_table('session_segments')
