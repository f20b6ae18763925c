"""The `flywheel` command line: one entry point for every role.

Heavy imports (torch, mlflow, faust) happen inside the commands, after argument parsing,
so `flywheel --help` is instant.

    flywheel run                      # the whole local stack on embedded defaults
    flywheel kafka start|stop|status  # the embedded Kafka broker
    flywheel db upgrade               # alembic upgrade head
    flywheel keys create --scope ingest
    flywheel keys list | revoke PREFIX
    flywheel api --host 0.0.0.0 --port 8000
    flywheel report --out report.html   # one self-contained HTML page of the loop's history
"""

from __future__ import annotations

import enum
import logging
import sys
from datetime import UTC
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Flywheel: online learning from production feedback.",
)
kafka_app = typer.Typer(no_args_is_help=True, help="The embedded single-node Kafka broker (KRaft).")
db_app = typer.Typer(no_args_is_help=True, help="The app database (SQLAlchemy + Alembic).")
keys_app = typer.Typer(no_args_is_help=True, help="API keys (stored hashed, with scopes).")
projections_app = typer.Typer(no_args_is_help=True, help="SQL projections of flywheel.deployments.")
app.add_typer(kafka_app, name="kafka")
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
model_app = typer.Typer(no_args_is_help=True, help="Bring your own Hugging Face causal LM.")
app.add_typer(projections_app, name="projections")
app.add_typer(model_app, name="model")

console = Console(stderr=True)


def _setup_logging(verbose: bool = False) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(name)s: %(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
        force=True,
    )
    for noisy in ("kafka", "aiokafka", "urllib3", "httpx", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _invalid(exc: Exception) -> typer.Exit:
    """Print a settings ValidationError (its locations are the FLYWHEEL_* variables,
    app/settings_base.py) and the exit to raise: status 2."""
    console.print("[red]invalid configuration:[/red]")
    _say(str(exc))
    return typer.Exit(2)


def _say(text: str, **style) -> None:
    """Print `text` as it is (no rich markup or highlighting: it may hold paths and brackets)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True, **style)


def _refused(text: str) -> typer.Exit:
    """Say why a command refused its input; the exit to raise: status 2."""
    _say(text)
    return typer.Exit(2)


def _settings():
    """The process-wide `Settings` from the environment."""
    from pydantic import ValidationError

    from app.settings import get_settings

    try:
        return get_settings()
    except ValidationError as exc:
        raise _invalid(exc) from None


def _configured(cls, **flags):
    """A role's settings class read from the environment, each CLI flag that was given
    overriding the field of the same name: the one way a flag reaches a setting (a flag wins
    over its FLYWHEEL_* variable). A bad value, from a flag or the environment, exits 2 naming
    the variable."""
    from pydantic import ValidationError

    try:
        return cls(**{name: value for name, value in flags.items() if value is not None})
    except ValidationError as exc:
        raise _invalid(exc) from None


@app.callback()
def _main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    _setup_logging(verbose)


# --- kafka -----------------------------------------------------------------------------------
@kafka_app.command("start")
def kafka_start() -> None:
    """Resolve Kafka's jars (once), format storage (first start), start the broker, create the topics."""
    from app.infra.kafka import LocalKafka, ensure_topics

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
    from app.infra.kafka import ensure_topics

    s = _settings()
    created = ensure_topics(s)
    console.print(f"created topics: {', '.join(created)}" if created else "all topics exist")


@kafka_app.command("stop")
def kafka_stop() -> None:
    """Stop the embedded broker (controlled shutdown)."""
    from app.infra.kafka import LocalKafka

    broker = LocalKafka.from_settings(_settings())
    console.print("kafka stopped" if broker.stop() else "kafka was not running")


@kafka_app.command("status")
def kafka_status() -> None:
    """Exit 0 when the embedded broker runs and answers, 1 otherwise."""
    from app.infra.kafka import LocalKafka

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


@app.command("config")
def config(
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Print the README's reference table.")
    ] = False,
) -> None:
    """Every FLYWHEEL_* setting with its default and meaning (the configuration reference)."""
    from app.config_reference import all_settings
    from app.config_reference import markdown as render

    if markdown:
        typer.echo(render())
        return
    from rich.table import Table

    table = Table("variable", "default", "what")
    for row in all_settings():
        table.add_row(row.env, "" if row.default is None else str(row.default), row.description)
    Console().print(table)


# --- db & keys --------------------------------------------------------------------------------
@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument(help="Target revision.")] = "head") -> None:
    """Apply the Alembic migrations to FLYWHEEL_DATABASE_URL (default: SQLite in the data dir)."""
    from app.db.migrate import upgrade

    s = _settings()
    s.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(s.db_url, revision)
    console.print(f"database at {s.db_url} upgraded to {revision}")


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision, e.g. base or -1.")],
) -> None:
    """Revert the Alembic migrations down to REVISION."""
    from app.db.migrate import downgrade

    s = _settings()
    downgrade(s.db_url, revision)
    console.print(f"database at {s.db_url} downgraded to {revision}")


