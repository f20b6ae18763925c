"""`flywheel trainer` / `python -m trainer.launch`: parse config, then import torch and run the loop.

Config comes from the environment (FLYWHEEL_* in app/settings.py, FLYWHEEL_TRAINER_* in
trainer/config.py) and is validated before the heavy imports, so a bad value fails at once.
Before building the trainer it waits for the MLflow server and for the broker with its topics
(started first, it stays up and says what it waits for; docs/SCALING.md, "Start order").
SIGTERM/SIGINT stop the loop after the current step and save the state; SIGKILL loses
nothing either (docs/TRAINER.md, "Crash safety").
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

log = logging.getLogger(__name__)


def wait_for_dependencies(settings, stop: threading.Event) -> bool:
    """The MLflow server, then the broker with the trainer's topics (app/infra/wait.py: backoff,
    one log line each). False when `stop` came first."""
    from app.infra.wait import Stopped, kafka_ready, mlflow_ready

    try:
        mlflow_ready(settings.mlflow_uri, stop)
        kafka_ready(settings, [settings.topic(t) for t in ("rollouts", "dlq", "deployments")], stop)
    except Stopped:
        return False
    return True


def main(cfg: TrainerConfig | None = None) -> None:
    """Run the trainer on `cfg` (`flywheel trainer` passes it with its flags applied; default:
    read from the environment)."""
    from app.settings import get_settings
    from trainer.config import TrainerConfig

    # validation errors surface here, before torch
    settings, cfg = get_settings(), cfg if cfg is not None else TrainerConfig()
    from prometheus_client import start_http_server
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from trainer.loop import Trainer

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if cfg.metrics_port:
        start_http_server(cfg.metrics_port)
    if not wait_for_dependencies(settings, stop):
        return
    trainer = Trainer(settings, cfg)
    try:
        with Progress(
            SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=False
        ) as bar:
            task = bar.add_task("waiting for rollouts", total=None)

            def on_step(step: int, m: dict[str, float] | None) -> None:
                if m is not None:
                    bar.update(
                        task,
                        description=(
                            f"step {step}  loss {m['loss']:+.4f}  reward {m['reward_mean']:+.3f}  ess {m['ess']:.2f}  "
                            f"kl {m.get('kl', 0.0):.4f}  v{trainer.last_shipped} shipped  "
                            f"{trainer.pending.rollouts} rollouts pending"
                        ),
                    )

            trainer.run(stop, on_step)
    finally:
        trainer.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    main()
