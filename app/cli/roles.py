"""The role commands, one long-running process each: `flywheel api`, `trainer`, `controller`,
`replica` and `simulate` (`flywheel streams` is its own group, app/cli/streams.py)."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from app.cli.common import _configured, _settings, console


def api_cmd(
    host: Annotated[
        str | None, typer.Option(help="Bind address (default: FLYWHEEL_API_HOST, 127.0.0.1).")
    ] = None,
    port: Annotated[
        int | None, typer.Option(help="Port (default: FLYWHEEL_API_PORT, 8000).")
    ] = None,
) -> None:
    """Serve the HTTP API (ingest, health, metrics); applies the migrations once the database answers (/readyz says what is missing)."""
    from app.api.server import serve
    from app.settings import Settings

    serve(_configured(Settings, api_host=host, api_port=port))


def trainer_cmd(
    port: Annotated[
        int | None,
        typer.Option(
            help="Port of the Prometheus /metrics endpoint (0 disables; default FLYWHEEL_TRAINER_METRICS_PORT); rank R serves it on port + its local rank."
        ),
    ] = None,
    nproc: Annotated[
        int | None,
        typer.Option(
            "--nproc",
            help="Ranks to start on this host with torchrun (default FLYWHEEL_TRAINER_NPROC; 1 = one process).",
        ),
    ] = None,
) -> None:
    """Continuous RL trainer: consume rollouts, train, register a version every FLYWHEEL_SHIP_INTERVAL (docs/TRAINER.md; several ranks: docs/SCALING.md)."""
    from trainer.config import TrainerConfig

    cfg = _configured(TrainerConfig, metrics_port=port, nproc=nproc)
    _settings()
    if cfg.nproc > 1:
        from trainer.launch import exec_torchrun

        exec_torchrun(cfg)  # does not return
    from trainer.launch import main as trainer_main

    trainer_main(cfg)


def controller_cmd(
    port: Annotated[
        int | None,
        typer.Option(
            help="Port of the Prometheus /metrics endpoint (0 disables; default FLYWHEEL_CONTROLLER_METRICS_PORT)."
        ),
    ] = None,
) -> None:
    """Rollout controller: offline gate, canary steps, promote/rollback, MLflow aliases (webhook + poll). docs/ROLLOUT.md."""
    from app.controller.config import ControllerSettings
    from app.controller.launch import run_controller

    run_controller(_settings(), _configured(ControllerSettings, metrics_port=port))


def replica(
    host: Annotated[
        str | None, typer.Option(help="Bind address (default FLYWHEEL_REPLICA_HOST).")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Port (default FLYWHEEL_REPLICA_PORT).")] = None,
    replica_id: Annotated[
        str | None,
        typer.Option(
            "--replica-id", help="Id in events and metrics (default FLYWHEEL_REPLICA_ID)."
        ),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            help="What generates: torch (built-in) or vllm (default FLYWHEEL_REPLICA_ENGINE; "
            "docs/REPLICA.md)."
        ),
    ] = None,
) -> None:
    """An inference replica: POST /v1/complete, follows flywheel.deployments, syncs weights by verified deltas."""
    from app.replica.config import ReplicaConfig
    from app.replica.server import serve

    cfg = _configured(ReplicaConfig, host=host, port=port, id=replica_id, engine=engine)
    serve(_settings(), cfg)


def simulate(
    api: Annotated[str, typer.Option(help="Ingest API root, e.g. http://127.0.0.1:8000.")],
    api_key: Annotated[
        str, typer.Option(help="A key with the ingest scope.", envvar="FLYWHEEL_SIMULATE_API_KEY")
    ],
    replica: Annotated[list[str], typer.Option(help="Replica root URL; repeat for several.")],
    duration: Annotated[
        str | None, typer.Option(help="Stop after this long (e.g. 10m); default: until Ctrl-C.")
    ] = None,
    evaluate: Annotated[
        bool, typer.Option(help="Also score every registered version on held-out users (MLflow).")
    ] = True,
) -> None:
    """A simulated editor population: ask replicas for completions, send feedback to the API
    (FLYWHEEL_SIMULATE_AGENTS: agent users working sessions with tools instead)."""
    import asyncio
    import signal
    import threading

    from app.settings import parse_duration
    from app.simulate.config import SimulateConfig

    cfg = _configured(SimulateConfig)
    # `flywheel run` stops its roles with SIGTERM: stop as on Ctrl-C (asyncio.run cancels the
    # sessions in flight, and each removes its sandbox), not by the signal's default action, which
    # leaves every open sandbox behind (tests/integration/simulate/test_stop.py)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    stop = threading.Event()
    if evaluate:
        s = _settings()

        def _evaluate_loop() -> None:
            if cfg.agents:
                from app.simulate.agent_eval import AgentEvaluator as Evaluator
            else:
                from app.simulate.evaluate import HeldOutEvaluator as Evaluator

            evaluator = Evaluator(s.mlflow_uri, s.model_name)
            while not stop.wait(10.0):
                try:
                    results = evaluator.evaluate_new()
                    if results:
                        console.print(
                            f"{evaluator.METRIC} by version: "
                            + ", ".join(f"v{v}={a:.3f}" for v, a in results.items())
                        )
                except Exception as exc:  # registry not up yet, or a version still uploading
                    logging.getLogger(__name__).warning("held-out evaluation failed: %s", exc)

        threading.Thread(target=_evaluate_loop, name="heldout-eval", daemon=True).start()
    seconds = parse_duration(duration) if duration else None
    try:
        if cfg.agents:
            from app.simulate.agents import AgentPopulation

            agent_stats = asyncio.run(AgentPopulation(api, api_key, replica, cfg).run(seconds))
            console.print(
                f"sessions {agent_stats.sessions}, turns {agent_stats.turns}, events "
                f"{agent_stats.events}, retried turns {agent_stats.retries}, sessions interrupted "
                f"{agent_stats.interrupted}, outcomes "
                f"{dict(agent_stats.outcomes)}, task success by version {agent_stats.task_success()}"
            )
            return
        from app.simulate.population import Population

        stats = asyncio.run(Population(api, api_key, replica, cfg).run(seconds))
    finally:
        stop.set()
    console.print(
        f"requests {stats.requests}, completions {stats.completions}, events {stats.events}, "
        f"errors {stats.errors}, acceptance by version {stats.acceptance()}"
    )
