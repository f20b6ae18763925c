"""`flywheel projections`: the SQL projections of flywheel.deployments and, for the sessions
tables, flywheel.rollouts (app/projector/projector.py, app/projector/sessions.py)."""

from __future__ import annotations

import typer

from app.cli.common import _settings, console

projections_app = typer.Typer(
    no_args_is_help=True,
    help="SQL projections of flywheel.deployments (and of flywheel.rollouts: sessions).",
)


@projections_app.command("rebuild")
def projections_rebuild() -> None:
    """Replay flywheel.deployments (and flywheel.rollouts, for the sessions tables) from the beginning
    into emptied projection tables (one transaction)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn

    from app.db.migrate import upgrade
    from app.projector.projector import rebuild

    s = _settings()
    s.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(s.db_url, "head")
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), console=console, transient=True
    ) as bar:
        task = bar.add_task(f"replaying {s.topic('deployments')}", total=None)
        report = rebuild(s, progress=lambda n: bar.update(task, description=f"replayed {n} events"))
    console.print(
        f"rebuilt projections in {s.db_url} from {s.topic('deployments')}: {report.events_read} events read, "
        f"{report.events_applied} applied, {report.duplicates} duplicates; "
        f"{report.rollouts_read} rollouts read, {report.rollouts_applied} projected as session "
        f"segments; {report.seconds:.2f}s"
    )


@projections_app.command("follow")
def projections_follow() -> None:
    """Keep the projections up to date: consume flywheel.deployments and flywheel.rollouts (group
    flywheel-projector).

    Waits for the database, then the broker and the topic, whatever starts first."""
    import signal
    import threading

    from app.db.migrate import upgrade
    from app.infra.wait import Stopped, database_ready, wait_for
    from app.projector.projector import follow

    s = _settings()
    s.data_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        database_ready(s.db_url, stop)  # then the broker and the topic (follow)
        wait_for(
            "the database migrations (alembic upgrade head)",
            lambda: upgrade(s.db_url, "head"),
            stop=stop,
        )
        follow(s, stop=stop)
    except Stopped:
        return
    except KeyboardInterrupt:
        stop.set()
