#!/usr/bin/env bash
# Ensure a real PostgreSQL server (Debian's packages) runs locally with the test role and
# database that tests/conftest.py uses:
#   postgresql+psycopg://flywheel:flywheel@127.0.0.1:5432/flywheel_test
# Installs postgresql with apt-get when missing, starts the cluster when it is down.
# Idempotent; safe to run before every test run.
set -euo pipefail

PGPORT="${FLYWHEEL_TEST_PGPORT:-5432}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

if ! command -v pg_lsclusters >/dev/null 2>&1 || [ -z "$(ls /usr/lib/postgresql/*/bin/postgres 2>/dev/null)" ]; then
  echo "postgres: installing postgresql from Debian's packages"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql >/dev/null
fi

# the first cluster Debian made (e.g. "15 main"); create one if there is none
read -r VER NAME PORT STATUS _ < <(pg_lsclusters -h | head -n 1) || true
if [ -z "${VER:-}" ]; then
  VER=$(ls /usr/lib/postgresql | sort -V | tail -n 1)
  $SUDO pg_createcluster "$VER" main --port "$PGPORT" >/dev/null
  read -r VER NAME PORT STATUS _ < <(pg_lsclusters -h | head -n 1)
fi
if [ "$STATUS" != "online" ]; then
  echo "postgres: starting cluster $VER/$NAME on port $PORT"
  $SUDO pg_ctlcluster "$VER" "$NAME" start
fi

as_pg() { if [ -n "$SUDO" ]; then sudo -u postgres "$@"; else runuser -u postgres -- "$@"; fi; }
for _ in $(seq 1 100); do
  if as_pg psql -p "$PORT" -qtAc 'select 1' >/dev/null 2>&1; then break; fi
  sleep 0.2
done
as_pg psql -p "$PORT" -qtAc "select 1 from pg_roles where rolname='flywheel'" | grep -q 1 \
  || as_pg psql -p "$PORT" -qc "create role flywheel login createdb password 'flywheel'"
for db in flywheel_test flywheel; do
  as_pg psql -p "$PORT" -qtAc "select 1 from pg_database where datname='$db'" | grep -q 1 \
    || as_pg psql -p "$PORT" -qc "create database $db owner flywheel"
done
echo "postgres: ready on 127.0.0.1:$PORT (role flywheel, databases flywheel_test, flywheel)"
