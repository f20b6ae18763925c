"""session_segments.protected_writes: the record's count of calls that wrote a protected path

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-28 06:30:00

- `session_segments.protected_writes` (nullable integer): the rollout record's
  `protected_writes` as it gives it (app/contracts/rollouts.py): under a reward spec with
  protected paths (streams/reward.py, e.g. `sessions-v2`), the calls of the session that wrote a
  protected path such as the test file, when above 0; NULL when the record does not give it. Rows
  projected before this revision keep NULL until `flywheel projections rebuild` replays them.

Nothing else changes. SQLite adds the column in place; its downgrade recreates session_segments
(batch mode), which keeps its rows and index, and session_turns' foreign key names the table,
so it holds. deployment_events is untouched, so its SQLite guard triggers stay as migration 0002
made them.
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('session_segments', schema=None) as batch_op:
        batch_op.add_column(sa.Column('protected_writes', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('session_segments', schema=None) as batch_op:
        batch_op.drop_column('protected_writes')
