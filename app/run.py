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
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from app.settings import Settings

if TYPE_CHECKING:
    from rich.console import Console

    from app.infra.broker import LocalKafka
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
    # ... except the base's pretraining, which runs before any other role has work
    "FLYWHEEL_TRAINER_PRETRAIN_THREADS": "0",
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


# `flywheel run --agents`: the loop on agent sessions (app/simulate/agents.py) instead of editor
# completions. The reward is the sessions spec (turn feedback plus the session's outcome); the
# built-in policy gets a 1,024-token context (a session with its tool line, calls and results
# runs to about 600 bytes) and a base pretrained with agent sessions in 60% of its steps
# (trainer/corpus.py `agent_document`: the format and the moves, not the tasks' answers). With
# `--model DIR` only the first two apply (the model's context and weights are its own).
AGENT_DEMO_ENV = {
    "FLYWHEEL_SIMULATE_AGENTS": "true",
    "FLYWHEEL_STREAMS_REWARD_SPEC": "sessions-v1",
    "FLYWHEEL_TRAINER_POLICY": json.dumps({"max_context": 1024}),
    # 700 steps, 70% of them on agent sessions (docs/TRAINER.md "Agents")
    "FLYWHEEL_TRAINER_PRETRAIN_STEPS": "700",
    "FLYWHEEL_TRAINER_PRETRAIN_AGENT_SHARE": "0.7",
    # ... then mid-training on sessions of an agent that is always right: pretraining alone leaves
    # the tasks' skill at chance (p(right) 0.25 on the probe, trainer/skill_probe.py) whatever its
    # length, and mid-training learns it late and one verb at a time, so stopping at a mean of 0.35
    # gave a base holding one verb, which the loop did not spread. It trains on to 0.7, past the
    # onset of every verb (about 200 steps at 1e-3; 400 is a cap), and is scaled back along the
    # line to the pretrained weights to 0.4: a base holding all four (measured on two: 0.37 / 0.37
    # / 0.48 / 0.36 and 0.29 / 0.54 / 0.45 / 0.37; docs/TRAINER.md "Why it falls short")
    "FLYWHEEL_TRAINER_PRETRAIN_MID_STEPS": "400",
    "FLYWHEEL_TRAINER_PRETRAIN_MID_TARGET": "0.4",
    "FLYWHEEL_TRAINER_PRETRAIN_MID_PEAK": "0.7",
    # ... on three lines from the pretrained weights, keeping the base that tells the verbs apart
    # most: from one pretrained base three lines' bases at 0.4 told them apart by 0.003, -0.011
    # and 0.101, and run 11's base (0.002, `sub` and `mul` read as one verb) left both at chance
    # for 15 versions (docs/TRAINER.md "Why it falls short"); about 2 minutes a line
    "FLYWHEEL_TRAINER_PRETRAIN_MID_LINES": "3",
    # one rollout is a whole session here (about four turns); 64 a version (four steps of 16)
    "FLYWHEEL_TRAINER_MIN_ROLLOUTS": "64",
    # each task worked by 4 sessions at once, one group, and only sessions above their group's
    # mean pushed (negative advantages scaled by 0): at 1e-4 this lifted the bench's held-out
    # success 0.531 -> 0.719 in three versions, where plain advantages at 1e-4 collapsed into
    # give-ups (0.000 by v3) and 3e-5 did not move (docs/TRAINER.md "Why it falls short")
    "FLYWHEEL_SIMULATE_AGENT_PARALLEL": "4",
    "FLYWHEEL_TRAINER_ADV_NEGATIVE_SCALE": "0",
    # ... in reward units, not divided by the group's std: in a group where every session failed,
    # the std turned a tool error's difference (-0.5 against -1.0) into an advantage of +1.4, as
    # large as a success's, and the verb failed most (`mul`) got more of that credit on its wrong
    # operators than on its right one (run 9: 59.5 against 50.2; in reward units 29.5 against
    # 42.7). Trained offline on run 9's own records, `mul` fell 0.34 -> 0.17 with the std and held
    # at 0.31 without it (docs/TRAINER.md "Why it falls short", bench/verb_credit.py)
    "FLYWHEEL_TRAINER_ADV_SCALE": "none",
    # ... and only sessions that succeeded pushed up: in a group where every session failed, the
    # one that failed with fewer tool errors was above the mean, and run 13 credited `*` after
    # `add` 18.1 (8.6 of it from such groups) against 40.1 for `+`; the first run with the rule
    # (run 14, its base the best-separated yet) reached +46.9 by v10 (docs/TRAINER.md "Why it
    # falls short")
    "FLYWHEEL_TRAINER_ADV_POSITIVE_NEEDS_SUCCESS": "true",
    "FLYWHEEL_TRAINER_LR": "1e-4",
    # no self-distillation on tool errors: from the same base, with it the held-out tool errors
    # per turn doubled (0.079 -> 0.168) and task success fell to 0.266 by v3; without it they
    # fell (0.079 -> 0.039) and task success held (0.422 at v3; docs/TRAINER.md "Why it falls short")
    "FLYWHEEL_TRAINER_DISTILL_COEF": "0",
    # sessions end one at a time: a step waits for a whole batch of 16 instead of stepping on the
    # 1-4 that arrived within 2 s at a learning rate scaled down to match (run 2 of docs/TRAINER.md
    # "Agents": 3.5 sessions a step on average, about a fifth of the demo's rate, and no learning)
    "FLYWHEEL_TRAINER_MAX_WAIT_S": "60",
    # agent turns sampled at 0.6, live, in the held-out evaluation and in the gate (at 1 the base
    # garbles about one call in eight, and each garbled call is noise in its session's gradient)
    "FLYWHEEL_SIMULATE_AGENT_TEMPERATURE": "0.6",
    "FLYWHEEL_CONTROLLER_GATE_AGENT_TEMPERATURE": "0.6",
    # training waits for the verdict on a version 3 ahead of the champion: runs 12 and 15 garbled
    # their calls on versions trained on rollouts 4-5 versions behind the trainer, while the
    # versions before trained at 2-3.9 (docs/TRAINER.md "Waiting for a verdict")
    "FLYWHEEL_TRAINER_VERDICT_WAIT_AHEAD": "3",
    "FLYWHEEL_SIMULATE_USERS": "8",
    # the gate runs sessions with real tools on its own 12 tasks (2 sessions each): candidate,
    # champion and base. With 24 tasks a gate took 4 minutes for two policies, against a version
    # every 2.5 minutes
    "FLYWHEEL_CONTROLLER_GATE_AGENT_TASKS": "12",
}
AGENT_HF_SKIP = (
    "FLYWHEEL_TRAINER_POLICY",
    "FLYWHEEL_TRAINER_MAX_WAIT_S",  # a model far slower than the tiny policy steps on what it has
    # the built-in policy's garbling at temperature 1 is why agent turns sample at 0.6
    "FLYWHEEL_SIMULATE_AGENT_TEMPERATURE",
    "FLYWHEEL_CONTROLLER_GATE_AGENT_TEMPERATURE",
    "FLYWHEEL_TRAINER_PRETRAIN_STEPS",
    "FLYWHEEL_TRAINER_PRETRAIN_AGENT_SHARE",
    "FLYWHEEL_TRAINER_PRETRAIN_MID_STEPS",
    "FLYWHEEL_TRAINER_PRETRAIN_MID_TARGET",
    "FLYWHEEL_TRAINER_PRETRAIN_MID_PEAK",
    "FLYWHEEL_TRAINER_PRETRAIN_MID_LINES",
    # tuned for the built-in policy's RL (the model keeps the trainer's own lr, HF_DEMO_SKIP)
    "FLYWHEEL_TRAINER_ADV_NEGATIVE_SCALE",
    "FLYWHEEL_TRAINER_DISTILL_COEF",
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
    agents: bool = False  # agent sessions instead of editor completions (AGENT_DEMO_ENV)
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


def demo_env(
    model_dir: Path | None, environ: Mapping[str, str], agents: bool = False
) -> dict[str, str]:
    """The roles' demo defaults (a variable set in `environ` wins); with `agents`, the agent
    sessions' (`AGENT_DEMO_ENV`); with `--model DIR`, without `HF_DEMO_SKIP` (and
    `AGENT_HF_SKIP`) and with the trainer on DIR's HF policy."""
    defaults = {**DEMO_ENV, **AGENT_DEMO_ENV} if agents else DEMO_ENV
    demo = {k: v for k, v in defaults.items() if k not in environ}
    if model_dir is None:
        return demo
    demo = {k: v for k, v in demo.items() if k not in AGENT_HF_SKIP}
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


# Set by a stop signal. The handler also raises KeyboardInterrupt, but Python swallows one raised
# where exceptions are ignored (seen: inside logging's at-fork hook while the supervisor started a
# role, "Exception ignored in: <function _releaseLock>"): start-up and the status loop check this.
STOP = threading.Event()


def _stop_on_signals() -> None:
    """SIGTERM (a process manager, `timeout`, `docker stop`) and SIGHUP stop the stack as Ctrl-C does:
    the roles run in their own sessions, so a run killed without its cleanup would orphan them.
    SIGINT is set explicitly too: a process started in the background of a non-interactive shell
    inherits SIGINT as ignored, and Python then never raises KeyboardInterrupt for it."""
    import signal

    def _interrupt(signum: int, frame: object) -> None:
        STOP.set()  # kept: a KeyboardInterrupt raised inside a fork hook or a __del__ is swallowed
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)


