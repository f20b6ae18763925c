#!/usr/bin/env bash
# Ensure a C compiler (`cc`) for kernels/fixed_order.py, which builds the fixed-order GEMM of the
# batch-invariant kernels (kernels/csrc/fixed_order_gemm.c) on first use. Without one the
# invariant kernels fall back to the slower exact-integer scheme, and the kernel tests fail.
# Installs Debian's gcc with apt-get when missing; idempotent:  deploy/compiler/ensure.sh
set -euo pipefail

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

if ! command -v cc >/dev/null 2>&1; then
  echo "compiler: installing gcc from Debian's packages"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null
fi

if ! command -v cc >/dev/null 2>&1; then
  echo "compiler: cc is still missing after apt-get install gcc" >&2
  exit 1
fi
echo "compiler: ready ($(cc --version | head -1))"
