"""The embedded single-node Apache Kafka 4.x broker (KRaft), started by the project itself.

Jars come from Maven Central through `deploy/kafka/pom.xml` and are cached outside the repo
(`FLYWHEEL_KAFKA_CACHE_DIR`, default `~/.cache/flywheel/kafka-<version>/libs`). The broker's
storage, config, pid file and logs live in `<data_dir>/kafka/`. Storage is formatted on the
first start with a static single-voter quorum, so the broker can be restarted on the same
ports without re-formatting.

    flywheel kafka start | stop | status

The topics declared in app/contracts/topics.py are created by `ensure_topics()` (idempotent).
"""

from __future__ import annotations

import base64
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from app.contracts.topics import KAFKA_MESSAGE_MAX_BYTES, TOPICS, topic_partitions
from app.infra import kafka_net
from app.infra.procs import die_with_parent
from app.settings import KAFKA_LIGHT_JVM, Settings

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
POM = REPO_ROOT / "deploy" / "kafka" / "pom.xml"
LOG4J2 = REPO_ROOT / "deploy" / "kafka" / "log4j2.properties"


def kafka_version() -> str:
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    node = ET.parse(POM).getroot().find("m:properties/m:kafka.version", ns)
    assert node is not None and node.text, f"kafka.version missing from {POM}"
    return node.text.strip()