@dataclass
class _Launch:
    """What starting each part of the local run needs: where to say it, the settings, the
    supervisor the roles run under and the data directory."""

    console: Console
    settings: Settings
    sup: Supervisor
    data_dir: Path

    @property
    def cli(self) -> list[str]:
        """argv prefix of a `flywheel` command in a role's process."""
        return [sys.executable, "-m", "app.cli"]

    @property
    def api_url(self) -> str:
        return f"http://{self.settings.api_host}:{self.settings.api_port}"

    def ok(self, text: str) -> None:
        self.console.print(f"[green]✓[/green] {text}")
        if STOP.is_set():  # a stop signal came while this part started
            raise KeyboardInterrupt("stop requested")


def _role_env(
    settings: Settings, data_dir: Path, demo: dict[str, str], extra: dict[str, str]
) -> dict[str, str]:
    """Every role's environment on top of the supervisor's: the demo defaults, where the shared
    servers and the data are, then `flywheel run`'s own extra variables."""
    return {
        **demo,
        "FLYWHEEL_DATA_DIR": str(data_dir),
        "FLYWHEEL_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "FLYWHEEL_MLFLOW_URI": settings.mlflow_uri,
        "MLFLOW_TRACKING_URI": settings.mlflow_uri,
        "FLYWHEEL_DATABASE_URL": settings.db_url,
        **extra,
    }