class Scope(str, enum.Enum):
    ingest = "ingest"
    read = "read"
    admin = "admin"


@keys_app.command("create")
def keys_create(
    scope: Annotated[
        list[Scope],
        typer.Option("--scope", "-s", help="ingest, read or admin; repeat for several."),
    ],
    name: Annotated[str, typer.Option(help="A label for the key (who or what uses it).")] = "",
) -> None:
    """Create an API key. The key is printed alone on the last line of stdout (shown only once)."""
    from app.db.keys import create_key
    from app.db.migrate import upgrade
    from app.db.session import session_scope

    s = _settings()
    s.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(s.db_url, "head")
    with session_scope(s.db_url) as session:
        key, row = create_key(session, [sc.value for sc in scope], name=name)
        console.print(
            f"created key {row.prefix} with scopes {row.scopes} (store it now; it is not shown again)"
        )
    typer.echo(key)


def _utc_iso(dt) -> str:
    """ISO 8601 in UTC; SQLite hands back naive datetimes that were stored as UTC."""

    return (
        (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).astimezone(UTC).isoformat(timespec="seconds")
    )


@keys_app.command("list")
def keys_list(
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON object per key on stdout instead of a table.")
    ] = False,
) -> None:
    """Every API key: prefix, name, scopes, created and revoked times (never the key itself)."""
    import json

    from rich.table import Table

    from app.db.keys import list_keys
    from app.db.migrate import upgrade
    from app.db.session import session_scope

    s = _settings()
    s.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(s.db_url, "head")
    with session_scope(s.db_url) as session:
        rows = [
            {
                "prefix": r.prefix,
                "name": r.name,
                "scopes": sorted(r.scope_set),
                "created_at": _utc_iso(r.created_at),
                "revoked_at": _utc_iso(r.revoked_at) if r.revoked_at else None,
            }
            for r in list_keys(session)
        ]
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row))
        return
    table = Table("prefix", "name", "scopes", "created", "revoked")
    for row in rows:
        table.add_row(
            f"fw_{row['prefix']}",
            row["name"],
            ",".join(row["scopes"]),
            row["created_at"],
            row["revoked_at"] or "",
        )
    Console(width=200).print(table)
    console.print(
        f"{len(rows)} key{'' if len(rows) == 1 else 's'}, {sum(r['revoked_at'] is None for r in rows)} active"
    )


@keys_app.command("revoke")
def keys_revoke(
    prefix: Annotated[
        str,
        typer.Argument(
            help="The key's prefix as `flywheel keys list` shows it (fw_1a2b3c4d), "
            "or its first 4+ hex digits."
        ),
    ],
) -> None:
    """Revoke one API key by prefix (idempotent). Exit 1 when no key or several keys match."""
    from app.db.keys import KeyNotFound, revoke_key
    from app.db.migrate import upgrade
    from app.db.session import session_scope

    s = _settings()
    s.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(s.db_url, "head")
    try:
        with session_scope(s.db_url) as session:
            done = revoke_key(session, prefix)
            key = done.key
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    except KeyNotFound as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    when = _utc_iso(key.revoked_at)
    if done.already_revoked:
        console.print(
            f"key fw_{key.prefix} ({key.name or 'unnamed'}) was already revoked at {when}"
        )
    else:
        console.print(
            f"revoked key fw_{key.prefix} ({key.name or 'unnamed'}) at {when}; the API refuses it within "
            f"FLYWHEEL_KEY_CACHE_TTL ({s.key_cache_ttl:g}s)"
        )


