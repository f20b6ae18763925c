"""`flywheel kafka`: the embedded single-node Kafka broker (app/infra/broker.py)."""

from __future__ import annotations

import typer

from app.cli.common import _settings, console

kafka_app = typer.Typer(no_args_is_help=True, help="The embedded single-node Kafka broker (KRaft).")


@kafka_app.command("start")
def kafka_start() -> None:
    """Resolve Kafka's jars (once), format storage (first start), start the broker, create the topics."""
    from app.infra.broker import LocalKafka, ensure_topics

    s = _settings()
    broker = LocalKafka.from_settings(s)
    with console.status(
        f"starting Kafka on {broker.bootstrap} (first start resolves jars from Maven Central)..."
    ):
        broker.start()
        created = ensure_topics(s, broker.bootstrap)
    console.print(
        f"kafka running on {broker.bootstrap} (pid {broker.pid()}), logs in {broker.home / 'logs'}"
    )
    if created:
        console.print(f"created topics: {', '.join(created)}")


@kafka_app.command("topics")
def kafka_topics() -> None:
    """Create the docs/DESIGN.md §Topics on FLYWHEEL_KAFKA_BOOTSTRAP (any cluster); idempotent."""
    from app.infra.broker import ensure_topics

    s = _settings()
    created = ensure_topics(s)
    console.print(f"created topics: {', '.join(created)}" if created else "all topics exist")


@kafka_app.command("stop")
def kafka_stop() -> None:
    """Stop the embedded broker (controlled shutdown)."""
    from app.infra.broker import LocalKafka

    broker = LocalKafka.from_settings(_settings())
    console.print("kafka stopped" if broker.stop() else "kafka was not running")


@kafka_app.command("status")
def kafka_status() -> None:
    """Exit 0 when the embedded broker runs and answers, 1 otherwise."""
    from app.infra.broker import LocalKafka

    broker = LocalKafka.from_settings(_settings())
    pid = broker.pid()
    if pid is None:
        console.print(f"kafka not running ({broker.home})")
        raise typer.Exit(1)
    try:
        broker.wait_ready(timeout=5)
    except Exception as exc:
        console.print(f"kafka pid {pid} is not answering on {broker.bootstrap}: {exc}")
        raise typer.Exit(1) from None
    console.print(f"kafka running: pid {pid}, {broker.bootstrap}, data {broker.home}")
