"""`flywheel run`: the whole loop locally, on the embedded defaults.

Starts, in order: the embedded Kafka broker (and its topics), the database migrations, the
MLflow server (UI), the API, then every other role (streams worker, trainer, controller, two
replicas, the simulated editor population), each as its own process under a small supervisor
(app/supervisor.py). Prints the URLs, shows a live status view, and on Ctrl-C stops everything
cleanly. State lives in FLYWHEEL_DATA_DIR, so a second start resumes where the first stopped.

`flywheel run --model DIR` (FLYWHEEL_MODEL_DIR) runs the same loop on a Hugging Face causal LM
directory. Once MLflow is up and before any role starts, `flywheel model import DIR --resume` runs
in its own process (`prepare_model`; trainer/model_import.py validates DIR exactly as for a user):

- no version of FLYWHEEL_MODEL_NAME: DIR becomes version 1 and champion;
- the first version was imported from DIR itself (same config and tokenizer files, same weights):
  resume, nothing is imported;
- anything else (the built-in policy's versions, another model's, bad input): the import's
  one-line refusal is printed and nothing starts. There is no `--force`: replacing a registry's
  versions is `flywheel model import --force`'s job, done on purpose, not as a side effect.

The trainer then gets FLYWHEEL_TRAINER_POLICY `{"type": "hf", "model_dir": DIR}` (HF options
already set in that variable, such as `kernels`, are kept), and the demo cadence leaves out what
only fits the built-in policy (its learning rate, pretraining steps and rollouts per version:
`HF_DEMO_SKIP`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from app.settings import Settings

if TYPE_CHECKING:
    from rich.console import Console

    from app.infra.kafka import LocalKafka
    from app.supervisor import Supervisor

log = logging.getLogger(__name__)


# The local run turns the loop at a demo cadence: a checkpoint every two minutes instead of every
# five hours, labels after 30 s instead of 15 min, canary steps of 20 s. Each is only a default:
# a variable already set in the environment wins.
DEMO_ENV = {
    "FLYWHEEL_SHIP_INTERVAL": "2m",
    "FLYWHEEL_WAIT_WINDOW": "30s",
    "FLYWHEEL_TRAINER_LR": "1e-4",
    # every version carries at least 256 rollouts of learning (a due ship waits for them): at the
    # ~1.7 rollouts/s measured with three demo stacks side by side, a 2-minute interval alone gave
    # 106-354 per version, and a run whose early versions got few learned slowest
    "FLYWHEEL_TRAINER_MIN_ROLLOUTS": "256",
    # a base that already writes the liked completion now and then (~1 in 3): 300 steps give ~1 in
    # 10, too rare for the reward to find within ten versions (measured: held-out 0.09, flat)
    "FLYWHEEL_TRAINER_PRETRAIN_STEPS": "600",
    # 2 requests/s (x2 candidates) leaves the trainer the CPU on a small machine
    "FLYWHEEL_SIMULATE_RPS": "2",
    "FLYWHEEL_CONTROLLER_GATE_ROLLOUTS": "64",
    # one canary step at 50% (the most informative split), then promotion. At ~4 labelled completions
    # a second the confidence sequence of a 50/50 split narrows to about +-0.25 reward units in two
    # minutes: a non-inferiority margin of 0.15 lets an equal-or-better version through within about
    # one ship interval, and a confidently worse one is rolled back. A version about equal to the
    # champion needs the sequence to narrow below the margin itself, (0.25/0.15)^2 x 2 min ~ 6 min:
    # at a 4-minute deadline those canaries paused and were superseded (the champion stayed put for
    # six versions in a demo run), so a step may take 8 minutes
    "FLYWHEEL_CONTROLLER_STEPS": "50,100",
    "FLYWHEEL_CONTROLLER_MIN_STEP": "30s",
    "FLYWHEEL_CONTROLLER_MIN_SAMPLES": "60",
    "FLYWHEEL_CONTROLLER_MARGIN": "0.15",
    "FLYWHEEL_CONTROLLER_CS_TARGET_N": "400",
    "FLYWHEEL_CONTROLLER_STEP_DEADLINE": "8m",
    "FLYWHEEL_STREAMS_METRICS_BUCKET": "10s",
    # the demo plants one bad checkpoint (weights blown up) to show the gate stopping it
    "FLYWHEEL_TRAINER_PLANT_BAD_VERSION": "4",
    # many role processes share a few cores: one torch/BLAS thread each avoids oversubscription
    # (measured 10-20x slower with 2 threads per process on a busy 2-core machine)
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


# demo settings tuned for the built-in 1.4M-parameter policy: a user's pretrained model keeps the
# trainer's own defaults (lr 1e-6, trainer/config.py), is never pretrained, and ships on the
# interval alone (it generates far slower on a CPU than the tiny policy: 256 rollouts a version
# would hold its ships for a long time)
HF_DEMO_SKIP = (
    "FLYWHEEL_TRAINER_LR",
    "FLYWHEEL_TRAINER_PRETRAIN_STEPS",
    "FLYWHEEL_TRAINER_MIN_ROLLOUTS",
)


class RunModelError(ValueError):
    """`flywheel run --model DIR` cannot run DIR on this registry; the message says why and what to do."""


@dataclass
class RunOptions:
    """Knobs of the local run (CLI flags of `flywheel run`)."""

    replicas: int = 2  # inference replicas to start
    replica_engines: list[str] = field(default_factory=list)  # engine of replica i (last repeats)
    replica_base_port: int = 8100  # replica i listens on base + i
    simulate: bool = True  # start the simulated editor population
    live: bool = True  # live status view (False: plain log lines)
    duration_s: float | None = None  # stop by itself after this long (tests, demos)
    extra_env: dict[str, str] = field(default_factory=dict)


def local_keys(settings: Settings) -> dict[str, str]:
    """API keys of the local profile (ingest, read, admin), created once and kept in the data dir."""
    from app.db.keys import create_key
    from app.db.session import session_scope

    path = settings.data_dir / "local-keys.json"
    if path.exists():
        return json.loads(path.read_text())
    keys = {}
    with session_scope(settings.db_url) as session:
        for scope in ("ingest", "read", "admin"):
            keys[scope], _ = create_key(session, [scope], name=f"local-{scope}")
    path.write_text(json.dumps(keys, indent=2))
    path.chmod(0o600)
    return keys


def hf_trainer_policy(model_dir: Path, configured: str | None) -> dict[str, object]:
    """The trainer's policy config for `--model DIR`: `configured` (FLYWHEEL_TRAINER_POLICY) may
    add HF options; a built-in policy config there is a contradiction and refused."""
    try:
        user = json.loads(configured) if configured and configured.strip() else {}
    except json.JSONDecodeError as exc:
        raise RunModelError(f"FLYWHEEL_TRAINER_POLICY is not JSON: {exc}") from None
    if not isinstance(user, dict) or (user and user.get("type") != "hf"):
        raise RunModelError(
            f"FLYWHEEL_TRAINER_POLICY={configured} configures the built-in policy, but --model "
            "runs a Hugging Face model: unset it, or give only HF options "
            '(e.g. {"type": "hf", "kernels": "default"})'
        )
    return {**user, "type": "hf", "model_dir": str(model_dir)}


def demo_env(model_dir: Path | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The roles' demo defaults (a variable set in `environ` wins); with `--model DIR`, without
    `HF_DEMO_SKIP` and with the trainer on DIR's HF policy."""
    demo = {k: v for k, v in DEMO_ENV.items() if k not in environ}
    if model_dir is None:
        return demo
    policy = hf_trainer_policy(model_dir, environ.get("FLYWHEEL_TRAINER_POLICY"))
    demo = {k: v for k, v in demo.items() if k not in HF_DEMO_SKIP}
    demo["FLYWHEEL_TRAINER_POLICY"] = json.dumps(policy)
    demo["FLYWHEEL_MODEL_DIR"] = str(model_dir)
    return demo


