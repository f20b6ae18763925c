"""`flywheel run`: the whole loop on one machine, every role under one supervisor (app/run.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from app.cli.common import _configured, _refused, _settings


def run(
    replicas: Annotated[int, typer.Option(help="Inference replicas to start.")] = 2,
    replica_base_port: Annotated[
        int, typer.Option(help="Replica i listens on this port + i.")
    ] = 8100,
    no_simulate: Annotated[
        bool, typer.Option("--no-simulate", help="Do not start the simulated editor population.")
    ] = False,
    no_live: Annotated[
        bool, typer.Option("--no-live", help="Plain log lines instead of the live status view.")
    ] = False,
    duration: Annotated[
        str | None, typer.Option(help="Stop by itself after this long (e.g. 10m).")
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            help="A Hugging Face causal LM directory to run the loop on (FLYWHEEL_MODEL_DIR): "
            "imported into an empty registry, resumed on one that holds it.",
        ),
    ] = None,
    agents: Annotated[
        bool,
        typer.Option(
            "--agents",
            help="Run the loop on agent sessions (simulated agent users implementing functions in sandboxed "
            "repositories through tool calls) instead of editor completions.",
        ),
    ] = False,
    replica_engine: Annotated[
        list[str] | None,
        typer.Option(
            "--replica-engine",
            help="Engine of each replica in order (torch or vllm; repeat; the last one is used "
            "for the rest). Default: FLYWHEEL_REPLICA_ENGINE for all.",
        ),
    ] = None,
) -> None:
    """Run the whole loop locally on the embedded defaults (Kafka, MLflow, API and every role)."""
    from app.run import RunOptions, run_local
    from app.settings import Settings, parse_duration

    settings = _settings() if model is None else _configured(Settings, model_dir=model)
    engines = list(replica_engine or [])
    if bad := [e for e in engines if e not in ("torch", "vllm")]:
        raise _refused(f"--replica-engine must be torch or vllm, got {bad[0]!r}")

    opts = RunOptions(
        replicas=replicas,
        replica_engines=engines,
        replica_base_port=replica_base_port,
        simulate=not no_simulate,
        live=not no_live,
        duration_s=parse_duration(duration) if duration else None,
        agents=agents,
    )
    raise typer.Exit(run_local(settings, opts))
