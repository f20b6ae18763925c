"""deployment_state table, replicas.model, and a DB-level append-only guard on deployment_events

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 01:05:00

- `deployment_state`: one row per model (champion, candidate, traffic split, phase, step,
  last analysis), projected from `flywheel.deployments` by app/projector/projector.py.
- `replicas.model`: which registered model a replica serves (the status API groups by it).
- Triggers that reject UPDATE and DELETE on `deployment_events` on both dialects, so the
  append-only rule holds for raw SQL too, not only for the ORM listeners in app/db/models.py.
  PostgreSQL: one plpgsql function + a BEFORE UPDATE OR DELETE row trigger (TRUNCATE does not
  fire row triggers: it is the rebuild path). SQLite: two BEFORE triggers with RAISE(ABORT);
  `flywheel projections rebuild` drops and re-creates them inside its own transaction
  (app/projector/projector.py `reset_projections`). Note for later migrations: a SQLite
  batch operation on deployment_events recreates the table and would drop these triggers;
  re-create them in that migration.
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

MESSAGE = ("deployment_events is append-only: {op} refused (the table is a projection of the "
           "deployments topic; replay it with `flywheel projections rebuild`)")

PG_FUNCTION = f"""
CREATE FUNCTION flywheel_deployment_events_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '{MESSAGE.format(op="%")}', TG_OP
        USING ERRCODE = 'restrict_violation', DETAIL = 'event_id ' || OLD.event_id;
    RETURN NULL;
END
$$
"""
PG_TRIGGER = """
CREATE TRIGGER deployment_events_append_only
BEFORE UPDATE OR DELETE ON deployment_events
FOR EACH ROW EXECUTE FUNCTION flywheel_deployment_events_append_only()
"""
SQLITE_TRIGGERS = [
    f"""CREATE TRIGGER deployment_events_no_{op.lower()} BEFORE {op} ON deployment_events
BEGIN
    SELECT RAISE(ABORT, '{MESSAGE.format(op=op)}');
END"""
    for op in ("UPDATE", "DELETE")
]


def upgrade() -> None:
    op.create_table('deployment_state',
    sa.Column('model', sa.String(length=128), nullable=False),
    sa.Column('champion', sa.String(length=32), nullable=True),
    sa.Column('candidate', sa.String(length=32), nullable=True),
    sa.Column('traffic_pct', sa.Float(), nullable=False),
    sa.Column('phase', sa.String(length=16), nullable=False),
    sa.Column('step_index', sa.Integer(), nullable=True),
    sa.Column('last_analysis', sa.JSON(), nullable=False),
    sa.Column('last_registered_version', sa.String(length=32), nullable=True),
    sa.Column('last_registered_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_event_id', sa.String(length=64), nullable=True),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('model')
    )
    with op.batch_alter_table('replicas', schema=None) as batch_op:
        batch_op.add_column(sa.Column('model', sa.String(length=128), nullable=True))
        batch_op.create_index(batch_op.f('ix_replicas_model'), ['model'], unique=False)

    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute(PG_FUNCTION)
        op.execute(PG_TRIGGER)
    elif dialect == "sqlite":
        for ddl in SQLITE_TRIGGERS:
            op.execute(ddl)
    else:
        raise NotImplementedError(f"no append-only guard for dialect {dialect!r}; add one to migration 0002")


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS deployment_events_append_only ON deployment_events")
        op.execute("DROP FUNCTION IF EXISTS flywheel_deployment_events_append_only()")
    elif dialect == "sqlite":
        for name in ("update", "delete"):
            op.execute(f"DROP TRIGGER IF EXISTS deployment_events_no_{name}")

    with op.batch_alter_table('replicas', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_replicas_model'))
        batch_op.drop_column('model')

    op.drop_table('deployment_state')