def prepare_model(settings: Settings, model_dir: Path, env: dict[str, str], log_dir: Path) -> str:
    """`flywheel model import DIR --resume` in its own process (output in `<log_dir>/model-import.log`):
    "imported" into an empty registry, "resumed" on one whose versions come from DIR;
    RunModelError with the import's one-line refusal otherwise (another model, bad input)."""
    import subprocess

    from mlflow import MlflowClient

    client = MlflowClient(settings.mlflow_uri, settings.mlflow_uri)
    held = client.search_model_versions(f"name='{settings.model_name}'", max_results=1)
    log_file = log_dir / "model-import.log"
    with open(log_file, "ab") as out:
        rc = subprocess.run(
            [sys.executable, "-m", "app.cli", "model", "import", str(model_dir), "--resume"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        ).returncode
    if rc != 0:
        lines = log_file.read_text(errors="replace").strip().splitlines()
        refused = [ln for ln in lines if ln.startswith("model import refused")]
        raise RunModelError(
            (refused or lines or [f"flywheel model import exited {rc}"])[-1] + f" (log: {log_file})"
        )
    return "resumed" if held else "imported"


def _http_ok(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code < 500
    except httpx.HTTPError:
        return False


def _stop_on_signals() -> None:
    """SIGTERM (a process manager, `timeout`, `docker stop`) and SIGHUP stop the stack as Ctrl-C does:
    the roles run in their own sessions, so a run killed without its cleanup would orphan them.
    SIGINT is set explicitly too: a process started in the background of a non-interactive shell
    inherits SIGINT as ignored, and Python then never raises KeyboardInterrupt for it."""
    import signal

    def _interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)


def run_local(settings: Settings, opts: RunOptions) -> int:
    from rich.console import Console

    from app.db.migrate import upgrade
    from app.infra.kafka import LocalKafka, ensure_topics
    from app.infra.mlflow_server import SERVER_ENV, host_port, mlflow_server_argv
    from app.supervisor import RoleSpec, Supervisor

    console = Console()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    _stop_on_signals()
    data_dir = settings.data_dir.resolve()
    model_dir = settings.model_dir.resolve() if settings.model_dir is not None else None
    try:
        demo = demo_env(model_dir, os.environ)
    except RunModelError as exc:
        console.print(f"[red]✗[/red] {exc}", highlight=False, soft_wrap=True)
        return 2
    env = {
        **demo,
        "FLYWHEEL_DATA_DIR": str(data_dir),
        "FLYWHEEL_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "FLYWHEEL_MLFLOW_URI": settings.mlflow_uri,
        "MLFLOW_TRACKING_URI": settings.mlflow_uri,
        "FLYWHEEL_DATABASE_URL": settings.db_url,
        **opts.extra_env,
    }
    py = [sys.executable, "-m", "app.cli"]
    sup = Supervisor(data_dir / "logs", env)
    broker = LocalKafka.from_settings(settings)
    started_broker = False
    try:
        with console.status(
            "starting Kafka (the first start resolves its jars from Maven Central)..."
        ):
            started_broker = not broker.running()
            broker.start(with_parent=True)
            ensure_topics(settings)
        console.print(f"[green]✓[/green] kafka {broker.bootstrap}  (logs {broker.home / 'logs'})")

        upgrade(settings.db_url)
        keys = local_keys(settings)
        console.print(
            f"[green]✓[/green] database {settings.db_url}  (local API keys in {data_dir / 'local-keys.json'})"
        )

        mhost, mport = host_port(settings.mlflow_uri)
        if _http_ok(f"{settings.mlflow_uri}/health"):
            console.print(
                f"[yellow]•[/yellow] reusing the MLflow server already on {settings.mlflow_uri}"
            )
        else:
            with console.status("starting the MLflow server..."):
                sup.start(
                    RoleSpec(
                        "mlflow",
                        mlflow_server_argv(data_dir / "mlflow", mhost, mport),
                        env=SERVER_ENV,
                        url=settings.mlflow_uri,
                        ready=lambda: _http_ok(f"{settings.mlflow_uri}/health"),
                        infra=True,
                    )
                )
            console.print(f"[green]✓[/green] mlflow  {settings.mlflow_uri}")

        if model_dir is not None:
            with console.status(f"checking the registry for {model_dir}..."):
                done = prepare_model(settings, model_dir, sup.base_env, data_dir / "logs")
            console.print(
                f"[green]✓[/green] model   {model_dir} ({done}; {settings.model_name} in MLflow)",
                highlight=False,
                soft_wrap=True,
            )

        api_url = f"http://{settings.api_host}:{settings.api_port}"
        with console.status("starting the API..."):
            sup.start(
                RoleSpec(
                    "api",
                    py + ["api", "--host", settings.api_host, "--port", str(settings.api_port)],
                    url=f"{api_url}/docs",
                    ready=lambda: _http_ok(f"{api_url}/healthz"),
                )
            )
        console.print(f"[green]✓[/green] api     {api_url}/docs")

        sup.start(RoleSpec("projections", py + ["projections", "follow"]), wait=False)
        console.print("[green]✓[/green] projections (flywheel.deployments → SQL)")
        for role in ("streams", "trainer", "controller"):
            sup.start(RoleSpec(role, py + [role]), wait=False)
            console.print(f"[green]✓[/green] {role}")
        replica_urls = []
        for i in range(opts.replicas):
            engines = opts.replica_engines
            engine = engines[min(i, len(engines) - 1)] if engines else None
            port = opts.replica_base_port + i
            url = f"http://127.0.0.1:{port}"
            replica_urls.append(url)
            sup.start(
                RoleSpec(
                    f"replica-{i}",
                    py
                    + [
                        "replica",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--replica-id",
                        f"replica-{i}",
                        *(["--engine", engine] if engine else []),
                    ],
                    url=url,
                ),
                wait=False,
            )
            console.print(
                f"[green]✓[/green] replica-{i} {url}" + (f" ({engine})" if engine else "")
            )
        if opts.simulate and replica_urls:
            sup.start(
                RoleSpec(
                    "simulate",
                    py
                    + [
                        "simulate",
                        "--api",
                        api_url,
                        "--api-key",
                        keys["ingest"],
                        *sum((["--replica", u] for u in replica_urls), []),
                    ],
                ),
                wait=False,
            )
            console.print("[green]✓[/green] simulated editor population")

        console.print(
            f"\nAPI docs  {api_url}/docs\nMLflow UI {settings.mlflow_uri}\nStatus    {api_url}/v1/deployments "
            f"(read key in {data_dir / 'local-keys.json'})\nLogs      {data_dir / 'logs'}\nCtrl-C stops everything.\n"
        )
        from app.status_view import StatusView, trainer_metrics_url

        view = StatusView(
            api_url,
            keys["read"],
            sup,
            mlflow_uri=settings.mlflow_uri,
            model_name=settings.model_name,
            trainer_metrics_url=trainer_metrics_url(sup.base_env),
        )
        deadline = None if opts.duration_s is None else time.monotonic() + opts.duration_s
        view.run(live=opts.live, until=deadline)
        return 0
    except KeyboardInterrupt:
        return 0
    except RunModelError as exc:
        console.print(f"[red]✗[/red] {exc}", highlight=False, soft_wrap=True)
        return 2
    finally:
        _stop(console, sup, broker if started_broker else None, data_dir)


def _say(console: Console, text: str) -> None:
    """Print, unless the output is gone: `flywheel run | tee run.log` and Ctrl-C end `tee` too,
    and a write to the closed pipe must not keep the cleanup from running."""
    try:
        console.print(text)
    except (OSError, ValueError):  # a closed stream
        pass
    except SystemExit:  # rich's Console.on_broken_pipe: stdout now goes to /dev/null
        pass


def _stop(console: Console, sup: Supervisor, broker: LocalKafka | None, data_dir: Path) -> None:
    """Stop every role, then the MLflow server, then the broker `flywheel run` started; a second
    Ctrl-C or a SIGTERM while stopping cannot cut this short (each step is bounded:
    `Supervisor.stop_all`, `LocalKafka.stop`), and nothing here depends on stdout."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    _say(console, "stopping...")
    start = time.monotonic()
    try:
        sup.stop_all()
        _say(console, f"roles stopped in {time.monotonic() - start:.1f}s")
    finally:
        if broker is not None:
            start = time.monotonic()
            broker.stop()
            _say(console, f"broker stopped in {time.monotonic() - start:.1f}s")
    _say(console, "stopped; state kept in " + str(data_dir))