def ensure_jars(cache_dir: Path) -> Path:
    """Resolve Kafka's jars with Maven into the cache (once per version); returns the libs dir."""
    libs = cache_dir / f"kafka-{kafka_version()}" / "libs"
    marker = libs / ".complete"
    if marker.exists():
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise RuntimeError(
            "Maven (mvn) is needed to fetch Kafka's jars from Maven Central; install it (apt-get install maven)"
        )
    libs.mkdir(parents=True, exist_ok=True)
    log.info("resolving Apache Kafka %s jars from Maven Central into %s", kafka_version(), libs)
    proc = subprocess.run(
        [
            mvn,
            "-q",
            "-B",
            "-f",
            str(POM),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={libs}",
            "-DincludeScope=runtime",
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"mvn could not resolve Kafka's jars (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    marker.touch()
    return libs


def _port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class LocalKafka:
    """A single-node KRaft broker whose state lives under `home`."""

    home: Path
    port: int = 9092
    controller_port: int | None = None
    heap: str = "512m"
    jvm_opts: str = KAFKA_LIGHT_JVM
    cache_dir: Path = Path.home() / ".cache" / "flywheel"
    host: str = "127.0.0.1"

    @classmethod
    def from_settings(cls, s: Settings) -> LocalKafka:
        first = s.kafka_bootstrap.split(",")[0].strip()
        host, _, port = first.rpartition(":")
        return cls(
            home=s.data_dir / "kafka",
            port=int(port),
            controller_port=s.kafka_controller_port,
            heap=s.kafka_heap,
            jvm_opts=s.kafka_jvm_opts,
            cache_dir=s.kafka_cache_dir,
            host="127.0.0.1" if host in ("localhost", "127.0.0.1", "") else host,
        )

    # --- paths --------------------------------------------------------------------------
    @property
    def cport(self) -> int:
        return self.controller_port or self.port + 1

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.home / "logs" / "server.log"

    @property
    def pid_file(self) -> Path:
        return self.home / "kafka.pid"

    # --- lifecycle ---------------------------------------------------------------------------
    def _write_config(self) -> Path:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "logs").mkdir(exist_ok=True)
        cfg = self.home / "server.properties"
        cfg.write_text(
            "\n".join(
                [
                    "# written by flywheel (app/infra/broker.py); edits are overwritten on start",
                    "process.roles=broker,controller",
                    "node.id=1",
                    f"controller.quorum.voters=1@{self.host}:{self.cport}",
                    f"listeners=PLAINTEXT://{self.host}:{self.port},CONTROLLER://{self.host}:{self.cport}",
                    f"advertised.listeners=PLAINTEXT://{self.host}:{self.port}",
                    "controller.listener.names=CONTROLLER",
                    "inter.broker.listener.name=PLAINTEXT",
                    "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
                    f"log.dirs={(self.home / 'data').resolve()}",
                    "num.partitions=1",
                    "offsets.topic.replication.factor=1",
                    "offsets.topic.num.partitions=10",
                    "transaction.state.log.replication.factor=1",
                    "transaction.state.log.min.isr=1",
                    "share.coordinator.state.topic.replication.factor=1",
                    "share.coordinator.state.topic.min.isr=1",
                    "min.insync.replicas=1",
                    "group.initial.rebalance.delay.ms=0",
                    # topics exist only as Flywheel creates them (app/contracts/topics.py, the
                    # streams worker's internal ones): a client asking for a missing topic waits
                    # for it instead of creating it with num.partitions and default configs
                    "auto.create.topics.enable=false",
                    "log.retention.hours=-1",
                    "log.cleaner.min.compaction.lag.ms=0",
                    "log.segment.bytes=67108864",
                    # the record limit of topics without their own max.message.bytes (app/contracts/topics.py: the chain
                    # max_event_bytes -> producer max_request_size -> topic/broker limits)
                    f"message.max.bytes={KAFKA_MESSAGE_MAX_BYTES}",
                    "",
                ]
            )
        )
        return cfg

    def _java(self, libs: Path, *args: str, heap: str | None = None) -> list[str]:
        java = shutil.which("java")
        if java is None:
            raise RuntimeError(
                "Java 17+ is needed to run the embedded Kafka broker (apt-get install openjdk-17-jre-headless)"
            )
        return [
            java,
            f"-Xmx{heap or self.heap}",
            "-Xss1m",
            *shlex.split(self.jvm_opts),
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={LOG4J2}",
            f"-Dkafka.logs.dir={self.home / 'logs'}",
            "-cp",
            f"{libs}/*",
            *args,
        ]

    def format_storage(self, libs: Path) -> None:
        if (self.home / "data" / "meta.properties").exists():
            return
        cluster_id = "-"
        while cluster_id.startswith(
            "-"
        ):  # a leading '-' is read as an option by kafka-storage (1 in 64 ids)
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        cfg = self._write_config()
        log.info("formatting KRaft storage in %s (cluster %s)", self.home / "data", cluster_id)
        proc = subprocess.run(
            self._java(
                libs,
                "kafka.tools.StorageTool",
                "format",
                "-t",
                cluster_id,
                "-c",
                str(cfg),
                heap="256m",
            ),
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"formatting Kafka storage failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return pid

    def running(self) -> bool:
        return self.pid() is not None

    def start(self, timeout: float = 90.0, with_parent: bool = False) -> None:
        """Start the broker (format storage first if new) and wait until it serves metadata.
        `with_parent`: the broker gets SIGTERM when this process dies (`flywheel run`'s own
        broker); otherwise it runs until stopped (`flywheel kafka start`)."""
        if self.running():
            log.info("kafka already running (pid %s) on %s", self.pid(), self.bootstrap)
            self.wait_ready(timeout)
            return
        if _port_open(self.host, self.port):
            raise RuntimeError(
                f"port {self.port} is already in use by another process; set FLYWHEEL_KAFKA_BOOTSTRAP to a free port"
            )
        libs = ensure_jars(self.cache_dir)
        self.format_storage(libs)
        cfg = self._write_config()
        out = open(self.home / "logs" / "stdout.log", "ab")
        proc = subprocess.Popen(
            self._java(libs, "kafka.Kafka", str(cfg)),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent() if with_parent else None,
        )
        self.pid_file.write_text(str(proc.pid))
        log.info(
            "started kafka pid %s on %s, logs in %s", proc.pid, self.bootstrap, self.home / "logs"
        )
        try:
            self.wait_ready(timeout, proc=proc)
        except Exception:
            self.stop()
            raise

    def wait_ready(self, timeout: float = 90.0, proc: subprocess.Popen | None = None) -> None:
        from kafka import KafkaAdminClient
        from kafka.errors import KafkaConfigurationError

        kafka_net.install()

        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"kafka exited with {proc.returncode}; see {self.home / 'logs'}")
            if _port_open(self.host, self.port):
                try:
                    admin = KafkaAdminClient(
                        bootstrap_servers=self.bootstrap, request_timeout_ms=5000
                    )
                    try:
                        admin.describe_cluster()
                        return
                    finally:
                        admin.close()
                except KafkaConfigurationError:
                    raise
                except Exception as exc:  # broker still starting
                    last = exc
            time.sleep(0.3)
        raise TimeoutError(
            f"kafka on {self.bootstrap} not ready after {timeout:.0f}s (last error: {last}); see {self.log_file}"
        )

    def stop(self, timeout: float = 30.0) -> bool:
        """SIGTERM (controlled shutdown), then SIGKILL after `timeout`. Returns whether it was running."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        if _alive(pid):
            log.warning("kafka pid %s did not stop in %.0fs; killing", pid, timeout)
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            while _alive(pid):
                time.sleep(0.1)
        self.pid_file.unlink(missing_ok=True)
        return True


def _alive(pid: int) -> bool:
    try:
        # reap if it is our child, so it does not linger as a zombie
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie that is not our child
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def ensure_topics(
    settings: Settings, bootstrap: str | None = None, timeout_s: float = 30.0
) -> list[str]:
    """Create the topics of app/contracts/topics.py that do not exist yet. Returns the names it created."""
    from kafka import KafkaAdminClient

    kafka_net.install()
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(
        bootstrap_servers=bootstrap or settings.kafka_bootstrap,
        request_timeout_ms=int(timeout_s * 1000),
    )
    try:
        existing = set(admin.list_topics())
        wanted = [
            NewTopic(
                settings.topic(name),
                num_partitions=topic_partitions(settings, name),
                replication_factor=settings.replication_factor,
                topic_configs=dict(cfg),
            )
            for name, cfg in TOPICS.items()
            if settings.topic(name) not in existing
        ]
        if not wanted:
            return []
        # Per-topic results: another process may create one of them between the list and the
        # create. The created topics are waited on until the broker's metadata shows them with a
        # leader (KRaft publishes a new topic a moment after it acknowledges the create), so a
        # caller's next list or produce already sees them.
        response = admin.create_topics(wanted, timeout_ms=int(timeout_s * 1000), raise_errors=False)
        created, failed = [], []
        for topic in response["topics"]:
            code = topic["error_code"]
            if code == 0:
                created.append(topic["name"])
            elif code != TopicAlreadyExistsError.errno:
                failed.append(f"{topic['name']}: {topic.get('error_message') or code}")
        if failed:
            raise RuntimeError(f"the broker refused to create topics: {'; '.join(failed)}")
        admin.wait_for_topics(created, timeout_ms=int(timeout_s * 1000))
        return created
    finally:
        admin.close()
