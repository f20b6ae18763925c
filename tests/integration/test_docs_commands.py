"""Every shell command in README.md and docs/*.md, run (or, where it cannot run here, checked).

A shell block is a fenced block tagged ```bash, ```sh, ```shell or ```console. Each one runs
in its own `bash -euo pipefail`, bounded by a timeout, against a real stack built for it:

- the session's real Kafka broker and MLflow server (tests/conftest.py), a fresh topic
  namespace and a fresh SQLite database (the `make run` default) per block;
- a registered model in MLflow with versions 1-3, and a deployment log that says what the
  operator examples (docs/OPERATIONS.md) assume: 1 was champion, then 2 (canary, promoted), and 3 is in
  canary at 5% against champion 2; the SQL projections rebuilt from it (as `flywheel
  projections follow` keeps them under `make run`);
- the API (`create_app` on uvicorn, `ServerThread`) on a free port;
- keys made with the real CLI (`flywheel keys create`), `flywheel` on PATH from .venv/bin,
  and the variables the docs use: `$API`, `$KEY` (ingest), `$READ`, `$ADMIN`.

`curl` inside a block is a wrapper that adds `--fail-with-body` (so a 4xx or 5xx fails the
block) and a marker line with the HTTP status; the test asserts the exit status, that every
curl left a marker and that every status is 2xx.

A block that cannot run here (the whole service, a test suite, a benchmark of minutes, a GPU
host) carries `<!-- docs-test: skip — <reason and where it is exercised> -->` on the line
before its fence. Its commands are still checked against what they name: `make` targets
against the Makefile, `flywheel` subcommands and options against `flywheel … --help`, scripts'
options against the scripts, test paths against the tree, `FLYWHEEL_*` variables against the
settings. A new unmarked block runs; an untagged fence fails (so a shell block cannot hide
from this test by leaving out its language).
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration

SHELL_LANGS = {"bash", "sh", "shell", "console"}
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*[—:-]+\s*(?P<reason>.+?)\s*-->")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)(?P<lang>[^\s`]*)")
BLOCK_TIMEOUT_S = 120
CURL_MARK = "@docs-test-http"
# set -e stops at the first failing command; the wrapper turns an HTTP error into one.
PREAMBLE = f"""set -euo pipefail
curl() {{ command curl --fail-with-body --max-time 30 --write-out '\\n{CURL_MARK} %{{http_code}} %{{method}} %{{url_effective}}\\n' "$@"; }}
"""


@dataclass(frozen=True)
class Block:
    file: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    def commands(self) -> str:
        """The block as a script (`console` blocks: only the `$ ` lines, without the prompt)."""
        if self.lang != "console":
            return self.text
        return "\n".join(ln[2:] for ln in self.text.splitlines() if ln.startswith("$ "))


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown file, with the skip marker on the line before it."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, fence = i, m["fence"]
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        skip = SKIP.search(prev)
        assert skip or "docs-test" not in prev, (
            f"{path.name}:{start}: write the marker as <!-- docs-test: skip — <reason> -->, got {prev.strip()!r}"
        )
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        assert i < len(lines), f"{path.name}:{start + 1}: fence never closed"
        out.append(
            Block(
                str(path.relative_to(REPO)),
                start + 1,
                m["lang"].lower(),
                "\n".join(lines[start + 1 : i]),
                skip["reason"] if skip else None,
            )
        )
        i += 1
    return out


ALL_BLOCKS = [b for f in doc_files() for b in fenced_blocks(f)]
SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.lang in SHELL_LANGS]
RUN_BLOCKS = [b for b in SHELL_BLOCKS if b.skip is None]
SKIPPED_BLOCKS = [b for b in SHELL_BLOCKS if b.skip is not None]


def test_every_fence_names_its_language():
    untagged = [b.id for b in ALL_BLOCKS if not b.lang]
    assert not untagged, (
        f"fenced blocks without a language (use bash for commands, text for diagrams): {untagged}"
    )


def test_the_docs_have_runnable_blocks():
    """The extraction itself: the operator examples (docs/OPERATIONS.md) are found and would run."""
    assert any(
        b.file == "docs/OPERATIONS.md" and "/v1/deployments/promote" in b.text for b in RUN_BLOCKS
    ), [b.id for b in RUN_BLOCKS]


# --- the stack a runnable block runs against ----------------------------------------------------
@dataclass
class DocsStack:
    env: dict[str, str]
    settings: object
    api_url: str


def _cli(env: dict[str, str], *args: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        [str(REPO / ".venv/bin/flywheel"), *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"flywheel {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout


def _register_versions(mlflow_uri: str, model: str, tmp: Path, n: int = 3) -> list[str]:
    """A registered model with `n` versions whose artifacts are a few bytes (as in the controller tests)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri, registry_uri=mlflow_uri)
    client.create_registered_model(model)
    exp = client.create_experiment(f"exp-{model}")
    versions = []
    for i in range(n):
        run = client.create_run(exp)
        f = tmp / f"weights-{i}.txt"
        f.write_text(f"dummy weights {i}")
        client.log_artifact(run.info.run_id, str(f), artifact_path="weights")
        client.set_terminated(run.info.run_id)
        versions.append(
            client.create_model_version(
                model, source=f"{run.info.artifact_uri}/weights", run_id=run.info.run_id
            ).version
        )
    return versions


