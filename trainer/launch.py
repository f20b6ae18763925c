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
import os
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

    from trainer.distributed import World, torchrun_world_size
    from trainer.loop import Trainer

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if torchrun_world_size() > 1 else 0
    if cfg.metrics_port:
        start_http_server(cfg.metrics_port + local_rank)
    if not wait_for_dependencies(settings, stop):
        return
    world = World.from_env(cfg.dist_backend, cfg.dist_timeout_s)
    try:
        trainer = Trainer(settings, cfg, world)
    except BaseException:
        world.close()
        raise
    try:
        with Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            transient=False,
            disable=not world.is_main,
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
        try:
            trainer.close()
        finally:
            world.close()


def exec_torchrun(cfg: TrainerConfig) -> None:
    """Replace this process with `torchrun --standalone --nproc-per-node N -m trainer.launch`
    (`flywheel trainer --nproc N`): torchrun starts the N ranks, forwards SIGTERM to them, and
    restarts all of them up to `max_restarts` times when one fails or is killed. The ranks read
    their config from the environment, so the flags given to `flywheel trainer` go there."""
    import sys

    env = dict(os.environ)
    env["FLYWHEEL_TRAINER_METRICS_PORT"] = str(cfg.metrics_port)
    env["FLYWHEEL_TRAINER_NPROC"] = "1"  # each rank is one process; torchrun's WORLD_SIZE decides
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={cfg.nproc}",
        f"--max-restarts={cfg.max_restarts}",
        "-m",
        "trainer.launch",
    ]
    log.info("starting %d trainer ranks: %s", cfg.nproc, " ".join(argv[1:]))
    os.execvpe(sys.executable, argv, env)


if __name__ == "__main__":
    from trainer.distributed import torchrun_world_size

    rank = os.environ.get("RANK") if torchrun_world_size() > 1 else None
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {'' if rank is None else f'[rank {rank}] '}%(name)s: %(message)s",
    )
    main()