def _start_database(run: _Launch) -> dict[str, str]:
    """Migrate the database; the local API keys (`local_keys`)."""
    from app.db.migrate import upgrade

    upgrade(run.settings.db_url)
    keys = local_keys(run.settings)
    run.ok(
        f"database {run.settings.db_url}  (local API keys in {run.data_dir / 'local-keys.json'})"
    )
    return keys


def _start_mlflow(run: _Launch) -> None:
    """The MLflow server, unless one already answers on FLYWHEEL_MLFLOW_URI."""
    from app.infra.mlflow_server import SERVER_ENV, host_port, mlflow_server_argv
    from app.supervisor import RoleSpec

    uri = run.settings.mlflow_uri
    mhost, mport = host_port(uri)
    if _http_ok(f"{uri}/health"):
        run.console.print(f"[yellow]•[/yellow] reusing the MLflow server already on {uri}")
        return
    with run.console.status("starting the MLflow server..."):
        run.sup.start(
            RoleSpec(
                "mlflow",
                mlflow_server_argv(run.data_dir / "mlflow", mhost, mport),
                env=SERVER_ENV,
                url=uri,
                ready=lambda: _http_ok(f"{uri}/health"),
                infra=True,
            )
        )
    run.ok(f"mlflow  {uri}")


def _import_model(run: _Launch, model_dir: Path) -> None:
    """`prepare_model`: RunModelError if the registry holds versions of another model."""
    with run.console.status(f"checking the registry for {model_dir}..."):
        done = prepare_model(run.settings, model_dir, run.sup.base_env, run.data_dir / "logs")
    run.console.print(
        f"[green]✓[/green] model   {model_dir} ({done}; {run.settings.model_name} in MLflow)",
        highlight=False,
        soft_wrap=True,
    )


def _start_api(run: _Launch) -> None:
    from app.supervisor import RoleSpec

    api_url, s = run.api_url, run.settings
    with run.console.status("starting the API..."):
        run.sup.start(
            RoleSpec(
                "api",
                run.cli + ["api", "--host", s.api_host, "--port", str(s.api_port)],
                url=f"{api_url}/docs",
                ready=lambda: _http_ok(f"{api_url}/healthz"),
            )
        )
    run.ok(f"api     {api_url}/docs")