def _publish_history(settings) -> None:
    """1 champion, then 2 canaried and promoted, now 3 in canary at 5% against 2."""
    from app.contracts.deployments import Decision, DeploymentEvent, DeploymentLog

    trainer = {"source": "trainer", "actor": "trainer-0"}
    decisions = [
        Decision(type="version_registered", version="1", **trainer),
        Decision(type="promoted", version="1", reason="base version"),
        Decision(type="version_registered", version="2", from_version="1", **trainer),
        Decision(type="gate_passed", version="2"),
        Decision(
            type="canary_started",
            version="2",
            from_version="1",
            traffic_pct=5.0,
            details={"step": 0},
        ),
        Decision(type="promoted", version="2", from_version="1", traffic_pct=100.0),
        Decision(type="version_registered", version="3", from_version="2", **trainer),
        Decision(type="gate_passed", version="3"),
        Decision(
            type="canary_started",
            version="3",
            from_version="2",
            traffic_pct=5.0,
            details={"step": 0},
        ),
    ]
    with DeploymentLog(settings) as dlog:
        for d in decisions:
            dlog.publish(DeploymentEvent.model_validate(d.to_event(settings.model_name)))


@pytest.fixture()
def docs_stack(make_settings, mlflow_server, tmp_path: Path):
    import uuid

    from app.api.main import create_app
    from app.api.server import ServerThread
    from app.projector.projector import rebuild

    model = f"docs-policy-{uuid.uuid4().hex[:8]}"
    settings = make_settings(model_name=model, mlflow_uri=mlflow_server.uri)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(
        PATH=f"{REPO / '.venv/bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        COLUMNS="200",
        FLYWHEEL_DATA_DIR=str(settings.data_dir),
        FLYWHEEL_KAFKA_BOOTSTRAP=settings.kafka_bootstrap,
        FLYWHEEL_TOPIC_NAMESPACE=settings.topic_namespace,
        FLYWHEEL_MLFLOW_URI=mlflow_server.uri,
        FLYWHEEL_MODEL_NAME=model,
    )
    for var, scope in (
        ("KEY", "ingest"),
        ("READ", "read"),
        ("ADMIN", "admin"),
    ):  # migrates the DB too
        env[var] = (
            _cli(env, "keys", "create", "--scope", scope, "--name", f"docs-{scope}")
            .strip()
            .splitlines()[-1]
        )
    assert _register_versions(mlflow_server.uri, model, tmp_path) == ["1", "2", "3"]
    _publish_history(settings)
    report = rebuild(settings)
    assert report.events_applied >= 9, report
    with ServerThread(create_app(settings)) as api:
        env["API"] = api.url
        yield DocsStack(env, settings, api.url)


def run_block(stack: DocsStack, script: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            ["bash", "-c", PREAMBLE + script],
            env=stack.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"block did not finish within {BLOCK_TIMEOUT_S}s; output so far:\n{exc.stdout}\n{exc.stderr}"
        )


CURL_CALL = re.compile(r"(?:^|[;&|(]|\$\()\s*curl\s")


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=lambda b: b.id)
def test_doc_block_runs(docs_stack: DocsStack, block: Block):
    script = block.commands()
    proc = run_block(docs_stack, script)
    shown = f"{block.id} exited {proc.returncode}\n--- block\n{script}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, shown
    statuses = [ln.split()[1:] for ln in proc.stdout.splitlines() if ln.startswith(CURL_MARK)]
    calls = sum(len(CURL_CALL.findall(ln.split(" #")[0])) for ln in script.splitlines())
    assert len(statuses) == calls, (
        f"{calls} curl calls in the block but {len(statuses)} answers\n{shown}"
    )
    bad = [s for s in statuses if not s[0].startswith("2")]
    assert not bad, f"non-2xx answers {bad}\n{shown}"


def test_the_harness_fails_a_block_on_a_4xx(docs_stack: DocsStack):
    """The README's old mistake (a field the API does not have) must fail its block, and so must a 409."""
    form = run_block(
        docs_stack,
        'curl -X POST "$API/v1/deployments/promote" -H "Authorization: Bearer $ADMIN" '
        '-d \'{"reason": "x", "skip_remaining_steps": true}\'\necho not reached',
    )
    assert (
        form.returncode == 22
        and f"{CURL_MARK} 422" in form.stdout
        and "not reached" not in form.stdout
    ), form
    conflict = run_block(
        docs_stack,
        'H=(-H "Authorization: Bearer $ADMIN" -H "content-type: application/json")\n'
        'curl -X POST "$API/v1/deployments/resume" "${H[@]}" -d "{}"',
    )
    assert conflict.returncode == 22 and f"{CURL_MARK} 409" in conflict.stdout, conflict


