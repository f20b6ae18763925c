-- Extra databases for MLflow's tracking store and its basic-auth store (docker-compose.yml).
CREATE DATABASE mlflow OWNER flywheel;
CREATE DATABASE mlflow_auth OWNER flywheel;
