"""`flywheel run`'s demo cadence only sets variables some settings class reads, with valid values."""

from __future__ import annotations

from app.config_reference import known_env_names, settings_classes
from app.run import DEMO_ENV


def test_demo_env_names_are_known_settings():
    unknown = sorted({k for k in DEMO_ENV if k.startswith("FLYWHEEL_")} - known_env_names())
    assert not unknown, f"DEMO_ENV sets variables no settings class reads: {unknown}"


def test_demo_env_values_validate(monkeypatch):
    for name, value in DEMO_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FLYWHEEL_PROFILE", "local")
    for cls in settings_classes():
        cls()  # raises a ValidationError naming the bad variable


def test_roles_started_together_have_distinct_default_ports():
    from app.controller.config import ControllerSettings as ControllerConfig
    from app.settings import Settings
    from streams.config import StreamsConfig
    from trainer.config import TrainerConfig

    ports = {"api": Settings().api_port, "streams metrics": StreamsConfig().metrics_port,
             "trainer metrics": TrainerConfig().metrics_port, "controller metrics": ControllerConfig().metrics_port}
    assert len(set(ports.values())) == len(ports), f"default ports collide under `flywheel run`: {ports}"


def test_sigterm_stops_the_run_like_ctrl_c():
    """`flywheel run` under a process manager gets SIGTERM: it must take the Ctrl-C path (stop every
    role, which run in their own sessions) instead of dying and orphaning them."""
    import signal
    import subprocess
    import sys
    import time

    code = ("import time\nfrom app.run import _stop_on_sigterm\n_stop_on_sigterm()\n"
            "try:\n    print('ready', flush=True)\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('cleanup ran', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert "cleanup ran" in out and proc.returncode == 0, (out, proc.returncode)
    assert time.monotonic() - t0 < 30


def test_ctrl_c_stops_the_run_even_when_sigint_was_inherited_as_ignored():
    """A run started from a background job of a non-interactive shell inherits SIGINT as ignored
    (the test suite launched that way once, and `flywheel run` then ignored the e2e test's Ctrl-C)."""
    import signal
    import subprocess
    import sys

    code = ("import time\nfrom app.run import _stop_on_sigterm\n_stop_on_sigterm()\n"
            "try:\n    print('ready', flush=True)\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('cleanup ran', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert "cleanup ran" in out and proc.returncode == 0, (out, proc.returncode)