def test_the_admin_examples_reach_the_deployment_log(docs_stack: DocsStack):
    """The operator block of docs/OPERATIONS.md leaves its events on `<ns>.deployments` with source api."""
    from app.contracts.deployments import DeploymentLog

    [block] = [
        b
        for b in RUN_BLOCKS
        if b.file == "docs/OPERATIONS.md" and "/v1/deployments/rollback" in b.text
    ]
    proc = run_block(docs_stack, block.commands())
    assert proc.returncode == 0, proc
    with DeploymentLog(docs_stack.settings) as dlog:
        events = [le.event for le in dlog.read(stall_timeout_s=20)]
    by_api = [(e.type, e.version) for e in events if e.source == "api"]
    assert by_api == [
        ("canary_paused", "3"),
        ("canary_resumed", "3"),
        ("traffic_shifted", "3"),
        ("promoted", "3"),
        ("rolled_back", "2"),
    ], by_api


# --- blocks that cannot run here: check what their commands name ---------------------------------
@functools.cache
def _help(*sub: str) -> str:
    env = {**os.environ, "COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1"}
    proc = subprocess.run(
        [str(REPO / ".venv/bin/flywheel"), *sub, "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"flywheel {' '.join(sub)} --help failed:\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout


@functools.cache
def _settings_vars() -> set[str]:
    from app.config_reference import known_env_names

    return known_env_names()


def _optional_groups(line: str) -> tuple[str, list[str]]:
    """`cmd [--quick] [--hints on|off]` -> (`cmd`, ['--quick', '--hints'])."""
    opts = [o for g in re.findall(r"\[([^\]]*)\]", line) for o in re.findall(r"--[\w-]+", g)]
    return re.sub(r"\s*\[[^\]]*\]", "", line), opts


def check_command(words: list[str], extra_opts: list[str]) -> list[str]:
    """Problems of one command (words after env assignments) in a skipped block; [] if it names real things."""
    opts = [w.split("=")[0] for w in words if w.startswith("--")] + extra_opts
    prog, args = words[0], words[1:]
    if prog == "make":
        targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
        return [f"make target {a!r} not in the Makefile" for a in args if a not in targets]
    if prog in ("flywheel", ".venv/bin/flywheel"):
        sub = []
        for a in args:
            if a.startswith("-") or len(sub) == 2:
                break
            sub.append(a)
        text = _help(*sub)
        return [f"`flywheel {' '.join(sub)}` has no option {o}" for o in opts if o not in text]
    if prog in (".venv/bin/pytest", "pytest") or args[:2] == ["-m", "pytest"]:
        paths = [a.split("::")[0] for a in args if not a.startswith("-") and a != "pytest"]
        return [f"no test path {p}" for p in paths if not (REPO / p).exists()] or (
            [] if paths else ["pytest without a path"]
        )
    if prog in (".venv/bin/python", "python"):
        if args[:1] == ["-m"]:  # python -m package.module: the module's file, and its options
            script = REPO / (args[1].replace(".", "/") + ".py")
            if not script.is_file():
                return [f"no module {args[1]}"]
            return [
                f"{args[1]} has no option {o}" for o in opts if f'"{o}"' not in script.read_text()
            ]
        script = REPO / args[0]
        if not script.is_file():
            return [f"no script {args[0]}"]
        return [f"{args[0]} has no option {o}" for o in opts if f'"{o}"' not in script.read_text()]
    if prog == "torchrun":
        mod = args[args.index("-m") + 1]
        return [] if (REPO / (mod.replace(".", "/") + ".py")).is_file() else [f"no module {mod}"]
    if "/" in prog:
        return (
            [] if os.access(REPO / prog, os.X_OK) else [f"{prog} is not an executable in the repo"]
        )
    return [f"no check for {prog!r}: teach check_command about it or make the block runnable"]


@pytest.mark.parametrize("block", SKIPPED_BLOCKS, ids=lambda b: b.id)
def test_skipped_block_names_real_commands(block: Block):
    problems = []
    for raw in block.commands().splitlines():
        line, extra = _optional_groups(raw.split(" #")[0].strip())
        for part in filter(None, (p.strip() for p in re.split(r"&&|;|\|\|", line))):
            words = shlex.split(part)
            while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
                var = words.pop(0).split("=")[0]
                if var.startswith("FLYWHEEL_") and var not in _settings_vars():
                    problems.append(f"unknown setting {var}")
            if words:
                problems += check_command(words, extra)
    assert not problems, f"{block.id}: {problems}"


INLINE_FLYWHEEL = re.compile(r"`(flywheel [^`]+)`")


def test_inline_flywheel_commands_exist():
    """`flywheel …` in running text (tables, prose) names a real subcommand and real options."""
    problems = []
    for path in doc_files():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith(("<!--", "|")) and "`flywheel" not in line:
                continue
            for span in INLINE_FLYWHEEL.findall(line):
                head, _, alts = span.partition(
                    "\\|"
                )  # `flywheel projections follow\|rebuild` in a table
                for cmd in [
                    head,
                    *(head.rsplit(" ", 1)[0] + " " + a for a in alts.split("\\|") if a),
                ]:
                    words = [w for w in shlex.split(cmd.replace("…", "")) if w != "|"]
                    problems += [f"{path.name}:{n}: {p}" for p in check_command(words, [])]
    assert not problems, problems
