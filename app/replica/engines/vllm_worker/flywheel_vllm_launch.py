"""Run vLLM's OpenAI server for a replica, and stop it when the replica is gone.

    python flywheel_vllm_launch.py --parent PID -- <vllm.entrypoints.openai.api_server flags>

The replica starts this in vLLM's environment in a new process group (app/replica/engines/vllm.py);
it starts the server as its child and checks every second that its parent is still the replica.
If the replica dies without stopping it (SIGKILL, a crash), the server and its engine processes
are terminated instead of running on as orphans. SIGTERM / SIGINT stop the server the same way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "--parent" or argv[2] != "--":
        print("usage: flywheel_vllm_launch.py --parent PID -- <api_server flags>", file=sys.stderr)
        return 2
    parent, flags = int(argv[1]), argv[3:]
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags])
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping and server.poll() is None:
        if os.getppid() != parent:  # the replica is gone
            print(f"flywheel: replica {parent} is gone; stopping vLLM", file=sys.stderr)
            break
        time.sleep(1.0)
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
    return server.returncode if server.returncode is not None else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
