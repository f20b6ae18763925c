#!/usr/bin/env bash
# Ensure Debian's `chromium` (and a font set for it) is installed at /usr/bin/chromium, the
# browser tests/browser.py drives with Playwright to move aliases in the MLflow UI.
# We never run `playwright install`: the browser comes from Debian's packages, the Python
# `playwright` package only brings its node driver.
# Installs with apt-get when missing (apt-get update first); idempotent; safe to run before
# every test run:  deploy/chromium/ensure.sh
set -euo pipefail

CHROMIUM="${FLYWHEEL_CHROMIUM:-/usr/bin/chromium}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
if [ ! -x "$CHROMIUM" ]; then missing+=(chromium); fi
if ! dpkg-query -W -f='${Status}' fonts-liberation 2>/dev/null | grep -q "install ok installed"; then
  missing+=(fonts-liberation)
fi

if [ "${#missing[@]}" -gt 0 ]; then
  echo "chromium: installing ${missing[*]} from Debian's packages"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x "$CHROMIUM" ]; then
  echo "chromium: $CHROMIUM is still missing after apt-get install chromium" >&2
  exit 1
fi
echo "chromium: ready ($("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM"))"
