"""The `flywheel` command line: one entry point for every role.

This package assembles the root typer app from one module per command group (kafka, db,
keys, projections, model, streams) and the modules of the top-level commands (config, roles,
pretrain, local for `run`, report); common.py holds what they share (the console, settings).
Each module imports only typer, rich and its neighbours at the top; heavy imports (torch,
mlflow, faust, sqlalchemy) happen inside the commands, after argument parsing, so
`flywheel --help` is instant.

    flywheel run                      # the whole local stack on embedded defaults
    flywheel kafka start|stop|status  # the embedded Kafka broker
    flywheel db upgrade               # alembic upgrade head
    flywheel keys create --scope ingest
    flywheel keys list | revoke PREFIX
    flywheel api --host 0.0.0.0 --port 8000
    flywheel report --out report.html   # one self-contained HTML page of the loop's history

May import: app.api, app.config_reference, app.controller, app.db, app.infra, app.projector, app.replica, app.report, app.run, app.settings, app.simulate, policy, streams, trainer
Tests: tests/integration/test_docs_commands.py, tests/integration/db/test_keys.py, tests/integration/test_kafka_broker.py
Docs: docs/OPERATIONS.md, docs/CONFIGURATION.md
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from app.cli import config, local, pretrain, report, roles
from app.cli.common import _setup_logging
from app.cli.db import db_app
from app.cli.kafka import kafka_app
from app.cli.keys import keys_app
from app.cli.model import model_app
from app.cli.projections import projections_app
from app.cli.streams import streams_app

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Flywheel: online learning from production feedback.",
)


@app.callback()
def _main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    _setup_logging(verbose)


# The top-level commands, in the order `flywheel --help` lists them.
app.command("config")(config.config)
app.command("api")(roles.api_cmd)
app.command("trainer")(roles.trainer_cmd)
app.command("controller")(roles.controller_cmd)
app.command("pretrain")(pretrain.pretrain_cmd)
app.command("run")(local.run)
app.command("replica")(roles.replica)
app.command("simulate")(roles.simulate)
app.command("report")(report.report)

# The command groups, listed after the commands.
app.add_typer(kafka_app, name="kafka")
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
app.add_typer(projections_app, name="projections")
app.add_typer(model_app, name="model")
app.add_typer(streams_app, name="streams")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