def _start_roles(run: _Launch) -> None:
    """The roles that serve no URL: projections, streams worker, trainer, controller."""
    from app.supervisor import RoleSpec

    run.sup.start(RoleSpec("projections", run.cli + ["projections", "follow"]), wait=False)
    run.ok("projections (flywheel.deployments → SQL)")
    for role in ("streams", "trainer", "controller"):
        run.sup.start(RoleSpec(role, run.cli + [role]), wait=False)
        run.ok(role)


def _start_replicas(run: _Launch, opts: RunOptions) -> list[str]:
    """`opts.replicas` replicas on consecutive ports, each with its engine; their URLs."""
    from app.supervisor import RoleSpec

    urls = []
    for i in range(opts.replicas):
        engines = opts.replica_engines
        engine = engines[min(i, len(engines) - 1)] if engines else None
        port = opts.replica_base_port + i
        url = f"http://127.0.0.1:{port}"
        urls.append(url)
        argv = ["replica", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--replica-id", f"replica-{i}", *(["--engine", engine] if engine else [])]
        run.sup.start(RoleSpec(f"replica-{i}", run.cli + argv, url=url), wait=False)
        run.ok(f"replica-{i} {url}" + (f" ({engine})" if engine else ""))
    return urls


def _start_simulate(run: _Launch, ingest_key: str, replica_urls: list[str]) -> None:
    """The simulated editor population, asking `replica_urls` and posting to the API."""
    from app.supervisor import RoleSpec

    argv = ["simulate", "--api", run.api_url, "--api-key", ingest_key]
    argv += sum((["--replica", u] for u in replica_urls), [])
    run.sup.start(RoleSpec("simulate", run.cli + argv), wait=False)
    agents = run.sup.base_env.get("FLYWHEEL_SIMULATE_AGENTS", "").lower() in ("1", "true", "yes")
    run.ok("simulated agent users" if agents else "simulated editor population")


def _watch(run: _Launch, read_key: str, opts: RunOptions) -> None:
    """Print where everything is, then show the status view until Ctrl-C or `opts.duration_s`."""
    from app.status_view import StatusView, trainer_metrics_url

    api_url, keys_file = run.api_url, run.data_dir / "local-keys.json"
    run.console.print(
        f"\nAPI docs  {api_url}/docs\nMLflow UI {run.settings.mlflow_uri}\nStatus    {api_url}/v1/deployments "
        f"(read key in {keys_file})\nLogs      {run.data_dir / 'logs'}\nCtrl-C stops everything.\n"
    )
    view = StatusView(
        api_url,
        read_key,
        run.sup,
        mlflow_uri=run.settings.mlflow_uri,
        model_name=run.settings.model_name,
        trainer_metrics_url=trainer_metrics_url(run.sup.base_env),
    )
    deadline = None if opts.duration_s is None else time.monotonic() + opts.duration_s
    view.run(live=opts.live, until=deadline, stop=STOP)


def run_local(settings: Settings, opts: RunOptions) -> int:
    from rich.console import Console

    from app.infra.broker import LocalKafka, ensure_topics
    from app.supervisor import Supervisor

    console = Console()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    _stop_on_signals()
    data_dir = settings.data_dir.resolve()
    model_dir = settings.model_dir.resolve() if settings.model_dir is not None else None
    try:
        demo = demo_env(model_dir, os.environ, opts.agents)
    except RunModelError as exc:
        console.print(f"[red]✗[/red] {exc}", highlight=False, soft_wrap=True)
        return 2
    sup = Supervisor(data_dir / "logs", _role_env(settings, data_dir, demo, opts.extra_env))
    run = _Launch(console, settings, sup, data_dir)
    broker = LocalKafka.from_settings(settings)
    started_broker = False
    try:
        with console.status(
            "starting Kafka (the first start resolves its jars from Maven Central)..."
        ):
            started_broker = not broker.running()
            broker.start(with_parent=True)
            ensure_topics(settings)
        run.ok(f"kafka {broker.bootstrap}  (logs {broker.home / 'logs'})")
        keys = _start_database(run)
        _start_mlflow(run)
        if model_dir is not None:
            _import_model(run, model_dir)
        _start_api(run)
        _start_roles(run)
        replica_urls = _start_replicas(run, opts)
        if opts.simulate and replica_urls:
            _start_simulate(run, keys["ingest"], replica_urls)
        _watch(run, keys["read"], opts)
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
