"""`flywheel streams`: run a streams worker (Faust), or re-label the log under another reward spec."""

from __future__ import annotations

import logging
from typing import Annotated, NoReturn

import typer

from app.cli.common import _configured, _settings, console

streams_app = typer.Typer(
    help="The streams role: `flywheel streams` runs a worker; `relabel` re-derives rewards from the log."
)

_STREAMS_HOST = Annotated[
    str | None, typer.Option(help="Bind address of the Prometheus /metrics endpoint.")
]
_STREAMS_PORT = Annotated[
    int | None, typer.Option(help="Port of the Prometheus endpoint (0 disables).")
]


@streams_app.callback(invoke_without_command=True)
def streams_cmd(ctx: typer.Context, host: _STREAMS_HOST = None, port: _STREAMS_PORT = None) -> None:
    """Run one streams worker (Faust): interactions -> rollouts, late, dlq, version metrics. See docs/STREAMS.md."""
    if ctx.invoked_subcommand is None:
        _run_streams_worker(host, port)


@streams_app.command("run")
def streams_run(host: _STREAMS_HOST = None, port: _STREAMS_PORT = None) -> None:
    """Run one streams worker (the same as plain `flywheel streams`)."""
    _run_streams_worker(host, port)


def _run_streams_worker(host: str | None, port: int | None) -> None:
    from streams.config import StreamsConfig
    from streams.worker import run_worker

    cfg = _configured(StreamsConfig, metrics_host=host, metrics_port=port)
    run_worker(
        _settings(), cfg, loglevel="INFO" if logging.getLogger().level <= logging.DEBUG else None
    )


@streams_app.command("relabel")
def streams_relabel(
    reward_spec: Annotated[
        str,
        typer.Option(
            "--reward-spec",
            help="Version of the spec to label with (known: v1, hackable-tools, hackable-silence, sessions-v1, sessions-v2 in streams/reward.py KNOWN_SPECS; or any new name with --reward-weights).",
        ),
    ],
    since: Annotated[
        str,
        typer.Option(
            "--since",
            help="Replay interactions recorded at or after this RFC 3339 time, e.g. 2026-11-21T10:00:00Z.",
        ),
    ],
    until: Annotated[
        str | None,
        typer.Option(
            "--until",
            help="Only generations recorded before this time (default: everything up to the end of the log at start).",
        ),
    ] = None,
    reward_weights: Annotated[
        str | None,
        typer.Option(
            "--reward-weights",
            help="Weights (JSON) of a spec version that is not known, e.g. '{\"tool_error\": -1.5}' (unset weights keep v1's).",
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Replay and count; write nothing.")
    ] = False,
    idle_timeout: Annotated[
        float,
        typer.Option(
            "--idle-timeout",
            min=1.0,
            help="Fail when no record arrives for this many seconds while the replay is below its end offsets.",
        ),
    ] = 60.0,
) -> None:
    """Re-label interactions under another reward spec, beside the live worker (docs/STREAMS.md).

    Replays from --since to the log's end at start, writes rollouts keyed '<request_id>|<spec>'
    next to the live ones, and prints the counts as one JSON line."""
    import json as _json

    opts = _relabel_options(reward_spec, since, until, reward_weights, dry_run, idle_timeout)
    counts = _relabel_with_progress(opts)
    summary = dict(
        counts.as_dict(), reward_spec=opts.spec.version, relabel_run=opts.run_id, dry_run=dry_run
    )
    typer.echo(_json.dumps(summary, sort_keys=True))


def _relabel_refused(message: str) -> NoReturn:
    console.print(f"[red]flywheel streams relabel:[/red] {message}")
    raise typer.Exit(2)


def _relabel_options(
    reward_spec: str,
    since: str,
    until: str | None,
    reward_weights: str | None,
    dry_run: bool,
    idle_timeout: float,
):
    """The `RelabelOptions` of the flags; a bad spec, weights object or time exits 2 naming the
    flag (not the FLYWHEEL_STREAMS_* variable the streams code names)."""
    from pydantic import ValidationError

    from streams.relabel import RelabelOptions, parse_time
    from streams.reward import RewardWeights, resolve_spec

    try:
        weights = (
            RewardWeights.model_validate_json(reward_weights)
            if reward_weights is not None
            else None
        )
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "(value)"
        _relabel_refused(
            f"--reward-weights is not a weights object: {where}: {first['msg']} "
            f"(fields: {', '.join(RewardWeights.model_fields)})"
        )
    try:
        spec = resolve_spec(reward_spec, weights)
        return RelabelOptions(
            spec=spec,
            since=parse_time(since, "--since"),
            until=parse_time(until, "--until") if until is not None else None,
            dry_run=dry_run,
            idle_timeout_s=idle_timeout,
        )
    except ValueError as exc:
        _relabel_refused(
            str(exc)
            .replace("FLYWHEEL_STREAMS_REWARD_WEIGHTS (JSON)", "--reward-weights (JSON)")
            .replace(
                "set FLYWHEEL_STREAMS_REWARD_SPEC to a new name", "pass --reward-spec a new name"
            )
        )


def _relabel_with_progress(opts):
    """Run the replay under a progress bar; the counts. A failed replay exits 1."""
    from kafka.errors import KafkaError
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from streams.config import StreamsConfig
    from streams.relabel import relabel

    cfg = _configured(StreamsConfig)
    settings = _settings()
    with Progress(
        TextColumn("relabel {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task(f"{settings.topic('interactions')} -> {opts.spec.version}", total=None)
        try:
            return relabel(
                settings,
                cfg,
                opts,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
            )
        except (
            RuntimeError,
            KafkaError,
        ) as exc:  # a write the broker refused, no progress, no topic
            console.print(
                f"[red]relabel failed:[/red] {type(exc).__name__}: {exc} (records acknowledged before "
                "the failure stay on the topics; run it again: the trainer dedupes the repeats)"
            )
            raise typer.Exit(1) from None
