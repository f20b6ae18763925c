#!/bin/sh
# MLflow server with basic auth (docker-compose.yml). The admin password comes from the
# environment; MLflow reads its auth settings from an ini file, so write one at start.
set -eu
: "${MLFLOW_ADMIN_PASSWORD:?set MLFLOW_ADMIN_PASSWORD}"
cat > /tmp/basic_auth.ini <<INI
[mlflow]
default_permission = READ
database_uri = ${MLFLOW_AUTH_DATABASE_URI}
admin_username = admin
admin_password = ${MLFLOW_ADMIN_PASSWORD}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
INI
export MLFLOW_AUTH_CONFIG_PATH=/tmp/basic_auth.ini
exec python -m mlflow server --app-name basic-auth --host 0.0.0.0 --port 5000 \
  --backend-store-uri "${MLFLOW_BACKEND_STORE_URI}" \
  --artifacts-destination /var/lib/flywheel/mlflow-artifacts --serve-artifacts