# --- projections (app/deployments/projector.py) ------------------------------------------------
@projections_app.command("rebuild")
def projections_rebuild() -> None:
    """Replay flywheel.deployments from the beginning into emptied projection tables (one transaction)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn

    from app.db.migrate import upgrade
    from app.deployments.projector import rebuild

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
        f"{report.events_applied} applied, {report.duplicates} duplicates, {report.seconds:.2f}s"
    )


@projections_app.command("follow")
def projections_follow() -> None:
    """Keep the projections up to date: consume flywheel.deployments (group flywheel-projector).

    Waits for the database, then the broker and the topic, whatever starts first."""
    import signal
    import threading

    from app.db.migrate import upgrade
    from app.deployments.projector import follow
    from app.infra.wait import Stopped, database_ready, wait_for

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


# --- roles (each added by the issue that builds it) ---------------------------------------------
@app.command("api")
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


streams_app = typer.Typer(
    help="The streams role: `flywheel streams` runs a worker; `relabel` re-derives rewards from the log."
)
app.add_typer(streams_app, name="streams")

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
            help="Version of the spec to label with (known: v1, or any new name with --reward-weights).",
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

    from kafka.errors import KafkaError
    from pydantic import ValidationError
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from streams.config import StreamsConfig
    from streams.relabel import RelabelOptions, parse_time, relabel
    from streams.reward import RewardWeights, resolve_spec

    def refuse(message: str) -> None:
        console.print(f"[red]flywheel streams relabel:[/red] {message}")
        raise typer.Exit(2)

    try:
        weights = (
            RewardWeights.model_validate_json(reward_weights)
            if reward_weights is not None
            else None
        )
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "(value)"
        refuse(
            f"--reward-weights is not a weights object: {where}: {first['msg']} "
            f"(fields: {', '.join(RewardWeights.model_fields)})"
        )
    try:
        spec = resolve_spec(reward_spec, weights)
        opts = RelabelOptions(
            spec=spec,
            since=parse_time(since, "--since"),
            until=parse_time(until, "--until") if until is not None else None,
            dry_run=dry_run,
            idle_timeout_s=idle_timeout,
        )
    except ValueError as exc:
        refuse(
            str(exc)
            .replace("FLYWHEEL_STREAMS_REWARD_WEIGHTS (JSON)", "--reward-weights (JSON)")
            .replace(
                "set FLYWHEEL_STREAMS_REWARD_SPEC to a new name", "pass --reward-spec a new name"
            )
        )
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
        task = bar.add_task(f"{settings.topic('interactions')} -> {spec.version}", total=None)
        try:
            counts = relabel(
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
    summary = dict(
        counts.as_dict(), reward_spec=spec.version, relabel_run=opts.run_id, dry_run=dry_run
    )
    typer.echo(_json.dumps(summary, sort_keys=True))


@app.command("trainer")
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


@app.command("controller")
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


@app.command("pretrain")
def pretrain_cmd(
    out: Annotated[
        str,
        typer.Option("--out", help="Directory for config.json + model.safetensors (fp32 masters)."),
    ],
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 600,
    seed: Annotated[
        int, typer.Option(help="Seed of the corpus, the initialisation and the batches.")
    ] = 0,
    batch_size: Annotated[int, typer.Option(help="Documents per step.")] = 16,
    threads: Annotated[
        int,
        typer.Option(help="torch intra-op threads (1 avoids contention on small shared boxes)."),
    ] = 1,
) -> None:
    """Pretrain the base policy on the synthetic code corpus and save it (trainer/pretrain.py, docs/NUMERICS.md)."""
    import torch
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from trainer.pretrain import pretrain_to_dir

    torch.set_num_threads(threads)
    with Progress(
        TextColumn("pretrain"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeRemainingColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("pretrain", total=steps, loss="-")
        policy, path = pretrain_to_dir(
            out,
            {"batch_size": batch_size},
            steps=steps,
            seed=seed,
            on_step=lambda s, loss: progress.update(task, advance=1, loss=f"{loss:.3f}"),
        )
    sample = policy.generate(
        [policy.tokenizer.encode("def ")], max_tokens=160, temperature=0.7, seed=seed
    )[0]
    console.print(f"saved {path}; sample (T=0.7):\n[cyan]def {sample.text}[/cyan]")


@model_app.command("import")
def model_import(
    model_dir: Annotated[
        Path,
        typer.Argument(help="A save_pretrained directory: config.json, *.safetensors, tokenizer."),
    ],
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Delete the registered model's versions and import as version 1."
        ),
    ] = False,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="When the registered model's versions were imported from this very model (same "
            "files and weights), keep them (publishing v1's version_registered if the deployment "
            "log lacks it) and exit 0: an import step run on every start.",
        ),
    ] = False,
) -> None:
    """Validate MODEL_DIR and register it as version 1 of FLYWHEEL_MODEL_NAME, with champion on it;
    its `version_registered` goes on the deployment log (Kafka must answer, or nothing is registered)."""
    from trainer.model_import import (
        DeploymentLogUnavailable,
        ModelImportError,
        import_model,
    )
    from trainer.policy.hf_files import CACHE_DIR

    settings = _settings()
    try:
        done = import_model(
            model_dir,
            settings,
            force=force,
            resume=resume,
            cache_root=settings.data_dir / CACHE_DIR,
        )
    except ModelImportError as exc:
        raise _refused(f"model import refused: {exc}") from None
    except DeploymentLogUnavailable as exc:
        _say(f"model import failed: {exc}")
        raise typer.Exit(1) from None
    if done.resumed:
        missing = "; its missing version_registered event published" if done.published else ""
        _say(f"{model_dir} already imported: versions kept (--resume){missing}")
        return
    console.print(f"imported {model_dir} as {settings.model_name} v{done.version} (champion)")


@model_app.command("export")
def model_export(
    version: Annotated[int, typer.Argument(help="The registered version to export.")],
    out: Annotated[
        Path, typer.Option("--out", help="Directory to write (must not exist or be empty).")
    ],
    merged: Annotated[
        bool,
        typer.Option(
            "--merged",
            help="LoRA: merge the adapter into the base weights (else base + adapter/ for peft).",
        ),
    ] = False,
) -> None:
    """Write VERSION of FLYWHEEL_MODEL_NAME as a directory AutoModelForCausalLM.from_pretrained loads."""
    from trainer.model_export import ExportError, export_version
    from trainer.policy.hf_files import CACHE_DIR

    settings = _settings()
    try:
        path = export_version(
            version,
            out,
            settings.mlflow_uri,
            settings.model_name,
            merged=merged,
            cache_root=settings.data_dir / CACHE_DIR,
        )
    except ExportError as exc:
        raise _refused(f"model export refused: {exc}") from None
    lora = (path / "adapter").is_dir()
    console.print(
        f"exported {settings.model_name} v{version} to {path}"
        + (" (base + adapter/ for peft)" if lora else " (merged)" if merged else "")
    )


@app.command("run")
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
    )
    raise typer.Exit(run_local(settings, opts))


@app.command("replica")
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


@app.command("simulate")
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
    """A simulated editor population: ask replicas for completions, send feedback to the API."""
    import asyncio
    import threading

    from app.settings import parse_duration
    from app.simulate.config import SimulateConfig
    from app.simulate.population import Population

    stop = threading.Event()
    if evaluate:
        s = _settings()

        def _evaluate_loop() -> None:
            from app.simulate.evaluate import HeldOutEvaluator

            evaluator = HeldOutEvaluator(s.mlflow_uri, s.model_name)
            while not stop.wait(10.0):
                try:
                    results = evaluator.evaluate_new()
                    if results:
                        console.print(
                            "held-out acceptance by version: "
                            + ", ".join(f"v{v}={a:.3f}" for v, a in results.items())
                        )
                except Exception as exc:  # registry not up yet, or a version still uploading
                    logging.getLogger(__name__).warning("held-out evaluation failed: %s", exc)

        threading.Thread(target=_evaluate_loop, name="heldout-eval", daemon=True).start()
    pop = Population(api, api_key, replica, _configured(SimulateConfig))
    try:
        stats = asyncio.run(pop.run(parse_duration(duration) if duration else None))
    finally:
        stop.set()
    console.print(
        f"requests {stats.requests}, completions {stats.completions}, events {stats.events}, "
        f"errors {stats.errors}, acceptance by version {stats.acceptance()}"
    )


@app.command("report")
def report(
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Data dir to report on (default FLYWHEEL_DATA_DIR): its MLflow "
            "store and app database are read directly."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Where to write the page (default <data_dir>/report.html)."),
    ] = None,
    mlflow_uri: Annotated[
        str | None,
        typer.Option(help="A running MLflow server instead of <data_dir>/mlflow/mlflow.db."),
    ] = None,
    api: Annotated[
        str | None,
        typer.Option(help="Read deployment events from a running API's /v1/deployments/history."),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            help="Read-scope key for --api (default: <data_dir>/local-keys.json).",
            envvar="FLYWHEEL_REPORT_API_KEY",
        ),
    ] = None,
    from_kafka: Annotated[
        bool,
        typer.Option(
            "--from-kafka", help="Read deployment events from the <ns>.deployments topic."
        ),
    ] = False,
    model: Annotated[
        str | None, typer.Option(help="Registered model (default FLYWHEEL_MODEL_NAME).")
    ] = None,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Also print the per-version table as Markdown.")
    ] = False,
) -> None:
    """One self-contained HTML page: held-out acceptance, training curves, gate, canary, promotions and rollbacks."""
    import os

    from app.report import (
        ReportSources,
        SourceMissing,
        build_report,
        load_report_data,
        write_report,
    )
    from app.settings import Settings

    s = _configured(Settings, data_dir=data_dir, model_name=model)
    os.environ.setdefault(
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2"
    )  # a server that went away: fail in seconds, not minutes
    try:
        src = ReportSources.resolve(
            s, mlflow_uri=mlflow_uri, api_url=api, api_key=api_key, from_kafka=from_kafka
        )
        data = load_report_data(src)
    except SourceMissing as exc:
        _say(f"report: {exc}", style="red")
        raise typer.Exit(2) from None
    path = write_report(build_report(data), out or s.data_dir / "report.html")
    console.print(
        f"report of {data.model}: {len(data.versions)} versions, {len(data.events)} deployment events"
    )
    if markdown:
        from app.report.model import markdown_table, version_rows

        typer.echo(markdown_table(version_rows(data)))
    typer.echo(str(path))


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
